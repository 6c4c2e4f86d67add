/* An int8 CNN partition run in one call: a plan of records over one arena (qcnn.py plans it).

Why: on this AVX2 machine torch's int8 paths (FBGEMM, oneDNN, oneDNN Graph's int8) are slower
than its float ones, and a 32x32 int8 ResNet's layers each do a few microseconds of work, which
torch's per-call costs outgrow. ONNX Runtime's MLAS multiplies uint8 by int8 into int32 and
requantizes in float; so does this, exactly: the integer sums are exact, the requantization is
MLAS's (float(acc) * (x_scale * w_scale / y_scale), clamped to the type's range less the zero
point, rounded half to even, plus the zero point), QuantizeLinear is MLAS's (x / scale, clamped,
rounded half to even, plus the zero point) and DequantizeLinear (x - zero) * scale.

Tensors live in the arena channels-last: 8-bit ones as bytes, float ones as floats. A
convolution first copies its input, centred (x - zero) and widened to int16, into a padded
scratch (padding 0: the zero point's value), its channels rounded up to even; weights are packed
at load as int16 pairs, (w - w_zero), for _mm256_madd_epi16: 16 exact products a instruction
into 8 int32 sums. (_mm256_maddubs_epi16 would do 32, but it saturates its int16 pair sums: 255
* 127 * 2 > 32767; MLAS's AVX2 kernel accepts that, so where a sum saturates there ONNX Runtime's
output is off and this one is the exact one.) AVX-512 VNNI (vpdpwssd) behind __AVX512VNNI__,
a scalar path for other CPUs. Where the build has AVX-512 VNNI the plan takes qcnn_bytes.h's
record instead (OP_QCONV8: bytes, u8 x s8, vpdpbusd, 64 products an instruction). No -ffast-math: the rounding mode is the default, half to even.

A run uses the threads backplane_qcnn_threads asked for in the calling thread: the records qcnn.py
marks split (F_SPLIT: the large convolutions and elementwise records) are shared with a crew of
workers (qcnn_pool.h), each item written by one thread with the one-thread arithmetic. */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

/* A record's fields (qcnn.py's FIELDS, in this order): int64 each, NF of them per record. */
enum { F_OP, F_IN, F_IN2, F_OUT, F_N, F_H, F_W, F_C, F_OH, F_OW, F_OC, F_KH, F_KW, F_SH, F_SW,
       F_DH, F_DW, F_PT, F_PL, F_WOFF, F_BOFF, F_MOFF, F_SCR, F_PH, F_PW, F_ICP, F_ZX, F_ZY,
       F_LO, F_HI, F_SIGNED, F_X1, F_CS, F_OCS, F_SPLIT, NF = 35 };
enum { OP_IMPORT = 1, OP_EXPORT, OP_QUANT, OP_DEQUANT, OP_QCONV, OP_MAXPOOL_F, OP_MAXPOOL_Q,
       OP_AVGPOOL_F, OP_GAP_F, OP_ADD_F, OP_ADDC_F, OP_RELU_F, OP_QDWCONV, OP_LINEAR_F,
       OP_FDWCONV_Q, OP_HSIG_F, OP_MUL_F, OP_QCONV8, OP_LUT8, OP_QADD8, OP_QDW8 };
#define OCB 16 /* output channels a weight block: two vectors of 8 int32 sums */

static inline int32_t load8(const uint8_t *p, int64_t i, int sgn) {
    return sgn ? (int32_t)((const int8_t *)p)[i] : (int32_t)p[i];
}

#include "qcnn_float.h" /* float biases: requantize_f; a float depthwise: fdwconv_q */

/* The input centred and widened into the padded scratch: [n][ph][pw][icp] int16, 0 outside;
   padded rows [begin, end) of the n * ph (each row whole: a part of the crew's job). */
static void widen_rows(const int64_t *r, const uint8_t *x, int16_t *restrict s, int64_t begin,
                       int64_t end) {
    const int64_t h = r[F_H], w = r[F_W], c = r[F_C], ph = r[F_PH], pw = r[F_PW];
    const int64_t cs = r[F_CS] ? r[F_CS] : c; /* a pixel's channels in x: a group reads c of them */
    const int64_t icp = r[F_ICP], pt = r[F_PT], pl = r[F_PL];
    const int32_t zx = (int32_t)r[F_ZX];
    const int sgn = (int)r[F_SIGNED];
    for (int64_t row = begin; row < end; ++row) {
        const int64_t b = row / ph, y = row % ph - pt;
        int16_t *dst = s + row * pw * icp;
        memset(dst, 0, (size_t)(pw * icp) * sizeof(int16_t));
        if (y < 0 || y >= h) continue;
        const uint8_t *src = x + ((b * h + y) * w) * cs;
        dst += pl * icp;
        if (sgn)
            for (int64_t px = 0; px < w; ++px)
                for (int64_t k = 0; k < c; ++k)
                    dst[px * icp + k] = (int16_t)((int32_t)((const int8_t *)src)[px * cs + k] - zx);
        else
            for (int64_t px = 0; px < w; ++px)
                for (int64_t k = 0; k < c; ++k)
                    dst[px * icp + k] = (int16_t)((int32_t)src[px * cs + k] - zx);
    }
}

static void widen_part(const int64_t *r, const uint8_t *params, uint8_t *arena, int64_t begin,
                       int64_t end) {
    (void)params;
    widen_rows(r, arena + r[F_IN], (int16_t *)(arena + r[F_SCR]), begin, end);
}

/* The bounds a requantized value is clamped to before rounding: the type's range less the zero
   point, narrowed by a Relu or Clip between the product and its QuantizeLinear (x1: 1 + the byte
   offset of their two floats, 0 for none). */
static void bounds(const int64_t *r, const uint8_t *params, float *fl, float *fh) {
    *fl = (float)(r[F_LO] - r[F_ZY]);
    *fh = (float)(r[F_HI] - r[F_ZY]);
    if (r[F_X1] > 0) {
        const float *b = (const float *)(params + r[F_X1] - 1);
        *fl = b[0] > *fl ? b[0] : *fl;
        *fh = b[1] < *fh ? b[1] : *fh;
    }
}

/* MLAS's requantization of 16 sums (one block's), written to y (ocount of them valid). */
static void requantize(const int32_t *acc, const float *mult, const int32_t *bias, uint8_t *y,
                       int64_t ocount, int32_t zy, float fl, float fh, int sgn) {
    int64_t j = 0;
#if defined(__AVX2__)
    const __m256 vl = _mm256_set1_ps(fl), vh = _mm256_set1_ps(fh);
    const __m256i vz = _mm256_set1_epi32(zy);
    for (; j + 8 <= ocount; j += 8) { /* the same operations as below, 8 at a time */
        const __m256i sum = _mm256_add_epi32(_mm256_loadu_si256((const __m256i *)(acc + j)),
                                             _mm256_loadu_si256((const __m256i *)(bias + j)));
        __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(sum), _mm256_loadu_ps(mult + j));
        v = _mm256_min_ps(_mm256_max_ps(v, vl), vh);
        const __m256i k = _mm256_add_epi32(_mm256_cvtps_epi32(v), vz);
        const __m128i k16 = _mm_packs_epi32(_mm256_castsi256_si128(k),
                                            _mm256_extracti128_si256(k, 1));
        const __m128i k8 = _mm_packus_epi16(k16, k16); /* in 0..255 as bytes: (uint8_t)k */
        const __m128i s8 = _mm_packs_epi16(k16, k16);  /* in -128..127 */
        _mm_storel_epi64((__m128i *)(y + j), sgn ? s8 : k8);
    }
#endif
    for (; j < ocount; ++j) {
        float v = (float)(acc[j] + bias[j]) * mult[j];
        v = v > fl ? v : fl;
        v = v < fh ? v : fh;
        y[j] = (uint8_t)((int32_t)nearbyintf(v) + zy);
    }
}

#include "qcnn_bytes.h" /* OP_QCONV8: u8 x s8 products, vpdpbusd */
#include "qcnn_dw8.h"   /* OP_QDW8: a depthwise convolution's u8 x s8 products */

#define TILE 6 /* output pixels a register tile: 12 accumulators, 2 weights, 1 input of 16 ymm */

/* Sums of TILE pixels (their scratch rows at px[t]) by one block of OCB channels: acc[t][16].
   The weight block is [kh][kw][icp/2][OCB][2] int16. */
static void block_sums(const int16_t *const *px, int64_t tiles, const int16_t *restrict wb,
                       int64_t kh, int64_t kw, int64_t pairs, int64_t rowstep, int64_t colstep,
                       int32_t acc[TILE][OCB]) {
#if defined(__AVX2__)
    __m256i a[TILE][2];
    for (int t = 0; t < TILE; ++t) a[t][0] = a[t][1] = _mm256_setzero_si256();
    for (int64_t ky = 0; ky < kh; ++ky)
        for (int64_t kx = 0; kx < kw; ++kx) {
            const int64_t at = ky * rowstep + kx * colstep;
            const int16_t *wp = wb + ((ky * kw + kx) * pairs) * OCB * 2;
            for (int64_t p = 0; p < pairs; ++p, wp += OCB * 2) {
                const __m256i w0 = _mm256_loadu_si256((const __m256i *)wp);
                const __m256i w1 = _mm256_loadu_si256((const __m256i *)(wp + 16));
                for (int t = 0; t < TILE; ++t) {
                    int32_t pair;
                    memcpy(&pair, px[t] + at + 2 * p, 4);
                    const __m256i xv = _mm256_set1_epi32(pair);
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
                    a[t][0] = _mm256_dpwssd_epi32(a[t][0], xv, w0);
                    a[t][1] = _mm256_dpwssd_epi32(a[t][1], xv, w1);
#else
                    a[t][0] = _mm256_add_epi32(a[t][0], _mm256_madd_epi16(xv, w0));
                    a[t][1] = _mm256_add_epi32(a[t][1], _mm256_madd_epi16(xv, w1));
#endif
                }
            }
        }
    for (int64_t t = 0; t < tiles; ++t) {
        _mm256_storeu_si256((__m256i *)acc[t], a[t][0]);
        _mm256_storeu_si256((__m256i *)(acc[t] + 8), a[t][1]);
    }
#else
    for (int64_t t = 0; t < tiles; ++t)
        for (int j = 0; j < OCB; ++j) acc[t][j] = 0;
    for (int64_t ky = 0; ky < kh; ++ky)
        for (int64_t kx = 0; kx < kw; ++kx) {
            const int64_t at = ky * rowstep + kx * colstep;
            const int16_t *wp = wb + ((ky * kw + kx) * pairs) * OCB * 2;
            for (int64_t p = 0; p < pairs; ++p, wp += OCB * 2)
                for (int64_t t = 0; t < tiles; ++t) {
                    const int32_t x0 = px[t][at + 2 * p], x1 = px[t][at + 2 * p + 1];
                    for (int j = 0; j < OCB; ++j)
                        acc[t][j] += x0 * (int32_t)wp[2 * j] + x1 * (int32_t)wp[2 * j + 1];
                }
        }
#endif
}

/* A quantized convolution (QLinearConv; a QDQ Conv; QLinearMatMul / QGemm as a 1x1 one over
   rows): weights [blocks][kh][kw][icp/2][OCB][2] int16 at woff (bytes), bias int32 and
   multipliers float at boff / moff, each blocks * OCB long. */
static int64_t qconv_items(const int64_t *r) { /* register tiles of TILE pixels, per image */
    return r[F_N] * ((r[F_OH] * r[F_OW] + TILE - 1) / TILE);
}

/* Tiles [begin, end) of qconv_items, the scratch widened. */
static void qconv_part(const int64_t *r, const uint8_t *params, uint8_t *arena, int64_t begin,
                       int64_t end) {
    const int64_t oh = r[F_OH], ow = r[F_OW], oc = r[F_OC], kh = r[F_KH], kw = r[F_KW];
    const int64_t sh = r[F_SH], sw = r[F_SW], dh = r[F_DH], dw = r[F_DW], ph = r[F_PH];
    const int64_t pw = r[F_PW], icp = r[F_ICP], pairs = icp / 2;
    const int16_t *s = (const int16_t *)(arena + r[F_SCR]);
    const int16_t *weights = (const int16_t *)(params + r[F_WOFF]);
    const int32_t *bias = (const int32_t *)(params + r[F_BOFF]);
    const float *mult = (const float *)(params + r[F_MOFF]);
    const float *fb = r[F_IN2] >= 0 ? (const float *)(params + r[F_IN2]) : 0; /* a float bias */
    uint8_t *y = arena + r[F_OUT];
    const int32_t zy = (int32_t)r[F_ZY];
    float fl, fh;
    bounds(r, params, &fl, &fh);
    const int64_t rows = (kw * icp + 1) / 2; /* pairs a kernel row where dw is 1 */
    const int64_t blocks = (oc + OCB - 1) / OCB;
    const int64_t wblock = (dw == 1 ? kh * rows : kh * kw * pairs) * OCB * 2;
    const int64_t pixels = oh * ow, rowstep = dh * pw * icp, colstep = dw * icp;
    const int64_t ocs = r[F_OCS] ? r[F_OCS] : oc; /* a pixel's channels in y: a group writes oc */
    int32_t acc[TILE][OCB];
    const int64_t per = (pixels + TILE - 1) / TILE;
    for (int64_t item = begin; item < end; ++item) {
        const int64_t b = item / per, p0 = (item % per) * TILE;
            const int64_t tiles = pixels - p0 < TILE ? pixels - p0 : TILE;
            const int16_t *px[TILE];
            for (int64_t t = 0; t < TILE; ++t) {
                const int64_t p = p0 + (t < tiles ? t : 0), yy = p / ow, xx = p % ow;
                px[t] = s + ((b * ph + yy * sh) * pw + xx * sw) * icp;
            }
            for (int64_t k = 0; k < blocks; ++k) {
                if (dw == 1) /* a kernel row's values are contiguous: one run of pairs (its
                                last one's second value, past the row where kw * c is odd, has
                                weight 0) */
                    block_sums(px, tiles, weights + k * wblock, kh, 1, rows, rowstep, 0, acc);
                else
                    block_sums(px, tiles, weights + k * wblock, kh, kw, pairs, rowstep, colstep,
                               acc);
                const int64_t count = oc - k * OCB < OCB ? oc - k * OCB : OCB;
                for (int64_t t = 0; t < tiles; ++t)
                    if (fb)
                        requantize_f(acc[t], fb + k * OCB, fb + blocks * OCB + k * OCB,
                                     fb[2 * blocks * OCB],
                                     y + (b * pixels + p0 + t) * ocs + k * OCB, count, zy, fl, fh);
                    else
                        requantize(acc[t], mult + k * OCB, bias + k * OCB,
                                   y + (b * pixels + p0 + t) * ocs + k * OCB, count, zy, fl, fh,
                                   r[F_LO] < 0);
            }
        }
}

static void qconv(const int64_t *r, const uint8_t *params, uint8_t *arena) {
    widen_part(r, params, arena, 0, r[F_N] * r[F_PH]);
    qconv_part(r, params, arena, 0, qconv_items(r));
}

/* A depthwise quantized convolution: weights [ceil(kh * kw / 2)][c][2] int16 at woff, two taps'
   weights a channel side by side (an odd last tap paired with weight 0), so that one
   _mm256_madd_epi16 adds two taps' products of 8 channels; bias and multipliers per channel. */
static void qdwconv_part(const int64_t *r, const uint8_t *params, uint8_t *arena, int64_t begin,
                         int64_t end) { /* output rows [begin, end) of n * oh, the scratch widened */
    const int64_t c = r[F_C], oh = r[F_OH], ow = r[F_OW], kh = r[F_KH], kw = r[F_KW];
    const int64_t sh = r[F_SH], sw = r[F_SW], dh = r[F_DH], dw = r[F_DW], ph = r[F_PH];
    const int64_t pw = r[F_PW], taps = kh * kw, pairs = (taps + 1) / 2;
    const int16_t *s = (const int16_t *)(arena + r[F_SCR]);
    const int16_t *weights = (const int16_t *)(params + r[F_WOFF]);
    const int32_t *bias = (const int32_t *)(params + r[F_BOFF]);
    const float *mult = (const float *)(params + r[F_MOFF]);
    const float *fb = r[F_IN2] >= 0 ? (const float *)(params + r[F_IN2]) : 0; /* a float bias */
    const int64_t padded = (c + OCB - 1) / OCB * OCB;
    uint8_t *y = arena + r[F_OUT];
    const int32_t zy = (int32_t)r[F_ZY];
    float fl, fh;
    bounds(r, params, &fl, &fh);
    int32_t acc[c];
    int64_t at[2 * pairs]; /* each tap's offset from the window's corner, the odd one twice */
    for (int64_t t = 0; t < 2 * pairs; ++t) {
        const int64_t tap = t < taps ? t : taps - 1;
        at[t] = ((tap / kw) * dh * pw + (tap % kw) * dw) * c;
    }
    for (int64_t row = begin; row < end; ++row) {
        const int64_t b = row / oh, oy = row % oh;
            for (int64_t ox = 0; ox < ow; ++ox) {
                const int16_t *corner = s + ((b * ph + oy * sh) * pw + ox * sw) * c;
                int64_t k = 0;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) /* 16 channels: vpdpwssd on 512 bits */
                for (; k + 16 <= c; k += 16) {
                    __m512i a = _mm512_setzero_si512();
                    for (int64_t q = 0; q < pairs; ++q) {
                        const __m256i xa = _mm256_loadu_si256((const __m256i *)(corner + at[2 * q] + k));
                        const __m256i xb = _mm256_loadu_si256(
                            (const __m256i *)(corner + at[2 * q + 1] + k));
                        const __m256i lo = _mm256_unpacklo_epi16(xa, xb); /* channels 0-3, 8-11 */
                        const __m256i hi = _mm256_unpackhi_epi16(xa, xb); /* 4-7, 12-15 */
                        const __m512i x = _mm512_inserti64x4(
                            _mm512_castsi256_si512(_mm256_permute2x128_si256(lo, hi, 0x20)),
                            _mm256_permute2x128_si256(lo, hi, 0x31), 1);
                        a = _mm512_dpwssd_epi32(
                            a, x, _mm512_loadu_si512((const void *)(weights + (q * c + k) * 2)));
                    }
                    _mm512_storeu_si512((void *)(acc + k), a);
                }
#endif
#if defined(__AVX2__)
                for (; k + 8 <= c; k += 8) {
                    __m256i a = _mm256_setzero_si256();
                    for (int64_t q = 0; q < pairs; ++q) {
                        const __m128i xa = _mm_loadu_si128((const __m128i *)(corner + at[2 * q] + k));
                        const __m128i xb = _mm_loadu_si128(
                            (const __m128i *)(corner + at[2 * q + 1] + k));
                        const __m256i x = _mm256_set_m128i(_mm_unpackhi_epi16(xa, xb),
                                                           _mm_unpacklo_epi16(xa, xb));
                        const __m256i w = _mm256_loadu_si256(
                            (const __m256i *)(weights + (q * c + k) * 2));
                        a = _mm256_add_epi32(a, _mm256_madd_epi16(x, w));
                    }
                    _mm256_storeu_si256((__m256i *)(acc + k), a);
                }
#endif
                for (; k < c; ++k) {
                    int32_t sum = 0;
                    for (int64_t q = 0; q < pairs; ++q) {
                        const int16_t *w = weights + (q * c + k) * 2;
                        sum += (int32_t)corner[at[2 * q] + k] * w[0] +
                               (int32_t)corner[at[2 * q + 1] + k] * w[1];
                    }
                    acc[k] = sum;
                }
                if (fb)
                    requantize_f(acc, fb, fb + padded, fb[2 * padded],
                                 y + ((b * oh + oy) * ow + ox) * c, c, zy, fl, fh);
                else
                    requantize(acc, mult, bias, y + ((b * oh + oy) * ow + ox) * c, c, zy, fl, fh,
                               r[F_LO] < 0);
            }
    }
}

static void qdwconv(const int64_t *r, const uint8_t *params, uint8_t *arena) {
    widen_part(r, params, arena, 0, r[F_N] * r[F_PH]);
    qdwconv_part(r, params, arena, 0, r[F_N] * r[F_OH]);
}

/* A float product: y[r][j] = bias[j] + sum_k x[r][k] * wt[k][j] (wt: the weight transposed). */
static void linear_f(const int64_t *r, const uint8_t *params, uint8_t *arena) {
    const int64_t rows = r[F_N], k = r[F_C], oc = r[F_OC];
    const float *x = (const float *)(arena + r[F_IN]), *wt = (const float *)(params + r[F_WOFF]);
    const float *bias = (const float *)(params + r[F_BOFF]);
    float *y = (float *)(arena + r[F_OUT]);
    for (int64_t i = 0; i < rows; ++i) {
        float *out = y + i * oc;
        for (int64_t j = 0; j < oc; ++j) out[j] = 0.0f;
        for (int64_t q = 0; q < k; ++q) {
            const float v = x[i * k + q];
            for (int64_t j = 0; j < oc; ++j) out[j] += v * wt[q * oc + j];
        }
        for (int64_t j = 0; j < oc; ++j) out[j] += bias[j];
    }
}

/* Max or average over windows, channels-last; T the element type. The pads never win a max
   (skipped); an average counts them where count_include_pad (x1) says. */
#define POOL(NAME, T, INIT, STEP, DONE)                                                          \
    static void NAME(const int64_t *r, const T *restrict x, T *restrict y) {                   \
        const int64_t n = r[F_N], h = r[F_H], w = r[F_W], c = r[F_C], oh = r[F_OH];             \
        const int64_t ow = r[F_OW], kh = r[F_KH], kw = r[F_KW], sh = r[F_SH], sw = r[F_SW];     \
        const int64_t dh = r[F_DH], dw = r[F_DW], pt = r[F_PT], pl = r[F_PL];                   \
        const int64_t eh = r[F_PH], ew = r[F_PW], include = r[F_X1];                            \
        (void)include; (void)eh; (void)ew;                                                      \
        for (int64_t b = 0; b < n; ++b)                                                         \
            for (int64_t oy = 0; oy < oh; ++oy)                                                 \
                for (int64_t ox = 0; ox < ow; ++ox) {                                           \
                    T *out = y + ((b * oh + oy) * ow + ox) * c;                                 \
                    int64_t count = 0, inside = 0;                                              \
                    for (int64_t k = 0; k < c; ++k) out[k] = INIT;                              \
                    for (int64_t ky = 0; ky < kh; ++ky) {                                       \
                        const int64_t iy = oy * sh - pt + ky * dh;                              \
                        for (int64_t kx = 0; kx < kw; ++kx) {                                   \
                            const int64_t ix = ox * sw - pl + kx * dw;                          \
                            if (iy < eh && ix < ew) ++count; /* within the pads' end */         \
                            if (iy < 0 || iy >= h || ix < 0 || ix >= w) continue;               \
                            ++inside;                                                           \
                            const T *in = x + ((b * h + iy) * w + ix) * c;                      \
                            for (int64_t k = 0; k < c; ++k) STEP;                               \
                        }                                                                       \
                    }                                                                           \
                    DONE;                                                                       \
                }                                                                               \
    }

POOL(maxpool_f, float, -INFINITY, out[k] = (in[k] > out[k] || in[k] != in[k]) ? in[k] : out[k], )
POOL(avgpool_f, float, 0.0f, out[k] += in[k],
     { const float d = (float)(include ? count : inside);
       for (int64_t k = 0; k < c; ++k) out[k] /= d; })

static void gap_f(const int64_t *r, const float *restrict x, float *restrict y) {
    const int64_t n = r[F_N], hw = r[F_H] * r[F_W], c = r[F_C];
    for (int64_t b = 0; b < n; ++b) {
        float *out = y + b * c;
        for (int64_t k = 0; k < c; ++k) out[k] = 0.0f;
        for (int64_t p = 0; p < hw; ++p)
            for (int64_t k = 0; k < c; ++k) out[k] += x[(b * hw + p) * c + k];
        for (int64_t k = 0; k < c; ++k) out[k] /= (float)hw;
    }
}

#include "qcnn_glue.h" /* the elementwise records: lut8, qadd8, quant, dequant, float */

enum { PIXELS = 256 }; /* pixels an item of an import's or export's job */

static int64_t transpose_items(const int64_t *r) {
    return r[F_N] * ((r[F_H] * r[F_W] + PIXELS - 1) / PIXELS);
}

/* An import (NCHW float in -> NHWC float) or export (back) of pixels [begin, end) * PIXELS of
   each image: each item writes its pixels' runs (its own lines of the output, but at their
   ends: no two threads share a line but there). */
static void transpose(const int64_t *r, uint8_t *arena, void **ext, int64_t begin, int64_t end) {
    const int64_t c = r[F_C], hw = r[F_H] * r[F_W], per = (hw + PIXELS - 1) / PIXELS;
    const int in = r[F_OP] == OP_IMPORT;
    const float *src = in ? (const float *)ext[r[F_IN]] : (const float *)(arena + r[F_IN]);
    float *dst = in ? (float *)(arena + r[F_OUT]) : (float *)ext[r[F_OUT]];
    for (int64_t item = begin; item < end; ++item) {
        const int64_t b = item / per, p0 = (item % per) * PIXELS;
        const int64_t p1 = p0 + PIXELS < hw ? p0 + PIXELS : hw;
        if (in)
            for (int64_t k = 0; k < c; ++k)
                for (int64_t p = p0; p < p1; ++p) dst[(b * hw + p) * c + k] = src[(b * c + k) * hw + p];
        else
            for (int64_t k = 0; k < c; ++k)
                for (int64_t p = p0; p < p1; ++p) dst[(b * c + k) * hw + p] = src[(b * hw + p) * c + k];
    }
}

static int run_record(const int64_t *r, const uint8_t *params, uint8_t *arena, void **ext) {
    switch (r[F_OP]) {
    case OP_IMPORT: case OP_EXPORT:
        transpose(r, arena, ext, 0, transpose_items(r));
        break;
    case OP_QUANT: case OP_DEQUANT: case OP_ADD_F: case OP_ADDC_F: case OP_HSIG_F: case OP_MUL_F:
    case OP_RELU_F: case OP_LUT8: case OP_QADD8:
        eltwise_part(r, params, arena, 0, eltwise_items(r));
        break;
    case OP_QCONV:
        qconv(r, params, arena);
        break;
    case OP_QDWCONV:
        qdwconv(r, params, arena);
        break;
    case OP_QCONV8:
        qconv_bytes(r, params, arena);
        break;
    case OP_QDW8:
        qdw8(r, params, arena);
        break;
    case OP_LINEAR_F:
        linear_f(r, params, arena);
        break;
    case OP_FDWCONV_Q:
        fdwconv_q(r, params, arena);
        break;
    case OP_MAXPOOL_F:
        maxpool_f(r, (const float *)(arena + r[F_IN]), (float *)(arena + r[F_OUT]));
        break;
    case OP_MAXPOOL_Q:
        maxpool_part(r, params, arena, 0, r[F_N] * r[F_OH]);
        break;
    case OP_AVGPOOL_F:
        avgpool_f(r, (const float *)(arena + r[F_IN]), (float *)(arena + r[F_OUT]));
        break;
    case OP_GAP_F:
        gap_f(r, (const float *)(arena + r[F_IN]), (float *)(arena + r[F_OUT]));
        break;
    default:
        return 1;
    }
    return 0;
}

#include "qcnn_pool.h"

static void **crew_ext; /* the crew's run's edges (under crew.owner) */

static void transpose_part(const int64_t *r, const uint8_t *params, uint8_t *arena,
                           int64_t begin, int64_t end) {
    (void)params;
    transpose(r, arena, crew_ext, begin, end);
}

/* A split record (F_SPLIT, set by qcnn.py's plan) on the crew's `workers` and the caller: its
   scratch's rows, then its output's items; 0 where its kind is not split. */
static int split_record(const int64_t *r, const uint8_t *params, uint8_t *arena, int workers) {
    switch (r[F_OP]) {
    case OP_IMPORT: case OP_EXPORT:
        crew_run(transpose_part, r, params, arena, transpose_items(r), 1, workers);
        return 1;
    case OP_MAXPOOL_Q:
        crew_run(maxpool_part, r, params, arena, r[F_N] * r[F_OH], 1, workers);
        return 1;
    case OP_QCONV8:
        if (!bytes_in_place(r)) crew_run(pad_part, r, params, arena, r[F_N] * r[F_PH], 8, workers);
        crew_run(qconv8_part, r, params, arena, qconv8_items(r), 1, workers);
        return 1;
    case OP_QCONV:
        crew_run(widen_part, r, params, arena, r[F_N] * r[F_PH], 8, workers);
        crew_run(qconv_part, r, params, arena, qconv_items(r), 8, workers);
        return 1;
    case OP_QDWCONV:
        crew_run(widen_part, r, params, arena, r[F_N] * r[F_PH], 8, workers);
        crew_run(qdwconv_part, r, params, arena, r[F_N] * r[F_OH], 1, workers);
        return 1;
    case OP_QDW8:
        crew_run(pad_part, r, params, arena, r[F_N] * r[F_PH], 8, workers);
        crew_run(qdw8_part, r, params, arena, r[F_N] * r[F_OH], 1, workers);
        return 1;
    case OP_QUANT: case OP_DEQUANT: case OP_ADD_F: case OP_ADDC_F: case OP_HSIG_F: case OP_MUL_F:
    case OP_RELU_F: case OP_LUT8: case OP_QADD8:
        crew_run(eltwise_part, r, params, arena, eltwise_items(r), 1, workers);
        return 1;
    default:
        return 0;
    }
}

/* Runs the records in order; ext: the partition's input then output pointers (float32, NCHW).
   On the threads backplane_qcnn_threads asked for in this thread: the split records on the crew
   (where no other run holds it), the others on the caller; else every record on the caller.
   Returns 0, or 1 + the index of a record of an unknown op. */
int backplane_qcnn_run(const int64_t *records, int64_t count, const uint8_t *params,
                       uint8_t *arena, void **ext) {
    if (crew_asked > 1 && pthread_mutex_trylock(&crew.owner) == 0) {
        const int workers = crew_workers((int)crew_asked - 1);
        int failed = 0;
        crew_ext = ext;
        for (int64_t i = 0; i < count && !failed; ++i) {
            const int64_t *r = records + i * NF;
            if (workers && r[F_SPLIT] && split_record(r, params, arena, workers)) continue;
            if (run_record(r, params, arena, ext)) failed = (int)i + 1;
        }
        pthread_mutex_unlock(&crew.owner);
        return failed;
    }
    for (int64_t i = 0; i < count; ++i)
        if (run_record(records + i * NF, params, arena, ext)) return (int)(i + 1);
    return 0;
}

/* As backplane_qcnn_run, ``times`` times, adding each record's thread CPU seconds to seconds[i]. */
int backplane_qcnn_profile(const int64_t *records, int64_t count, const uint8_t *params,
                           uint8_t *arena, void **ext, double *seconds, int64_t times) {
    struct timespec a, b;
    for (int64_t t = 0; t < times; ++t)
        for (int64_t i = 0; i < count; ++i) {
            clock_gettime(CLOCK_THREAD_CPUTIME_ID, &a);
            if (run_record(records + i * NF, params, arena, ext)) return (int)(i + 1);
            clock_gettime(CLOCK_THREAD_CPUTIME_ID, &b);
            seconds[i] += (double)(b.tv_sec - a.tv_sec) + 1e-9 * (double)(b.tv_nsec - a.tv_nsec);
        }
    return 0;
}
