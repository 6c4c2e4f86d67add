/* A depthwise convolution that ONNX Runtime runs in float between a DequantizeLinear and a
   QuantizeLinear (a Relu or Clip the output's step does not make redundant keeps it out of the
   QDQ fusion: qcnn_float.py says when), computed as ONNX Runtime computes it, bit for bit:

   - the input dequantized, (x - zero) * scale, into a padded float scratch (0 in the pads, as
     MLAS's im2col writes them);
   - per channel MLAS's one-row SGEMM over the taps (MlasSgemmKernelM1Avx): the taps taken in
     groups of four, then one of two, then one; a group's products added left to right, the
     group's sum then added to the running one (0 before the first); a multiply then an add,
     never an FMA (-std=c11 contracts none);
   - the bias (ONNX Runtime's int32 times x_scale * w_scale, qcnn_float.py), the Relu's or Clip's
     bounds, then QuantizeLinear (x / scale, clamped, rounded half to even, plus the zero point).

   Included once by qcnn.c (its F_* fields). */

/* x1: 1 + the byte offset of the two bounds; moff: x_scale then y_scale; woff: [tap][c] float
   weights; boff: c float biases; scr: the float scratch [n][ph][pw][c]. */
static void fdwconv_q(const int64_t *r, const uint8_t *params, uint8_t *arena) {
    const int64_t n = r[F_N], c = r[F_C], h = r[F_H], w = r[F_W], oh = r[F_OH], ow = r[F_OW];
    const int64_t kh = r[F_KH], kw = r[F_KW], sh = r[F_SH], sw = r[F_SW], dh = r[F_DH];
    const int64_t dw = r[F_DW], pt = r[F_PT], pl = r[F_PL], ph = r[F_PH], pw = r[F_PW];
    const int64_t taps = kh * kw;
    const float *scales = (const float *)(params + r[F_MOFF]);
    const float *weights = (const float *)(params + r[F_WOFF]);
    const float *bias = (const float *)(params + r[F_BOFF]);
    const float *clip = (const float *)(params + r[F_X1] - 1);
    const float xs = scales[0], ys = scales[1], cl = clip[0], ch = clip[1];
    const int32_t zx = (int32_t)r[F_ZX], zy = (int32_t)r[F_ZY];
    const float fl = (float)(r[F_LO] - zy), fh = (float)(r[F_HI] - zy);
    const int sgn = (int)r[F_SIGNED];
    const uint8_t *x = arena + r[F_IN];
    uint8_t *y = arena + r[F_OUT];
    float *s = (float *)(arena + r[F_SCR]);
    memset(s, 0, (size_t)(n * ph * pw * c) * sizeof(float));
    for (int64_t b = 0; b < n; ++b)
        for (int64_t iy = 0; iy < h; ++iy) { /* a row's w * c values, contiguous both sides */
            const int64_t from = (b * h + iy) * w * c, count = w * c;
            float *to = s + ((b * ph + iy + pt) * pw + pl) * c;
            if (sgn)
                for (int64_t i = 0; i < count; ++i)
                    to[i] = (float)((int32_t)((const int8_t *)x)[from + i] - zx) * xs;
            else
                for (int64_t i = 0; i < count; ++i) to[i] = (float)((int32_t)x[from + i] - zx) * xs;
        }
    int64_t at[taps];
    for (int64_t t = 0; t < taps; ++t) at[t] = ((t / kw) * dh * pw + (t % kw) * dw) * c;
    for (int64_t b = 0; b < n; ++b)
        for (int64_t oy = 0; oy < oh; ++oy)
            for (int64_t ox = 0; ox < ow; ++ox) {
                const float *corner = s + ((b * ph + oy * sh) * pw + ox * sw) * c;
                uint8_t *out = y + ((b * oh + oy) * ow + ox) * c;
                int64_t k = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__) /* the same operations, 16 channels */
                for (; k + 16 <= c; k += 16) {
                    __m512 acc = _mm512_setzero_ps();
                    for (int64_t t = 0; t < taps;) {
                        const int64_t left = taps - t, g = left >= 4 ? 4 : left >= 2 ? 2 : 1;
                        __m512 part = _mm512_mul_ps(_mm512_loadu_ps(corner + at[t] + k),
                                                    _mm512_loadu_ps(weights + t * c + k));
                        for (int64_t i = 1; i < g; ++i)
                            part = _mm512_add_ps(part, _mm512_mul_ps(
                                _mm512_loadu_ps(corner + at[t + i] + k),
                                _mm512_loadu_ps(weights + (t + i) * c + k)));
                        acc = _mm512_add_ps(part, acc);
                        t += g;
                    }
                    __m512 v = _mm512_add_ps(acc, _mm512_loadu_ps(bias + k));
                    v = _mm512_min_ps(_mm512_max_ps(v, _mm512_set1_ps(cl)), _mm512_set1_ps(ch));
                    v = _mm512_div_ps(v, _mm512_set1_ps(ys));
                    v = _mm512_min_ps(_mm512_max_ps(v, _mm512_set1_ps(fl)), _mm512_set1_ps(fh));
                    _mm_storeu_si128((__m128i *)(out + k), _mm512_cvtepi32_epi8(_mm512_add_epi32(
                                                               _mm512_cvtps_epi32(v),
                                                               _mm512_set1_epi32(zy))));
                }
#endif
#if defined(__AVX2__)
                for (; k + 8 <= c; k += 8) { /* the scalar loop's operations, 8 channels at once */
                    __m256 acc = _mm256_setzero_ps();
                    for (int64_t t = 0; t < taps;) {
                        const int64_t left = taps - t, g = left >= 4 ? 4 : left >= 2 ? 2 : 1;
                        __m256 part = _mm256_mul_ps(_mm256_loadu_ps(corner + at[t] + k),
                                                    _mm256_loadu_ps(weights + t * c + k));
                        for (int64_t i = 1; i < g; ++i)
                            part = _mm256_add_ps(part, _mm256_mul_ps(
                                _mm256_loadu_ps(corner + at[t + i] + k),
                                _mm256_loadu_ps(weights + (t + i) * c + k)));
                        acc = _mm256_add_ps(part, acc);
                        t += g;
                    }
                    __m256 v = _mm256_add_ps(acc, _mm256_loadu_ps(bias + k));
                    v = _mm256_min_ps(_mm256_max_ps(v, _mm256_set1_ps(cl)), _mm256_set1_ps(ch));
                    v = _mm256_div_ps(v, _mm256_set1_ps(ys));
                    v = _mm256_min_ps(_mm256_max_ps(v, _mm256_set1_ps(fl)), _mm256_set1_ps(fh));
                    int32_t q[8];
                    _mm256_storeu_si256((__m256i *)q, _mm256_add_epi32(_mm256_cvtps_epi32(v),
                                                                       _mm256_set1_epi32(zy)));
                    for (int j = 0; j < 8; ++j) out[k + j] = (uint8_t)q[j];
                }
#endif
                for (; k < c; ++k) {
                    float acc = 0.0f;
                    for (int64_t t = 0; t < taps;) {
                        const int64_t left = taps - t, g = left >= 4 ? 4 : left >= 2 ? 2 : 1;
                        float part = corner[at[t] + k] * weights[t * c + k];
                        for (int64_t i = 1; i < g; ++i)
                            part = part + corner[at[t + i] + k] * weights[(t + i) * c + k];
                        acc = part + acc;
                        t += g;
                    }
                    float v = acc + bias[k];
                    v = v > cl ? v : cl;
                    v = v < ch ? v : ch;
                    v = v / ys;
                    v = v > fl ? v : fl;
                    v = v < fh ? v : fh;
                    out[k] = (uint8_t)((int32_t)nearbyintf(v) + zy);
                }
            }
}

/* The requantization of a convolution whose bias is a float (a QAT export's, no integer of
   x_scale * w_scale): as the graph writes it, the bias added to the real sum, float(acc) *
   (x_scale * w_scale) + bias, then QuantizeLinear's v / y_scale, clamped, rounded half to even.
   The graph's float convolution rounds its sums otherwise: a value within a rounding of a tie
   may land a step apart. The record's in2: the byte offset of the biases, then the x_scale *
   w_scale, each blocks * OCB long, then y_scale (qcnn_float.py). */
static void requantize_f(const int32_t *acc, const float *bias, const float *sxw, float ys,
                         uint8_t *y, int64_t ocount, int32_t zy, float fl, float fh) {
    int64_t j = 0;
#if defined(__AVX2__)
    for (; j + 8 <= ocount; j += 8) { /* the loop below's operations, 8 at a time */
        __m256 v = _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_loadu_si256(
                                                   (const __m256i *)(acc + j))),
                                               _mm256_loadu_ps(sxw + j)),
                                 _mm256_loadu_ps(bias + j));
        v = _mm256_div_ps(v, _mm256_set1_ps(ys));
        v = _mm256_min_ps(_mm256_max_ps(v, _mm256_set1_ps(fl)), _mm256_set1_ps(fh));
        int32_t q[8];
        _mm256_storeu_si256((__m256i *)q, _mm256_add_epi32(_mm256_cvtps_epi32(v),
                                                           _mm256_set1_epi32(zy)));
        for (int k = 0; k < 8; ++k) y[j + k] = (uint8_t)q[k];
    }
#endif
    for (; j < ocount; ++j) {
        float v = (float)acc[j] * sxw[j] + bias[j];
        v = v / ys;
        v = v > fl ? v : fl;
        v = v < fh ? v : fh;
        y[j] = (uint8_t)((int32_t)nearbyintf(v) + zy);
    }
}

/* Float glue between DequantizeLinear and QuantizeLinear (a hard-swish written out: HardSigmoid,
   Mul), each operation rounded on its own as ONNX Runtime's kernels do (alpha * x, + beta, then
   the bounds; a NaN stays NaN). */
static void hard_sigmoid(const float *restrict x, float *restrict y, int64_t n, float alpha,
                         float beta) {
    for (int64_t i = 0; i < n; ++i) {
        float v = alpha * x[i];
        v = v + beta;
        v = v > 1.0f ? 1.0f : v;
        y[i] = v < 0.0f ? 0.0f : v;
    }
}

static void mul_f(const float *restrict a, const float *restrict b, float *restrict y, int64_t n) {
    for (int64_t i = 0; i < n; ++i) y[i] = a[i] * b[i];
}
