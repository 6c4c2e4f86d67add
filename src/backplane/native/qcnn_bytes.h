/* A quantized convolution on bytes (OP_QCONV8): the input kept as unsigned bytes, the weight
   centred as signed bytes, four products an int32 lane with AVX-512 VNNI's vpdpbusd (64 exact
   u8 x s8 products an instruction, summed in 32 bits: no saturation, unlike AVX2's
   _mm256_maddubs_epi16) where the int16 pairs of qconv do 16 (vpdpwssd, 256 bits).

   Exact, the same sums as qconv: the input is not centred; sum (x - zx) * w = sum x * w - zx *
   sum w, and the pads hold zx (a pad's centred value is 0), so the second term is a constant of
   the output channel over every window: qcnn_layers.py folds -zx * sum w into the int32 bias at
   load. A signed input is made unsigned by flipping its top bit (x + 128, its zero point zx +
   128). Planned only where every centred weight is a signed byte and no partial sum can leave
   int32 (qcnn_bytes.py's pack); a scalar path for CPUs without VNNI (the plan takes this op only
   where the library says it has it: backplane_qcnn_bytes).

   Here too QuantizeLinear and DequantizeLinear (bytes out and in), and a max pool of bytes.
   Included once by qcnn.c (its F_* fields, OCB, requantize, bounds). */

/* y = clamp(round_half_even(x / scale), lo - zero, hi - zero) + zero, as MLAS: a NaN takes the
   low end (maxps keeps its second operand where either is NaN). */
static void quantize(const float *restrict x, uint8_t *restrict y, int64_t n, float scale,
                     int32_t zero, int32_t lo, int32_t hi, int sgn) {
    const float fl = (float)(lo - zero), fh = (float)(hi - zero);
    int64_t i = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__) /* the same, 16 at once, each low byte kept */
    for (; i + 16 <= n; i += 16) {
        __m512 v = _mm512_div_ps(_mm512_loadu_ps(x + i), _mm512_set1_ps(scale));
        v = _mm512_min_ps(_mm512_max_ps(v, _mm512_set1_ps(fl)), _mm512_set1_ps(fh));
        _mm_storeu_si128((__m128i *)(y + i), _mm512_cvtepi32_epi8(_mm512_add_epi32(
                                                  _mm512_cvtps_epi32(v), _mm512_set1_epi32(zero))));
    }
#endif
#if defined(__AVX2__)
    const __m256 vs = _mm256_set1_ps(scale), vl = _mm256_set1_ps(fl), vh = _mm256_set1_ps(fh);
    const __m256i vz = _mm256_set1_epi32(zero);
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_div_ps(_mm256_loadu_ps(x + i), vs);
        v = _mm256_min_ps(_mm256_max_ps(v, vl), vh);
        __m256i k = _mm256_add_epi32(_mm256_cvtps_epi32(v), vz);
        int32_t out[8];
        _mm256_storeu_si256((__m256i *)out, k);
        for (int j = 0; j < 8; ++j) y[i + j] = (uint8_t)out[j];
    }
#endif
    for (; i < n; ++i) {
        float v = x[i] / scale;
        v = v > fl ? v : fl;
        v = v < fh ? v : fh;
        y[i] = (uint8_t)((int32_t)nearbyintf(v) + zero);
    }
    (void)sgn;
}

static void dequantize(const uint8_t *restrict x, float *restrict y, int64_t n, float scale,
                       int32_t zero, int sgn, int relu) {
#if defined(__AVX512F__) && defined(__AVX512BW__) /* the loops below' operations, 16 at once */
    int64_t i = 0;
    const __m512 vs = _mm512_set1_ps(scale), z = _mm512_setzero_ps();
    for (; i + 16 <= n; i += 16) {
        const __m128i b = _mm_loadu_si128((const __m128i *)(x + i));
        const __m512i k = sgn ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b);
        __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(k, _mm512_set1_epi32(zero))),
                                 vs);
        if (relu)
            v = _mm512_mask_mov_ps(v, _mm512_cmp_ps_mask(v, z, _CMP_LT_OQ), z);
        _mm512_storeu_ps(y + i, v);
    }
    x += i, y += i, n -= i;
#endif
    if (sgn)
        for (int64_t i = 0; i < n; ++i) y[i] = (float)((int32_t)((const int8_t *)x)[i] - zero) * scale;
    else
        for (int64_t i = 0; i < n; ++i) y[i] = (float)((int32_t)x[i] - zero) * scale;
    if (relu)
        for (int64_t i = 0; i < n; ++i) y[i] = y[i] < 0.0f ? 0.0f : y[i];
}

/* The input as bytes into the padded scratch [n][ph][pw][icp]: zx (the unsigned zero point) in
   the pads and the channels past c, a signed input's top bit flipped; padded rows [begin, end)
   of the n * ph (each row whole: a part of the crew's job). */
static void pad_rows(const int64_t *r, const uint8_t *x, uint8_t *restrict s, uint8_t zero,
                     int64_t begin, int64_t end) {
    const int64_t h = r[F_H], w = r[F_W], c = r[F_C], ph = r[F_PH], pw = r[F_PW];
    const int64_t cs = r[F_CS] ? r[F_CS] : c, icp = r[F_ICP], pt = r[F_PT], pl = r[F_PL];
    const uint8_t flip = r[F_SIGNED] ? 0x80 : 0;
    for (int64_t row = begin; row < end; ++row) {
        const int64_t b = row / ph, y = row % ph - pt;
        uint8_t *dst = s + row * pw * icp;
        memset(dst, zero, (size_t)(pw * icp));
        if (y < 0 || y >= h) continue;
        const uint8_t *src = x + ((b * h + y) * w) * cs;
        dst += pl * icp;
        if (cs == c && icp == c) /* a row's w * c values, contiguous both sides */
            for (int64_t i = 0; i < w * c; ++i) dst[i] = src[i] ^ flip;
        else
            for (int64_t px = 0; px < w; ++px)
                for (int64_t k = 0; k < c; ++k) dst[px * icp + k] = src[px * cs + k] ^ flip;
    }
}

/* Whether the convolution reads its input where it is: no pads, unsigned, a pixel's channels
   the scratch's (icp == c, the whole pixel read): the scratch would be a copy (a 1x1 layer's
   input, 0.4 MB at 112x112x32). */
static int bytes_in_place(const int64_t *r) {
    return r[F_PH] == r[F_H] && r[F_PW] == r[F_W] && r[F_ICP] == r[F_C] && !r[F_SIGNED] &&
           (r[F_CS] == 0 || r[F_CS] == r[F_C]);
}

static void pad_part(const int64_t *r, const uint8_t *params, uint8_t *arena, int64_t begin,
                     int64_t end) {
    (void)params;
    pad_rows(r, arena + r[F_IN], arena + r[F_SCR],
             (uint8_t)((int32_t)r[F_ZX] + (r[F_SIGNED] ? 128 : 0)), begin, end);
}

/* A block's requantization: qconv's (int32 bias, multipliers) or, with a float bias (sxw set),
   requantize_f's (x_scale * w_scale, the float bias, y_scale), the bias (less zx * the weights'
   sum) added to the sums first. */
typedef struct {
    const int32_t *bias;
    const float *mult, *sxw, *fbias;
    float ys, fl, fh;
    int32_t zy;
    int64_t count;
    int sgn;
} Requant;

#if defined(__AVX512VNNI__) && defined(__AVX512F__) && defined(__AVX512BW__) && \
    defined(__AVX512VL__)
#define BYTES_VNNI 1
#define TILE8 12 /* pixels a register tile: 12 accumulators of AVX-512's 32 registers */
/* requantize's and requantize_f's operations on 16 sums in a register, in the same order (the
   outputs are theirs bit for bit); the values are within the type's range after the clamp, so
   each lane's low byte (vpmovdb) is the pack. */
static inline __attribute__((always_inline)) void requantize16(__m512i acc, const Requant *q,
                                                                uint8_t *y) {
    const __mmask16 m = (__mmask16)((1u << q->count) - 1);
    const __m512i sum = _mm512_add_epi32(acc, _mm512_maskz_loadu_epi32(m, q->bias));
    __m512 v;
    if (q->sxw) {
        v = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(sum), _mm512_maskz_loadu_ps(m, q->sxw)),
                          _mm512_maskz_loadu_ps(m, q->fbias));
        v = _mm512_div_ps(v, _mm512_set1_ps(q->ys));
    } else
        v = _mm512_mul_ps(_mm512_cvtepi32_ps(sum), _mm512_maskz_loadu_ps(m, q->mult));
    v = _mm512_min_ps(_mm512_max_ps(v, _mm512_set1_ps(q->fl)), _mm512_set1_ps(q->fh));
    const __m512i k = _mm512_add_epi32(_mm512_cvtps_epi32(v), _mm512_set1_epi32(q->zy));
    _mm_mask_storeu_epi8(y, m, _mm512_cvtepi32_epi8(k));
}

/* T pixels (their scratch rows at px[t], outputs at out[t]) by one block of OCB channels, T a
   constant where inlined: T accumulators of 16 int32 sums in registers, one weight vector, each
   pixel's four bytes broadcast; then each requantized from its register. The weight block is
   [kh][kw][quads][OCB][4] int8. */
static inline __attribute__((always_inline)) void tile_bytes(
    const uint8_t *const *px, uint8_t *const *out, const int8_t *restrict wb, int64_t kh,
    int64_t kw, int64_t quads, int64_t rowstep, int64_t colstep, const Requant *q, const int T) {
    __m512i a[TILE8];
#pragma GCC unroll 16
    for (int t = 0; t < T; ++t) a[t] = _mm512_setzero_si512();
    for (int64_t ky = 0; ky < kh; ++ky)
        for (int64_t kx = 0; kx < kw; ++kx) {
            const int64_t at = ky * rowstep + kx * colstep;
            const int8_t *wp = wb + ((ky * kw + kx) * quads) * OCB * 4;
            for (int64_t i = 0; i < 4 * quads; i += 4, wp += OCB * 4) {
                const __m512i wv = _mm512_loadu_si512((const void *)wp);
#pragma GCC unroll 16
                for (int t = 0; t < T; ++t) {
                    int32_t four;
                    memcpy(&four, px[t] + at + i, 4);
                    a[t] = _mm512_dpbusd_epi32(a[t], _mm512_set1_epi32(four), wv);
                }
            }
        }
#pragma GCC unroll 16
    for (int t = 0; t < T; ++t) requantize16(a[t], q, out[t]);
}
#endif

enum { STRIP = 48 }; /* pixels a strip (an item of the crew's job): their rows' pointers, then
                        block by block */

#if defined(BYTES_VNNI)
/* tile_bytes for two blocks at once (wb, wb + wnext): each pixel's four bytes broadcast once for
   both (a broadcast a vpdpbusd was the stem's and the small 1x1 layers' bound), 2T accumulators;
   outputs out[t] and out[t] + OCB. The same sums, the same requantization. */
static inline __attribute__((always_inline)) void tile_bytes2(
    const uint8_t *const *px, uint8_t *const *out, const int8_t *restrict wb, int64_t wnext,
    int64_t kh, int64_t kw, int64_t quads, int64_t rowstep, int64_t colstep, const Requant *q0,
    const Requant *q1, const int T) {
    __m512i a[TILE8][2];
#pragma GCC unroll 16
    for (int t = 0; t < T; ++t) a[t][0] = a[t][1] = _mm512_setzero_si512();
    for (int64_t ky = 0; ky < kh; ++ky)
        for (int64_t kx = 0; kx < kw; ++kx) {
            const int64_t at = ky * rowstep + kx * colstep;
            const int8_t *wp = wb + ((ky * kw + kx) * quads) * OCB * 4;
            for (int64_t i = 0; i < 4 * quads; i += 4, wp += OCB * 4) {
                const __m512i w0 = _mm512_loadu_si512((const void *)wp);
                const __m512i w1 = _mm512_loadu_si512((const void *)(wp + wnext));
#pragma GCC unroll 16
                for (int t = 0; t < T; ++t) {
                    int32_t four;
                    memcpy(&four, px[t] + at + i, 4);
                    const __m512i xv = _mm512_set1_epi32(four);
                    a[t][0] = _mm512_dpbusd_epi32(a[t][0], xv, w0);
                    a[t][1] = _mm512_dpbusd_epi32(a[t][1], xv, w1);
                }
            }
        }
#pragma GCC unroll 16
    for (int t = 0; t < T; ++t) {
        requantize16(a[t][0], q0, out[t]);
        requantize16(a[t][1], q1, out[t] + OCB);
    }
}
#endif

/* `tiles` pixels by two blocks (the second's weights wnext bytes on, its outputs OCB channels
   on): tile_bytes2's tiles of 12, 4 and 1 with VNNI, else block_bytes twice. */
static void block_bytes(const uint8_t *const *px, uint8_t *const *out, int64_t tiles,
                        const int8_t *restrict wb, int64_t kh, int64_t kw, int64_t quads,
                        int64_t rowstep, int64_t colstep, const Requant *q);

static void blocks_bytes2(const uint8_t *const *px, uint8_t *const *out, int64_t tiles,
                          const int8_t *restrict wb, int64_t wnext, int64_t kh, int64_t kw,
                          int64_t quads, int64_t rowstep, int64_t colstep, const Requant *q0,
                          const Requant *q1) {
#if defined(BYTES_VNNI)
    int64_t t = 0;
    for (; t + TILE8 <= tiles; t += TILE8)
        tile_bytes2(px + t, out + t, wb, wnext, kh, kw, quads, rowstep, colstep, q0, q1, TILE8);
    for (; t + 4 <= tiles; t += 4)
        tile_bytes2(px + t, out + t, wb, wnext, kh, kw, quads, rowstep, colstep, q0, q1, 4);
    for (; t < tiles; ++t)
        tile_bytes2(px + t, out + t, wb, wnext, kh, kw, quads, rowstep, colstep, q0, q1, 1);
#else
    uint8_t *second[STRIP];
    for (int64_t t = 0; t < tiles; ++t) second[t] = out[t] + OCB;
    block_bytes(px, out, tiles, wb, kh, kw, quads, rowstep, colstep, q0);
    block_bytes(px, second, tiles, wb + wnext, kh, kw, quads, rowstep, colstep, q1);
#endif
}

/* `tiles` pixels by one block: the widest register tiles that fit (VNNI), else plain loops. */
static void block_bytes(const uint8_t *const *px, uint8_t *const *out, int64_t tiles,
                        const int8_t *restrict wb, int64_t kh, int64_t kw, int64_t quads,
                        int64_t rowstep, int64_t colstep, const Requant *q) {
#if defined(BYTES_VNNI)
    int64_t t = 0;
    for (; t + TILE8 <= tiles; t += TILE8)
        tile_bytes(px + t, out + t, wb, kh, kw, quads, rowstep, colstep, q, TILE8);
    for (; t + 4 <= tiles; t += 4)
        tile_bytes(px + t, out + t, wb, kh, kw, quads, rowstep, colstep, q, 4);
    for (; t < tiles; ++t)
        tile_bytes(px + t, out + t, wb, kh, kw, quads, rowstep, colstep, q, 1);
#else
    for (int64_t t = 0; t < tiles; ++t) {
        uint32_t sum[OCB] = {0}; /* unsigned: the sums wrap as vpdpbusd's (the plan keeps them
                                    within int32 anyway) */
        for (int64_t ky = 0; ky < kh; ++ky)
            for (int64_t kx = 0; kx < kw; ++kx) {
                const uint8_t *xp = px[t] + ky * rowstep + kx * colstep;
                const int8_t *wp = wb + ((ky * kw + kx) * quads) * OCB * 4;
                for (int64_t i = 0; i < 4 * quads; ++i)
                    for (int j = 0; j < OCB; ++j)
                        sum[j] += (uint32_t)((int32_t)xp[i] * (int32_t)wp[(i / 4) * OCB * 4 +
                                                                         j * 4 + i % 4]);
            }
        int32_t acc[OCB];
        for (int j = 0; j < OCB; ++j) acc[j] = (int32_t)sum[j];
        if (q->sxw) {
            for (int64_t j = 0; j < q->count; ++j) acc[j] += q->bias[j];
            requantize_f(acc, q->fbias, q->sxw, q->ys, out[t], q->count, q->zy, q->fl, q->fh);
        } else
            requantize(acc, q->mult, q->bias, out[t], q->count, q->zy, q->fl, q->fh, q->sgn);
    }
#endif
}


static int64_t qconv8_items(const int64_t *r) {
    return r[F_N] * ((r[F_OH] * r[F_OW] + STRIP - 1) / STRIP);
}

/* qconv's record on bytes: weights [blocks][kh][kw][icp/4][OCB][4] int8 (dw 1: [blocks][kh]
   [ceil(kw * icp / 4)][OCB][4], a kernel row's values one run, zero past its end), bias int32
   (less zx * the weights' sum) and multipliers float, each blocks * OCB long. Strips [begin,
   end) of qconv8_items, the input padded into the scratch (or read in place: bytes_in_place). */
static void qconv8_part(const int64_t *r, const uint8_t *params, uint8_t *arena, int64_t begin,
                        int64_t end) {
    const int64_t oh = r[F_OH], ow = r[F_OW], oc = r[F_OC], kh = r[F_KH], kw = r[F_KW];
    const int64_t sh = r[F_SH], sw = r[F_SW], dh = r[F_DH], dw = r[F_DW], ph = r[F_PH];
    const int64_t pw = r[F_PW], icp = r[F_ICP];
    const uint8_t *s = arena + (bytes_in_place(r) ? r[F_IN] : r[F_SCR]);
    const int8_t *weights = (const int8_t *)(params + r[F_WOFF]);
    const int32_t *bias = (const int32_t *)(params + r[F_BOFF]);
    const float *mult = (const float *)(params + r[F_MOFF]);
    const float *fb = r[F_IN2] >= 0 ? (const float *)(params + r[F_IN2]) : 0; /* a float bias */
    uint8_t *y = arena + r[F_OUT];
    float fl, fh;
    bounds(r, params, &fl, &fh);
    const int64_t quads = dw == 1 ? (kw * icp + 3) / 4 : icp / 4;
    const int64_t blocks = (oc + OCB - 1) / OCB, wblock = kh * (dw == 1 ? 1 : kw) * quads * OCB * 4;
    const int64_t pixels = oh * ow, rowstep = dh * pw * icp, colstep = dw * icp;
    const int64_t ocs = r[F_OCS] ? r[F_OCS] : oc, per = (pixels + STRIP - 1) / STRIP;
    const uint8_t *px[STRIP];
    uint8_t *out[STRIP];
    for (int64_t item = begin; item < end; ++item) {
        const int64_t b = item / per, p0 = (item % per) * STRIP;
        const int64_t tiles = pixels - p0 < STRIP ? pixels - p0 : STRIP;
        for (int64_t t = 0; t < tiles; ++t) {
            const int64_t yy = (p0 + t) / ow, xx = (p0 + t) % ow;
            px[t] = s + ((b * ph + yy * sh) * pw + xx * sw) * icp;
        }
        for (int64_t k = 0; k < blocks;) {
            Requant q[2];
            for (int64_t j = 0; j < 2; ++j) { /* (a last lone block: q[1] is q[0], unused) */
                const int64_t at = (k + j < blocks ? k + j : k) * OCB;
                q[j] = (Requant){bias + at, mult + at, fb ? fb + blocks * OCB + at : 0,
                                 fb ? fb + at : 0, fb ? fb[2 * blocks * OCB] : 0.0f, fl, fh,
                                 (int32_t)r[F_ZY], oc - at < OCB ? oc - at : OCB, r[F_LO] < 0};
            }
            for (int64_t t = 0; t < tiles; ++t) out[t] = y + (b * pixels + p0 + t) * ocs + k * OCB;
            if (k + 1 < blocks) { /* two blocks a broadcast */
                blocks_bytes2(px, out, tiles, weights + k * wblock, wblock, kh, dw == 1 ? 1 : kw,
                              quads, rowstep, dw == 1 ? 0 : colstep, &q[0], &q[1]);
                k += 2;
            } else {
                block_bytes(px, out, tiles, weights + k * wblock, kh, dw == 1 ? 1 : kw, quads,
                            rowstep, dw == 1 ? 0 : colstep, &q[0]);
                k += 1;
            }
        }
    }
}

static void qconv_bytes(const int64_t *r, const uint8_t *params, uint8_t *arena) {
    if (!bytes_in_place(r)) pad_part(r, params, arena, 0, r[F_N] * r[F_PH]);
    qconv8_part(r, params, arena, 0, qconv8_items(r));
}

/* A max pool of 8-bit values (unsigned, or signed where sgn), channels-last: each output pixel
   its window's inside taps' maximum, channel by channel (the pads never win; the type's lowest
   where no tap is inside), 16 channels an instruction: POOL's loop left a pixel's 16 channels
   to the scalar epilogue of a wider vector (maxpool_q 3.7 us on resnet_qdq_ort17's 8x8x16). */
static void maxpool_rows(const int64_t *r, const uint8_t *restrict x, uint8_t *restrict y,
                         int sgn, int64_t begin, int64_t end) { /* output rows of n * oh */
    const int64_t h = r[F_H], w = r[F_W], c = r[F_C], oh = r[F_OH], ow = r[F_OW];
    const int64_t kh = r[F_KH], kw = r[F_KW], sh = r[F_SH], sw = r[F_SW], dh = r[F_DH];
    const int64_t dw = r[F_DW], pt = r[F_PT], pl = r[F_PL];
    for (int64_t row = begin; row < end; ++row) {
        const int64_t b = row / oh, oy = row % oh;
            for (int64_t ox = 0; ox < ow; ++ox) {
                uint8_t *out = y + ((b * oh + oy) * ow + ox) * c;
                memset(out, sgn ? 0x80 : 0, (size_t)c);
                for (int64_t ky = 0; ky < kh; ++ky) {
                    const int64_t iy = oy * sh - pt + ky * dh;
                    if (iy < 0 || iy >= h) continue;
                    for (int64_t kx = 0; kx < kw; ++kx) {
                        const int64_t ix = ox * sw - pl + kx * dw;
                        if (ix < 0 || ix >= w) continue;
                        const uint8_t *in = x + ((b * h + iy) * w + ix) * c;
                        int64_t k = 0;
#if defined(__AVX2__)
                        for (; k + 16 <= c; k += 16) {
                            const __m128i a = _mm_loadu_si128((const __m128i *)(in + k));
                            const __m128i o = _mm_loadu_si128((const __m128i *)(out + k));
                            _mm_storeu_si128((__m128i *)(out + k),
                                             sgn ? _mm_max_epi8(a, o) : _mm_max_epu8(a, o));
                        }
#endif
                        if (sgn)
                            for (; k < c; ++k) {
                                const int8_t a = (int8_t)in[k], o = (int8_t)out[k];
                                out[k] = (uint8_t)(a > o ? a : o);
                            }
                        else
                            for (; k < c; ++k) out[k] = in[k] > out[k] ? in[k] : out[k];
                    }
                }
            }
    }
}

static void maxpool_part(const int64_t *r, const uint8_t *params, uint8_t *arena, int64_t begin,
                         int64_t end) {
    (void)params;
    maxpool_rows(r, arena + r[F_IN], arena + r[F_OUT], (int)r[F_SIGNED], begin, end);
}

/* 1 where this build multiplies bytes with VNNI (the plan then takes OP_QCONV8), else 0. */
int backplane_qcnn_bytes(void) {
#if defined(BYTES_VNNI)
    return 1;
#else
    return 0;
#endif
}
