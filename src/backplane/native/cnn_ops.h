/* cnn.c's layers other than the convolutions: pools, the classifier, elementwise arithmetic,
   resizes, the moves (gather, scatter, slices), reductions and normalizations. Included once, by
   cnn.c, after its record fields, vector helpers and finish(): one translation unit, so the
   compiler inlines across it as before the split (the build keys a library by this header too). */
/* One max pooling window's channels into o: 16 (AVX-512) or 8 channels at a time in registers (a
   NaN in the window is its maximum: a NaN taken, and then kept, since no comparison with it
   holds). */
static void max_window(const float *restrict in, float *restrict o, int64_t h0, int64_t w0,
                       int64_t H, int64_t W, int64_t C, int64_t KH, int64_t KW, int64_t DH,
                       int64_t DW) {
    int64_t c = 0;
#if defined(__AVX512F__)
    for (; c + 16 <= C; c += 16) {  /* 16 at a time: the comparisons' masks, then a blend */
        __m512 m = _mm512_set1_ps(-INFINITY);
        for (int64_t kh = 0; kh < KH; ++kh) {
            const int64_t h = h0 + kh * DH;
            if (h < 0 || h >= H) continue;
            for (int64_t kw = 0; kw < KW; ++kw) {
                const int64_t w = w0 + kw * DW;
                if (w < 0 || w >= W) continue;
                const __m512 x = _mm512_loadu_ps(in + (h * W + w) * C + c);
                const __mmask16 take = _mm512_cmp_ps_mask(x, m, _CMP_GT_OQ) |
                                       _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
                m = _mm512_mask_blend_ps(take, m, x);
            }
        }
        _mm512_storeu_ps(o + c, m);
    }
#endif
    for (; c + 8 <= C; c += 8) {
        v8 m = vsplat(-INFINITY);
        for (int64_t kh = 0; kh < KH; ++kh) {
            const int64_t h = h0 + kh * DH;
            if (h < 0 || h >= H) continue;
            for (int64_t kw = 0; kw < KW; ++kw) {
                const int64_t w = w0 + kw * DW;
                if (w < 0 || w >= W) continue;
                const v8 x = vload(in + (h * W + w) * C + c);
                m = vselect((x > m) | (x != x), x, m);
            }
        }
        vstore(o + c, m);
    }
    for (; c < C; ++c) {
        float m = -INFINITY;
        for (int64_t kh = 0; kh < KH; ++kh) {
            const int64_t h = h0 + kh * DH;
            if (h < 0 || h >= H) continue;
            for (int64_t kw = 0; kw < KW; ++kw) {
                const int64_t w = w0 + kw * DW;
                if (w < 0 || w >= W) continue;
                const float x = in[(h * W + w) * C + c];
                m = (x > m || x != x) ? x : m;
            }
        }
        o[c] = m;
    }
}

/* Max or average pooling; the window clipped to the input (PyTorch's and CpuRef's windows:
   F_X1 counts the padding into an average's divisor, the window then clipped at H + the end pad,
   whose ends are F_PH, F_PW here). A NaN in a window is the window's maximum. */
static void pool_rows(const int64_t *f, float *A, int is_max, int64_t r0, int64_t r1) {
    const int64_t H = f[F_H], W = f[F_W], C = f[F_C], OH = f[F_OH], OW = f[F_OW];
    const int64_t KH = f[F_KH], KW = f[F_KW], SH = f[F_SH], SW = f[F_SW], DH = f[F_DH],
                  DW = f[F_DW], PT = f[F_PT], PL = f[F_PL], HE = f[F_PH], WE = f[F_PW];
    const float *restrict in = A + f[F_IN];
    float *restrict out = A + f[F_OUT];
    for (int64_t row = r0; row < r1; ++row) {  /* output rows [r0, r1) of the N x OH */
        const int64_t n = row / OH, oh = row % OH;
        for (int64_t ow = 0; ow < OW; ++ow) {
            float *restrict o = out + ((n * OH + oh) * OW + ow) * C;
            const int64_t h0 = oh * SH - PT, w0 = ow * SW - PL;
            if (is_max) {
                max_window(in + n * H * W * C, o, h0, w0, H, W, C, KH, KW, DH, DW);
                continue;
            }
            int64_t hs = h0, ws = w0, he = h0 + KH, we = w0 + KW;
            he = he < HE ? he : HE;
            we = we < WE ? we : WE;
            int64_t count = (he - hs) * (we - ws);
            hs = hs < 0 ? 0 : hs;
            ws = ws < 0 ? 0 : ws;
            he = he < H ? he : H;
            we = we < W ? we : W;
            if (!f[F_X1]) count = (he - hs) * (we - ws);
            for (int64_t c = 0; c < C; ++c) o[c] = 0.0f;
            for (int64_t h = hs; h < he; ++h)
                for (int64_t w = ws; w < we; ++w) {
                    const float *restrict x = in + ((n * H + h) * W + w) * C;
                    for (int64_t c = 0; c < C; ++c) o[c] += x[c];
                }
            const float scale = 1.0f / (float)count;
            for (int64_t c = 0; c < C; ++c) o[c] *= scale;
        }
    }
}

static void pool(const int64_t *f, float *A, int is_max) {
    pool_rows(f, A, is_max, 0, f[F_N] * f[F_OH]);
}

static void global_pool(const int64_t *f, float *A, int is_max) {
    const int64_t N = f[F_N], HW = f[F_H] * f[F_W], C = f[F_C];
    const float *restrict in = A + f[F_IN];
    float *restrict out = A + f[F_OUT];
    for (int64_t n = 0; n < N; ++n, out += C) {
        for (int64_t c = 0; c < C; ++c) out[c] = is_max ? -INFINITY : 0.0f;
        for (int64_t p = 0; p < HW; ++p) {
            const float *restrict x = in + (n * HW + p) * C;
            if (is_max)
                for (int64_t c = 0; c < C; ++c)
                    out[c] = (x[c] > out[c] || x[c] != x[c]) ? x[c] : out[c];
            else
                for (int64_t c = 0; c < C; ++c) out[c] += x[c];
        }
        if (!is_max)
            for (int64_t c = 0; c < C; ++c) out[c] /= (float)HW;
    }
}

/* rows x K times K x OC (the weight packed transposed, [k][oc]) plus bias, then residual, act. */
static void linear(const int64_t *f, float *A, const float *P) {
    const int64_t rows = f[F_N], K = f[F_C], OC = f[F_OC];
    const float *restrict wt = P + f[F_WOFF], *restrict bias = P + f[F_BOFF];
    for (int64_t r = 0; r < rows; ++r) {
        const float *restrict x = A + f[F_IN] + r * K;
        float *restrict o = A + f[F_OUT] + r * OC;
        for (int64_t j = 0; j < OC; ++j) o[j] = bias[j];
        for (int64_t k = 0; k < K; ++k)
            for (int64_t j = 0; j < OC; ++j) o[j] = fmaf(x[k], wt[k * OC + j], o[j]);
    }
    finish(A + f[F_OUT], f[F_IN2] >= 0 ? A + f[F_IN2] : 0, rows * OC, f[F_ACT], P + f[F_AOFF]);
}

static void binary(const int64_t *f, float *A, const float *P, int is_mul) {
    const int64_t n = f[F_N];
    const float *restrict x = A + f[F_IN], *restrict y = A + f[F_IN2];
    float *restrict o = A + f[F_OUT];
    if (is_mul)
        for (int64_t i = 0; i < n; ++i) o[i] = x[i] * y[i];
    else
        for (int64_t i = 0; i < n; ++i) o[i] = x[i] + y[i];
    finish(o, 0, n, f[F_ACT], P + f[F_AOFF]);
}

/* A transposed convolution (groups 1), weights [kh][kw][ic][OC]: each input pixel's products
   added into the output pixels its taps reach, 16 (AVX-512) or 8 output channels at a time in a
   register over the input channels (one load and store a tap, not one a product; each output's
   sums in the same order as one channel at a time). */
static void deconv(const int64_t *f, float *A, const float *P) {
    const int64_t N = f[F_N], H = f[F_H], W = f[F_W], C = f[F_C], OH = f[F_OH], OW = f[F_OW];
    const int64_t OC = f[F_OC], KH = f[F_KH], KW = f[F_KW], SH = f[F_SH], SW = f[F_SW],
                  DH = f[F_DH], DW = f[F_DW], PT = f[F_PT], PL = f[F_PL], OC8 = OC / 8 * 8;
    const float *restrict in = A + f[F_IN], *restrict wt = P + f[F_WOFF],
                          *restrict bias = P + f[F_BOFF];
    float *restrict out = A + f[F_OUT];
    for (int64_t p = 0; p < N * OH * OW; ++p)
        for (int64_t oc = 0; oc < OC; ++oc) out[p * OC + oc] = bias[oc];
    for (int64_t n = 0; n < N; ++n)
        for (int64_t ih = 0; ih < H; ++ih)
            for (int64_t iw = 0; iw < W; ++iw) {
                const float *restrict x = in + ((n * H + ih) * W + iw) * C;
                for (int64_t kh = 0; kh < KH; ++kh) {
                    const int64_t oh = ih * SH - PT + kh * DH;
                    if (oh < 0 || oh >= OH) continue;
                    for (int64_t kw = 0; kw < KW; ++kw) {
                        const int64_t ow = iw * SW - PL + kw * DW;
                        if (ow < 0 || ow >= OW) continue;
                        float *restrict o = out + ((n * OH + oh) * OW + ow) * OC;
                        const float *restrict w = wt + (kh * KW + kw) * C * OC;
                        int64_t oc = 0;
#if defined(__AVX512F__)
                        for (; oc + 16 <= OC; oc += 16) {  /* 16 a register on AVX-512 */
                            __m512 acc = _mm512_loadu_ps(o + oc);
                            for (int64_t ic = 0; ic < C; ++ic)
                                acc = _mm512_fmadd_ps(_mm512_set1_ps(x[ic]),
                                                      _mm512_loadu_ps(w + ic * OC + oc), acc);
                            _mm512_storeu_ps(o + oc, acc);
                        }
#endif
                        for (; oc < OC8; oc += 8) {
                            v8 acc = vload(o + oc);
                            for (int64_t ic = 0; ic < C; ++ic)
                                acc = vfma(vsplat(x[ic]), vload(w + ic * OC + oc), acc);
                            vstore(o + oc, acc);
                        }
                        for (int64_t oc = OC8; oc < OC; ++oc) {
                            float acc = o[oc];
                            for (int64_t ic = 0; ic < C; ++ic)
                                acc = fmaf(x[ic], w[ic * OC + oc], acc);
                            o[oc] = acc;
                        }
                    }
                }
            }
    finish(out, 0, N * OH * OW * OC, f[F_ACT], P + f[F_AOFF]);
}

/* Resize of H and W by two taps an axis (linear; nearest: one, the other weighing 0), from the
   tables at F_WOFF (OH rows of first, second, weight, weight) and F_BOFF (OW rows): a tap that
   weighs 0 is not read (CpuRef's taps_of: a NaN stays where it is read). */
#if defined(__AVX512F__)
enum { RESIZE_ROW = 16384 };  /* the floats of an input row the separable resize blends on the stack */

/* resize() in two passes on AVX-512: each output row's two input rows blended first (W x C
   contiguous floats, 16 a register), then each output pixel's two columns of that blend (C
   channels through a mask): the taps' bookkeeping once a row and once a pixel, where resize()
   weighs four taps a pixel 8 channels at a time (unet_resize's 8 channels: one register a
   pixel). A tap that weighs 0 is not read in either pass (a NaN stays where it is read, as
   CpuRef's taps_of). Returns 0 where a row is too long for the stack (resize() runs then). */
static int resize_rows(const int64_t *f, float *A, const float *P, int64_t r0, int64_t r1) {
    const int64_t H = f[F_H], W = f[F_W], C = f[F_C], OH = f[F_OH], OW = f[F_OW];
    if (W * C > RESIZE_ROW) return 0;
    const float *restrict in = A + f[F_IN], *rows = P + f[F_WOFF], *cols = P + f[F_BOFF];
    float *restrict out = A + f[F_OUT];
    float blend[W * C];
    const int64_t WC = W * C, WC16 = WC / 16 * 16;
    for (int64_t row = r0; row < r1; ++row) {  /* output rows [r0, r1) of the N x OH */
        const int64_t n = row / OH, oh = row % OH;
        const float *hr = rows + oh * 4, *x[2];
        float weight[2];
        int taps = 0;
        for (int a = 0; a < 2; ++a)
            if (hr[2 + a] != 0.0f) {
                weight[taps] = hr[2 + a];
                x[taps++] = in + (n * H + (int64_t)hr[a]) * WC;
            }
        int64_t i = 0;
        for (; i < WC16; i += 16) {
            __m512 acc = _mm512_setzero_ps();
            for (int t = 0; t < taps; ++t)
                acc = _mm512_fmadd_ps(_mm512_set1_ps(weight[t]), _mm512_loadu_ps(x[t] + i),
                                      acc);
            _mm512_storeu_ps(blend + i, acc);
        }
        for (; i < WC; ++i) {
            float acc = 0.0f;
            for (int t = 0; t < taps; ++t) acc = fmaf(weight[t], x[t][i], acc);
            blend[i] = acc;
        }
        for (int64_t ow = 0; ow < OW; ++ow) {
            const float *wr = cols + ow * 4, *y[2];
            float across[2];
            int ctaps = 0;
            for (int b = 0; b < 2; ++b)
                if (wr[2 + b] != 0.0f) {
                    across[ctaps] = wr[2 + b];
                    y[ctaps++] = blend + (int64_t)wr[b] * C;
                }
            float *restrict o = out + ((n * OH + oh) * OW + ow) * C;
            for (int64_t c = 0; c < C; c += 16) {
                const __mmask16 lanes = (__mmask16)(C - c >= 16 ? 0xffffu
                                                    : (1u << (C - c)) - 1u);
                __m512 acc = _mm512_setzero_ps();
                for (int t = 0; t < ctaps; ++t)
                    acc = _mm512_fmadd_ps(_mm512_set1_ps(across[t]),
                                          _mm512_maskz_loadu_ps(lanes, y[t] + c), acc);
                _mm512_mask_storeu_ps(o + c, lanes, acc);
            }
        }
    }
    return 1;
}
#endif

/* Output rows [r0, r1) of the N x OH (the pool's items). */
static void resize_part(const int64_t *f, float *A, const float *P, int64_t r0, int64_t r1) {
#if defined(__AVX512F__)
    if (resize_rows(f, A, P, r0, r1)) return;
#endif
    const int64_t H = f[F_H], W = f[F_W], C = f[F_C], OH = f[F_OH], OW = f[F_OW];
    const int64_t C8 = C / 8 * 8;
    const float *restrict in = A + f[F_IN], *rows = P + f[F_WOFF], *cols = P + f[F_BOFF];
    float *restrict out = A + f[F_OUT];
    for (int64_t row = r0; row < r1; ++row) {
        const int64_t n = row / OH, oh = row % OH;
        const float *hr = rows + oh * 4;
        for (int64_t ow = 0; ow < OW; ++ow) {
            const float *wr = cols + ow * 4;
            float *restrict o = out + ((n * OH + oh) * OW + ow) * C;
            const float *x[4];
            float weight[4];
            int taps = 0;
            for (int a = 0; a < 2; ++a)
                for (int b = 0; b < 2; ++b) {
                    if (hr[2 + a] == 0.0f || wr[2 + b] == 0.0f) continue;
                    weight[taps] = hr[2 + a] * wr[2 + b];
                    x[taps++] = in + ((n * H + (int64_t)hr[a]) * W + (int64_t)wr[b]) * C;
                }
            for (int64_t c = 0; c < C8; c += 8) {  /* 8 channels in a register */
                v8 acc = vsplat(0.0f);
                for (int t = 0; t < taps; ++t)
                    acc = vfma(vsplat(weight[t]), vload(x[t] + c), acc);
                vstore(o + c, acc);
            }
            for (int64_t c = C8; c < C; ++c) {
                float acc = 0.0f;
                for (int t = 0; t < taps; ++t) acc = fmaf(weight[t], x[t][c], acc);
                o[c] = acc;
            }
        }
    }
}

static void resize(const int64_t *f, float *A, const float *P) {
    resize_part(f, A, P, 0, f[F_N] * f[F_OH]);
}

/* Channels [F_X1, F_X1 + C) of an NHWC output of F_OC channels: a Concat's part. */
static void slice_part(const int64_t *f, float *A, int64_t p0, int64_t p1) {
    const int64_t C = f[F_C], OC = f[F_OC], at = f[F_X1];
    const float *restrict x = A + f[F_IN];
    float *restrict o = A + f[F_OUT];
    if (C % 8 == 0) {  /* 8 floats a move, not a memcpy call a pixel (unet's 1024 x 8: ~3x) */
        for (int64_t p = p0; p < p1; ++p)
            for (int64_t c = 0; c < C; c += 8) vstore(o + p * OC + at + c, vload(x + p * C + c));
        return;
    }
    for (int64_t p = p0; p < p1; ++p) memcpy(o + p * OC + at, x + p * C, sizeof(float) * C);
}

static void slice_into(const int64_t *f, float *A) { slice_part(f, A, 0, f[F_N]); }

/* F_N elements, each from its place in the input that the int32 table at F_WOFF names: a
   Transpose, Slice, Split or Reshape that moves channels-last elements (cnn_layers.py tables the
   places at load). */
static void gather_part(const int64_t *f, float *A, const float *P, int64_t i0, int64_t i1) {
    const int32_t *restrict at = (const int32_t *)(P + f[F_WOFF]);
    const float *restrict x = A + f[F_IN];
    float *restrict o = A + f[F_OUT];
    for (int64_t i = i0; i < i1; ++i) o[i] = x[at[i]];
}

static void gather(const int64_t *f, float *A, const float *P) { gather_part(f, A, P, 0, f[F_N]); }

/* The F_N elements of the input written to their places in the output (the int32 table at
   F_WOFF): a Concat's part on any axis. */
static void scatter_part(const int64_t *f, float *A, const float *P, int64_t i0, int64_t i1) {
    const int32_t *restrict at = (const int32_t *)(P + f[F_WOFF]);
    const float *restrict x = A + f[F_IN];
    float *restrict o = A + f[F_OUT];
    for (int64_t i = i0; i < i1; ++i) o[at[i]] = x[i];
}

static void scatter(const int64_t *f, float *A, const float *P) {
    scatter_part(f, A, P, 0, f[F_N]);
}

/* o = x (op) y over F_N elements, y in the arena (F_IN2) or in the parameters (F_WOFF: a
   constant laid out as the output is, broadcast at load); F_X1 the op; AR_AFFINE: x * y + z,
   z at F_BOFF. */
static void arith_part(const int64_t *f, float *A, const float *P, int64_t i0, int64_t i1) {
    const int64_t n = i1 - i0;
    const float *restrict x = A + f[F_IN] + i0;
    const float *restrict y = (f[F_IN2] >= 0 ? A + f[F_IN2] : P + f[F_WOFF]) + i0;
    const float *restrict z = P + f[F_BOFF] + i0;
    float *restrict o = A + f[F_OUT] + i0;
    switch (f[F_X1]) {
    case AR_ADD: for (int64_t i = 0; i < n; ++i) o[i] = x[i] + y[i]; break;
    case AR_SUB: for (int64_t i = 0; i < n; ++i) o[i] = x[i] - y[i]; break;
    case AR_MUL: for (int64_t i = 0; i < n; ++i) o[i] = x[i] * y[i]; break;
    case AR_DIV: for (int64_t i = 0; i < n; ++i) o[i] = x[i] / y[i]; break;
    case AR_POW: for (int64_t i = 0; i < n; ++i) o[i] = powf(x[i], y[i]); break;
    default: for (int64_t i = 0; i < n; ++i) o[i] = x[i] * y[i] + z[i]; break;
    }
}

static void arith(const int64_t *f, float *A, const float *P) { arith_part(f, A, P, 0, f[F_N]); }

/* F_N outputs, each the max, min, sum or mean (F_X1) of the F_C inputs the int32 table at F_WOFF
   names for it (F_C in a row): a Reduce over any axes. A NaN is the max and the min. */
static void reduce(const int64_t *f, float *A, const float *P) {
    const int64_t n = f[F_N], K = f[F_C], kind = f[F_X1];
    const int32_t *restrict at = (const int32_t *)(P + f[F_WOFF]);
    const float *restrict x = A + f[F_IN];
    float *restrict o = A + f[F_OUT];
    for (int64_t j = 0; j < n; ++j, at += K) {
        float r = x[at[0]];
        for (int64_t k = 1; k < K; ++k) {
            const float v = x[at[k]];
            if (kind == RD_MAX) r = (v > r || v != v) ? v : r;
            else if (kind == RD_MIN) r = (v < r || v != v) ? v : r;
            else r += v;
        }
        o[j] = kind == RD_MEAN ? r / (float)K : r;
    }
}

/* Group normalization of an NHWC tensor, F_G groups of the F_C channels, epsilon at F_AOFF,
   then each channel's scale (F_WOFF) and bias (F_BOFF); mean and variance in double, two
   passes (a NaN anywhere in a group makes the group NaN, as CpuRef's). Each pass runs over the
   pixels with the channels innermost (contiguous: vectorized, where a group's own channels one
   pixel apart had been read C floats apart), summed per channel, then per group. */
static void gnorm(const int64_t *f, float *A, const float *P) {
    const int64_t N = f[F_N], C = f[F_C], HW = f[F_H] * f[F_W], G = f[F_G], CG = C / G;
    const float eps = P[f[F_AOFF]], *restrict scale = P + f[F_WOFF], *restrict bias = P + f[F_BOFF];
    double sum[C], mean[C];
    float m[C], inv[C];
    for (int64_t n = 0; n < N; ++n) {
        const float *restrict x = A + f[F_IN] + n * HW * C;
        float *restrict y = A + f[F_OUT] + n * HW * C;
        for (int64_t c = 0; c < C; ++c) sum[c] = 0.0;
        for (int64_t p = 0; p < HW; ++p)
            for (int64_t c = 0; c < C; ++c) sum[c] += x[p * C + c];
        for (int64_t g = 0; g < G; ++g) {
            double s = 0.0;
            for (int64_t c = g * CG; c < (g + 1) * CG; ++c) s += sum[c];
            for (int64_t c = g * CG; c < (g + 1) * CG; ++c) mean[c] = s / (double)(CG * HW);
        }
        for (int64_t c = 0; c < C; ++c) sum[c] = 0.0;
        for (int64_t p = 0; p < HW; ++p)
            for (int64_t c = 0; c < C; ++c) {
                const double d = x[p * C + c] - mean[c];
                sum[c] += d * d;
            }
        for (int64_t g = 0; g < G; ++g) {
            double dev = 0.0;
            for (int64_t c = g * CG; c < (g + 1) * CG; ++c) dev += sum[c];
            const float i = (float)(1.0 / sqrt(dev / (double)(CG * HW) + eps));
            for (int64_t c = g * CG; c < (g + 1) * CG; ++c) m[c] = (float)mean[c], inv[c] = i;
        }
        for (int64_t p = 0; p < HW; ++p)
            for (int64_t c = 0; c < C; ++c)
                y[p * C + c] = (x[p * C + c] - m[c]) * inv[c] * scale[c] + bias[c];
    }
}

/* Layer normalization of F_N rows of F_C elements, a row's k-th at the place the int32 table at
   F_X2 names (rows in ONNX's order of the normalized axes, wherever the arena keeps them),
   epsilon at F_AOFF, scale (F_WOFF) and bias (F_BOFF) by k; the output laid out as the input. */
static void lnorm(const int64_t *f, float *A, const float *P) {
    const int64_t rows = f[F_N], K = f[F_C];
    const int32_t *restrict at = (const int32_t *)(P + f[F_X2]);
    const float eps = P[f[F_AOFF]], *restrict scale = P + f[F_WOFF], *restrict bias = P + f[F_BOFF];
    const float *restrict x = A + f[F_IN];
    float *restrict y = A + f[F_OUT];
    for (int64_t r = 0; r < rows; ++r, at += K) {
        double sum = 0.0, dev = 0.0;
        for (int64_t k = 0; k < K; ++k) sum += x[at[k]];
        const double mean = sum / (double)K;
        for (int64_t k = 0; k < K; ++k) {
            const double d = x[at[k]] - mean;
            dev += d * d;
        }
        const float m = (float)mean, inv = (float)(1.0 / sqrt(dev / (double)K + eps));
        for (int64_t k = 0; k < K; ++k) y[at[k]] = (x[at[k]] - m) * inv * scale[k] + bias[k];
    }
}
