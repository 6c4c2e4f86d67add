/* cnn_conv.h's register tiles 16 lanes wide, for a build with AVX-512 (32 registers of 16 floats),
included by cnn_conv.h only where __AVX512F__: ONNX Runtime's MLAS runs its convolutions so on
such a CPU, and the AVX2 tiles' 8 lanes and 16 registers left half of each FMA unused there.
The AVX2 tiles stay, built and run beside these (a block of 8 channels of a plan packed for AVX2);
cnn_layers.py packs a plan's weights for the width the library says it has. */
#include <immintrin.h>

/* cnn.c's vexp, lane for lane the same steps, 16 lanes: clamped to [-87.3, 88], a degree-5
   polynomial on x - n ln 2 times 2^n; 0 below -87.3, infinity above 88.7, NaN in, NaN out. No
   contraction beyond vexp's own FMAs (its products and sums kept apart as there). */
static inline __m512 vexp16(__m512 x) {
    const __m512 lo = _mm512_set1_ps(-87.3f), in = x;
    x = _mm512_min_ps(_mm512_set1_ps(88.0f), _mm512_max_ps(lo, x));  /* NaN stays x */
    __m512 t = _mm512_add_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                             _mm512_set1_ps(0.5f));
    t = _mm512_mask_mov_ps(t, _mm512_cmp_ps_mask(t, t, _CMP_UNORD_Q), _mm512_setzero_ps());
    __m512i n = _mm512_cvttps_epi32(t);
    n = _mm512_mask_sub_epi32(n, _mm512_cmp_ps_mask(_mm512_cvtepi32_ps(n), t, _CMP_GT_OQ), n,
                              _mm512_set1_epi32(1));  /* floor */
    const __m512 fn = _mm512_cvtepi32_ps(n);
    x = _mm512_sub_ps(_mm512_sub_ps(x, _mm512_mul_ps(fn, _mm512_set1_ps(0.693359375f))),
                      _mm512_mul_ps(fn, _mm512_set1_ps(-2.12194440e-4f)));
    __m512 y = _mm512_set1_ps(1.9875691500e-4f);
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507e-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073e-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894e-2f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459e-1f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201e-1f));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
    y = _mm512_mul_ps(y, _mm512_castsi512_ps(_mm512_slli_epi32(
                             _mm512_add_epi32(n, _mm512_set1_epi32(127)), 23)));
    y = _mm512_mask_mov_ps(y, _mm512_cmp_ps_mask(in, lo, _CMP_LT_OQ), _mm512_setzero_ps());
    return _mm512_mask_mov_ps(y, _mm512_cmp_ps_mask(in, _mm512_set1_ps(88.7f), _CMP_GT_OQ),
                              _mm512_set1_ps(INFINITY));
}

static inline __m512 vneg16(__m512 x) {
    return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(x),
                                                _mm512_set1_epi32((int32_t)0x80000000u)));
}

/* cnn.c's verf, 16 lanes (Abramowitz and Stegun's 7.1.26, the sign restored). */
static inline __m512 verf16(__m512 x) {
    const __m512 one = _mm512_set1_ps(1.0f);
    const __mmask16 negative = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ);
    const __m512 ax = _mm512_mask_mov_ps(x, negative, vneg16(x));
    const __m512 t = _mm512_div_ps(one, _mm512_add_ps(one, _mm512_mul_ps(
                                                          _mm512_set1_ps(0.3275911f), ax)));
    __m512 r = _mm512_set1_ps(1.061405429f);
    r = _mm512_fmadd_ps(r, t, _mm512_set1_ps(-1.453152027f));
    r = _mm512_fmadd_ps(r, t, _mm512_set1_ps(1.421413741f));
    r = _mm512_fmadd_ps(r, t, _mm512_set1_ps(-0.284496736f));
    r = _mm512_fmadd_ps(r, t, _mm512_set1_ps(0.254829592f));
    const __m512 y = _mm512_sub_ps(one, _mm512_mul_ps(_mm512_mul_ps(r, t),
                                                      vexp16(vneg16(_mm512_mul_ps(ax, ax)))));
    return _mm512_mask_mov_ps(y, negative, vneg16(y));
}

/* The activations a tile applies in registers on AVX-512 (finish()'s but Tanh's): the same steps
   as finish()'s loops, lane for lane; every comparison's NaN keeps x (max and min return their
   second operand where either is NaN). */
static inline int act16_takes(int64_t act) {
    return act == ACT_NONE || act == ACT_RELU || act == ACT_CLIP || act == ACT_HSWISH ||
           act == ACT_HSIGMOID || act == ACT_SIGMOID || act == ACT_SWISH || act == ACT_LEAKY ||
           act == ACT_GELU;
}

static inline __attribute__((always_inline)) __m512 act16(__m512 x, int64_t act,
                                                         const float *a) {
    const __m512 zero = _mm512_setzero_ps(), one = _mm512_set1_ps(1.0f);
    switch (act) {
    case ACT_RELU: return _mm512_max_ps(zero, x);
    case ACT_CLIP:
        return _mm512_min_ps(_mm512_set1_ps(a[1]), _mm512_max_ps(_mm512_set1_ps(a[0]), x));
    case ACT_HSWISH: {
        __m512 c = _mm512_add_ps(x, _mm512_set1_ps(3.0f));
        c = _mm512_min_ps(_mm512_set1_ps(6.0f), _mm512_max_ps(zero, c));
        return _mm512_div_ps(_mm512_mul_ps(x, c), _mm512_set1_ps(6.0f));
    }
    case ACT_HSIGMOID: {
        const __m512 c = _mm512_add_ps(_mm512_mul_ps(_mm512_set1_ps(a[0]), x),
                                       _mm512_set1_ps(a[1]));
        return _mm512_min_ps(one, _mm512_max_ps(zero, c));
    }
    case ACT_SIGMOID: return _mm512_div_ps(one, _mm512_add_ps(one, vexp16(vneg16(x))));
    case ACT_SWISH:
        return _mm512_mul_ps(x, _mm512_div_ps(one, _mm512_add_ps(one, vexp16(vneg16(x)))));
    case ACT_LEAKY:
        return _mm512_mask_mov_ps(x, _mm512_cmp_ps_mask(x, zero, _CMP_LT_OQ),
                                  _mm512_mul_ps(_mm512_set1_ps(a[0]), x));
    case ACT_GELU:
        return _mm512_mul_ps(_mm512_mul_ps(x, _mm512_set1_ps(0.5f)),
                             _mm512_add_ps(one, verf16(_mm512_mul_ps(
                                                    x, _mm512_set1_ps(0.70710678f)))));
    default: return x;
    }
}

/* The epilogue of `lanes` of a register: the residual's lanes (where r) added, then act16. */
static inline __attribute__((always_inline)) __m512 epilogue16(__m512 x, const float *r,
                                                              __mmask16 lanes, int64_t act,
                                                              const float *a) {
    if (r) x = _mm512_add_ps(x, _mm512_maskz_loadu_ps(lanes, r));
    return act16(x, act, a);
}

/* The same tile 16 lanes wide (AVX-512: 32 registers of 16 floats): pb pixels by 16 * nv output
   channels, 14 x 16, 12 x 32 or 8 x 48 (14 or 24 accumulators beside the block's weights; each
   pixel's input broadcast from memory into its FMA). The epilogue's ReLU and Clip by max and min,
   whose second operand is returned where either is NaN: x < lo ? lo : x, as epilogue()'s. A part
   tile's pixels and lanes stored through a mask. */
enum { PB16_MAX = 14 };
static inline __attribute__((always_inline)) void tile16(
    int nv, int pb, const float *const *ip, int64_t rowstep, int64_t colstep, int64_t KH,
    int64_t KW, int64_t inner, const float *restrict wk, const float *restrict bk,
    float *restrict op, int64_t OC, int64_t pixels, int64_t valid, int fused,
    const float *restrict res, int64_t act, const float *a) {
    const int64_t VB = 16 * nv;
    __m512 acc[3][PB16_MAX];
    const float *p[PB16_MAX];
    for (int r = 0; r < pb; ++r) {
        p[r] = ip[r];
        for (int v = 0; v < nv; ++v) acc[v][r] = _mm512_loadu_ps(bk + 16 * v);
    }
    const float *w = wk;
    int64_t kh = 0;
    do {
        int64_t kw = 0;
        do {
            const int64_t at = kh * rowstep + kw * colstep;
            int64_t ic = 0;
            do {
                __m512 wv[3];
                for (int v = 0; v < nv; ++v) wv[v] = _mm512_loadu_ps(w + 16 * v);
                for (int r = 0; r < pb; ++r) {
                    const __m512 xr = _mm512_set1_ps(p[r][at + ic]);
                    for (int v = 0; v < nv; ++v) acc[v][r] = _mm512_fmadd_ps(xr, wv[v], acc[v][r]);
                }
                w += VB;
            } while (++ic < inner);
        } while (++kw < KW);
    } while (++kh < KH);
    if (fused)  /* any valid: the residual read through the lanes' mask */
        for (int v = 0; v < nv; ++v) {
            const int64_t left = valid - 16 * v, n = left < 0 ? 0 : left > 16 ? 16 : left;
            const __mmask16 lanes = (__mmask16)((1u << n) - 1u);
            for (int r = 0; r < pb; ++r)
                if (r < pixels)
                    acc[v][r] = epilogue16(acc[v][r], res ? res + r * OC + 16 * v : 0, lanes,
                                           act, a);
        }
    if (valid == VB && pixels == pb) {
        for (int r = 0; r < pb; ++r)
            for (int v = 0; v < nv; ++v) _mm512_storeu_ps(op + r * OC + 16 * v, acc[v][r]);
        return;
    }
    for (int r = 0; r < pb; ++r)
        if (r < pixels)
            for (int v = 0; v < nv; ++v) {
                const int64_t left = valid - 16 * v, n = left < 0 ? 0 : left > 16 ? 16 : left;
                _mm512_mask_storeu_ps(op + r * OC + 16 * v, (__mmask16)((1u << n) - 1u),
                                      acc[v][r]);
            }
}

/* A group of at most 8 output channels (unet's 8, a grouped convolution's 4 or 8): 16 lanes as
   8 channels by 2 taps, lane 2o + e the sum over the taps t = e mod 2 of output channel o, the
   weights packed so ([kh][kw][pair][o][e], zero past the taps and the channels; the bias in the
   even lanes): each FMA takes two adjacent input values (one 8-byte broadcast) where an 8-lane
   block would leave half of every register unused. An odd tap count's last tap by a masked FMA
   (the odd lanes untouched: an infinite input is not multiplied by a padding 0). Two pixels'
   accumulators are then folded into one register, [pixel r | pixel r + 1] by 8 channels, the
   even lanes plus the odd, for the epilogue and a masked store each. */
enum { PB2 = 12 };
static inline __attribute__((always_inline)) void tile_pairs(
    const float *const *ip, int64_t rowstep, int64_t colstep, int64_t KH, int64_t KW,
    int64_t inner, const float *restrict wk, const float *restrict bk, float *restrict op,
    int64_t OC, int64_t pixels, int64_t valid, int fused, const float *restrict res,
    int64_t act, const float *a) {
    static const int32_t fold[2][16] = {{0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30},
                                        {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31}};
    __m512 acc[PB2];
    const float *p[PB2];
    const __m512 bias = _mm512_loadu_ps(bk);
    for (int r = 0; r < PB2; ++r) p[r] = ip[r], acc[r] = bias;
    const int64_t even = inner & ~(int64_t)1;
    const float *w = wk;
    int64_t kh = 0;
    do {
        int64_t kw = 0;
        do {
            const int64_t at = kh * rowstep + kw * colstep;
            for (int64_t t = 0; t < even; t += 2) {
                const __m512 wv = _mm512_loadu_ps(w);
                for (int r = 0; r < PB2; ++r) {
                    double two;
                    memcpy(&two, p[r] + at + t, sizeof two);
                    acc[r] = _mm512_fmadd_ps(_mm512_castpd_ps(_mm512_set1_pd(two)), wv, acc[r]);
                }
                w += 16;
            }
            if (inner & 1) {
                const __m512 wv = _mm512_loadu_ps(w);
                for (int r = 0; r < PB2; ++r)
                    acc[r] = _mm512_mask3_fmadd_ps(_mm512_set1_ps(p[r][at + even]), wv, acc[r],
                                                   (__mmask16)0x5555);
                w += 16;
            }
        } while (++kw < KW);
    } while (++kh < KH);
    const __m512i evens = _mm512_loadu_si512(fold[0]), odds = _mm512_loadu_si512(fold[1]);
    const __mmask16 lanes = (__mmask16)((1u << valid) - 1u);
    for (int r = 0; r < PB2; r += 2) {
        if (r >= pixels) break;
        __m512 s = _mm512_add_ps(_mm512_permutex2var_ps(acc[r], evens, acc[r + 1]),
                                 _mm512_permutex2var_ps(acc[r], odds, acc[r + 1]));
        const int two = r + 1 < pixels;
        if (fused) {
            if (res) {
                const __m512 first = _mm512_maskz_loadu_ps(lanes, res + r * OC);
                const __m512 second = two ? _mm512_maskz_loadu_ps(lanes, res + (r + 1) * OC)
                                          : _mm512_setzero_ps();
                s = _mm512_add_ps(s, _mm512_shuffle_f32x4(first, second, 0x44));
            }
            s = act16(s, act, a);
        }
        _mm512_mask_storeu_ps(op + r * OC, lanes, s);
        if (two) _mm512_mask_storeu_ps(op + (r + 1) * OC, lanes, _mm512_shuffle_f32x4(s, s, 0xEE));
    }
}

/* The depthwise row's tiles (cnn_conv.h's dwtile, dwsides, dwrow) 16 channels wide: np adjacent
   pixels inside the input's columns (8, 2 or 1: 8 accumulators beside the 3 x 3 weights' 9
   registers, each input read by its FMA from memory), then two side pixels with each tap's
   column checked. FMAs in CpuRef's order (bias, then kh, kw); the epilogue by max and min (NaN
   kept: the second operand is returned where either is NaN). */
static inline __attribute__((always_inline)) __m512 dwfinish16(__m512 x, const float *r,
                                                              int fused, int64_t act,
                                                              const float *a) {
    return fused ? epilogue16(x, r, (__mmask16)0xffff, act, a) : x;
}

static inline __attribute__((always_inline)) void dwtile16(
    int K, int np, int64_t ow, const float *irow, float *orow, const float *rrow, const __m512 *w,
    const float *restrict wt, __m512 b, int64_t c, int64_t C, int64_t SW, int64_t PL,
    int64_t KW, int64_t DW, int64_t rowstep, int64_t kh0, int64_t kh1, int fused, int64_t act,
    const float *a) {
    const int64_t xs = SW * C, colstep = DW * C;
    const float *ip = irow + (ow * SW - PL) * C + c;
    __m512 acc[8];
    for (int r = 0; r < np; ++r) acc[r] = b;
    for (int64_t kh = K ? 0 : kh0; kh < (K ? K : kh1); ++kh) {
        if (K && (kh < kh0 || kh >= kh1)) continue;
        for (int64_t kw = 0; kw < (K ? K : KW); ++kw) {
            const float *x = ip + kh * rowstep + kw * colstep;
            const __m512 wv = K ? w[kh * K + kw] : _mm512_loadu_ps(wt + (kh * KW + kw) * C + c);
            for (int r = 0; r < np; ++r)
                acc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(x + r * xs), wv, acc[r]);
        }
    }
    for (int r = 0; r < np; ++r)
        _mm512_storeu_ps(orow + (ow + r) * C + c,
                         dwfinish16(acc[r], rrow ? rrow + (ow + r) * C + c : 0, fused, act, a));
}

static inline __attribute__((always_inline)) void dwsides16(
    int K, int64_t u, int64_t v, const float *irow, float *orow, const float *rrow,
    const __m512 *w, const float *restrict wt, __m512 b, int64_t c, int64_t W, int64_t C,
    int64_t SW, int64_t PL, int64_t KW, int64_t DW, int64_t rowstep, int64_t kh0, int64_t kh1,
    int fused, int64_t act, const float *a) {
    const int64_t u0 = u * SW - PL, v0 = v * SW - PL;
    __m512 au = b, av = b;
    for (int64_t kh = K ? 0 : kh0; kh < (K ? K : kh1); ++kh) {
        if (K && (kh < kh0 || kh >= kh1)) continue;
        const float *x = irow + kh * rowstep + c;
        for (int64_t kw = 0; kw < (K ? K : KW); ++kw) {
            const __m512 wv = K ? w[kh * K + kw] : _mm512_loadu_ps(wt + (kh * KW + kw) * C + c);
            const int64_t iu = u0 + kw * DW, iv = v0 + kw * DW;
            if (iu >= 0 && iu < W) au = _mm512_fmadd_ps(_mm512_loadu_ps(x + iu * C), wv, au);
            if (iv >= 0 && iv < W) av = _mm512_fmadd_ps(_mm512_loadu_ps(x + iv * C), wv, av);
        }
    }
    _mm512_storeu_ps(orow + v * C + c,
                     dwfinish16(av, rrow ? rrow + v * C + c : 0, fused, act, a));
    _mm512_storeu_ps(orow + u * C + c,
                     dwfinish16(au, rrow ? rrow + u * C + c : 0, fused, act, a));
}

/* The row's channels [0, C / 16 * 16), 16 at a time; cnn_conv.h's dwrow takes the rest. */
static inline __attribute__((always_inline)) void dwrow16(
    int K, const float *irow, float *orow, const float *rrow, int64_t W, int64_t C, int64_t OW,
    int64_t SW, int64_t PL, int64_t KW, int64_t DW, int64_t rowstep, int64_t kh0,
    int64_t kh1, int64_t lo, int64_t hi, const float *restrict wt,
    const float *restrict bias, int fused, int64_t act, const float *a) {
    for (int64_t c = 0; c + 16 <= C; c += 16) {
        __m512 w[9];
        if (K)
            for (int t = 0; t < K * K; ++t) w[t] = _mm512_loadu_ps(wt + t * C + c);
        const __m512 b = _mm512_loadu_ps(bias + c);
#define DWT(np) dwtile16(K, np, ow, irow, orow, rrow, w, wt, b, c, C, SW, PL, KW, DW, \
                         rowstep, kh0, kh1, fused, act, a)
#define DWS(u, v) dwsides16(K, u, v, irow, orow, rrow, w, wt, b, c, W, C, SW, PL, KW, DW, \
                            rowstep, kh0, kh1, fused, act, a)
        int64_t ow = lo;
        for (; ow + 8 <= hi; ow += 8) DWT(8);
        for (; ow + 2 <= hi; ow += 2) DWT(2);
        if (ow < hi) DWT(1);
        int64_t left = 0, right = hi;
        while (left < lo || right < OW) {
            const int64_t u = left < lo ? left++ : right++;
            const int64_t v = left < lo ? left++ : right < OW ? right++ : u;
            DWS(u, v);
        }
#undef DWT
#undef DWS
    }
}

#if defined(__AVX512VL__)
/* A group of at most 4 output channels (a grouped convolution's 4, unet's last 2): 16 lanes as
   4 channels by 4 taps (tile_pairs' scheme, lane 4o + e; one 16-byte broadcast of four adjacent
   inputs an FMA, a count of taps past a multiple of 4 by masked FMAs, one a tap), four pixels'
   accumulators then folded into one register, [pixel r | r + 1 | r + 2 | r + 3] by 4 channels
   (the sums of taps e = 0, 1 and 2, 3 first, then of the two). */
static inline __attribute__((always_inline)) void tile_quads(
    const float *const *ip, int64_t rowstep, int64_t colstep, int64_t KH, int64_t KW,
    int64_t inner, const float *restrict wk, const float *restrict bk, float *restrict op,
    int64_t OC, int64_t pixels, int64_t valid, int fused, const float *restrict res,
    int64_t act, const float *a) {
    static const int32_t fold[2][16] = {{0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30},
                                        {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31}};
    __m512 acc[PB2];
    const float *p[PB2];
    const __m512 bias = _mm512_loadu_ps(bk);
    for (int r = 0; r < PB2; ++r) p[r] = ip[r], acc[r] = bias;
    const int64_t whole = inner & ~(int64_t)3, rest = inner & 3;
    const float *w = wk;
    int64_t kh = 0;
    do {
        int64_t kw = 0;
        do {
            const int64_t at = kh * rowstep + kw * colstep;
            for (int64_t t = 0; t < whole; t += 4) {
                const __m512 wv = _mm512_loadu_ps(w);
                for (int r = 0; r < PB2; ++r)
                    acc[r] = _mm512_fmadd_ps(_mm512_broadcast_f32x4(_mm_loadu_ps(p[r] + at + t)),
                                             wv, acc[r]);
                w += 16;
            }
            if (rest) {
                const __m512 wv = _mm512_loadu_ps(w);
                for (int64_t e = 0; e < rest; ++e)
                    for (int r = 0; r < PB2; ++r)
                        acc[r] = _mm512_mask3_fmadd_ps(_mm512_set1_ps(p[r][at + whole + e]), wv,
                                                       acc[r], (__mmask16)(0x1111u << e));
                w += 16;
            }
        } while (++kw < KW);
    } while (++kh < KH);
    const __m512i evens = _mm512_loadu_si512(fold[0]), odds = _mm512_loadu_si512(fold[1]);
    const __mmask8 lanes = (__mmask8)((1u << valid) - 1u);
    for (int r = 0; r < PB2; r += 4) {
        if (r >= pixels) break;
        const __m512 a01 = _mm512_add_ps(_mm512_permutex2var_ps(acc[r], evens, acc[r + 1]),
                                         _mm512_permutex2var_ps(acc[r], odds, acc[r + 1]));
        const __m512 a23 = _mm512_add_ps(_mm512_permutex2var_ps(acc[r + 2], evens, acc[r + 3]),
                                         _mm512_permutex2var_ps(acc[r + 2], odds, acc[r + 3]));
        __m512 s = _mm512_add_ps(_mm512_permutex2var_ps(a01, evens, a23),
                                 _mm512_permutex2var_ps(a01, odds, a23));
        const int64_t n = pixels - r;  /* of the four, those that are pixels */
        if (fused) {
            if (res) {
                __m512 rv = _mm512_castps128_ps512(_mm_maskz_loadu_ps(lanes, res + r * OC));
                rv = _mm512_mask_mov_ps(rv, 0xfff0, _mm512_setzero_ps());
                if (n > 1)
                    rv = _mm512_insertf32x4(rv, _mm_maskz_loadu_ps(lanes, res + (r + 1) * OC), 1);
                if (n > 2)
                    rv = _mm512_insertf32x4(rv, _mm_maskz_loadu_ps(lanes, res + (r + 2) * OC), 2);
                if (n > 3)
                    rv = _mm512_insertf32x4(rv, _mm_maskz_loadu_ps(lanes, res + (r + 3) * OC), 3);
                s = _mm512_add_ps(s, rv);
            }
            s = act16(s, act, a);
        }
        _mm_mask_storeu_ps(op + r * OC, lanes, _mm512_castps512_ps128(s));
        if (n > 1) _mm_mask_storeu_ps(op + (r + 1) * OC, lanes, _mm512_extractf32x4_ps(s, 1));
        if (n > 2) _mm_mask_storeu_ps(op + (r + 2) * OC, lanes, _mm512_extractf32x4_ps(s, 2));
        if (n > 3) _mm_mask_storeu_ps(op + (r + 3) * OC, lanes, _mm512_extractf32x4_ps(s, 3));
    }
}
#endif
