/* A small CNN partition run in one call: a plan of layer records over one arena (cnn.py plans it).

Why: torch's oneDNN Graph partitions cost 6-9 us each beyond their arithmetic and its bridge 1-3 us
more, and a 32x32 CNN's layers each do a few microseconds of work; here a layer costs its loops.
Tensors live in the arena channels-last (NHWC: the channels contiguous, which every kernel's inner
loop runs over); the partition's inputs are copied in from NCHW and its outputs copied out to NCHW
by the first and last records. No -ffast-math (the build's flags): NaN in, NaN out, and every
comparison below is written so that a NaN takes the comparison's "keep x" side. */
#define _POSIX_C_SOURCE 199309L
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#if defined(__FMA__) || defined(__AVX2__)
#include <immintrin.h>
#endif

typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4)));

/* A record's fields (cnn.py's FIELDS, in this order): int64 each, NF of them per record. */
enum { F_OP, F_IN, F_IN2, F_OUT, F_N, F_H, F_W, F_C, F_OH, F_OW, F_OC, F_KH, F_KW, F_SH, F_SW,
       F_DH, F_DW, F_PT, F_PL, F_G, F_WOFF, F_BOFF, F_ACT, F_AOFF, F_SCR, F_PH, F_PW, F_VB,
       F_X1, F_X2, NF = 32 };
enum { OP_IMPORT = 1, OP_EXPORT, OP_CONV, OP_DWCONV, OP_MAXPOOL, OP_AVGPOOL, OP_GAP, OP_GMP,
       OP_LINEAR, OP_ADD, OP_MUL, OP_ACT, OP_SLICE, OP_DECONV, OP_RESIZE, OP_GATHER,
       OP_SCATTER, OP_ARITH, OP_REDUCE, OP_GNORM, OP_LNORM };
enum { AR_ADD, AR_SUB, AR_MUL, AR_DIV, AR_POW, AR_AFFINE };
enum { RD_MAX, RD_MIN, RD_SUM, RD_MEAN };
enum { ACT_NONE, ACT_RELU, ACT_CLIP, ACT_HSWISH, ACT_HSIGMOID, ACT_SIGMOID, ACT_SWISH, ACT_LEAKY,
       ACT_TANH, ACT_GELU };

static inline v8 vload(const float *p) { return *(const v8u *)p; }
static inline void vstore(float *p, v8 v) { *(v8u *)p = v; }
static inline v8 vsplat(float x) { return (v8){x, x, x, x, x, x, x, x}; }
static inline v8 vfma(v8 a, v8 b, v8 c) {
#if defined(__FMA__)
    return (v8)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
    return a * b + c;
#endif
}

/* p[i] = act(p[i] + r[i]) (r where given), over n floats; one loop per kind, for the vectorizer. */
static void finish(float *restrict p, const float *restrict r, int64_t n, int64_t kind,
                   const float *a) {
    if (r)
        for (int64_t i = 0; i < n; ++i) p[i] += r[i];
    switch (kind) {
    case ACT_RELU:
        for (int64_t i = 0; i < n; ++i) p[i] = p[i] < 0.0f ? 0.0f : p[i];
        break;
    case ACT_CLIP: {
        const float lo = a[0], hi = a[1];
        for (int64_t i = 0; i < n; ++i) {
            float x = p[i];
            x = x < lo ? lo : x;
            p[i] = x > hi ? hi : x;
        }
        break;
    }
    case ACT_HSWISH:
        for (int64_t i = 0; i < n; ++i) {
            float x = p[i], c = x + 3.0f;
            c = c < 0.0f ? 0.0f : c;
            c = c > 6.0f ? 6.0f : c;
            p[i] = x * c / 6.0f;
        }
        break;
    case ACT_HSIGMOID: {
        const float alpha = a[0], beta = a[1];
        for (int64_t i = 0; i < n; ++i) {
            float c = alpha * p[i] + beta;
            c = c < 0.0f ? 0.0f : c;
            p[i] = c > 1.0f ? 1.0f : c;
        }
        break;
    }
    case ACT_SIGMOID:
        for (int64_t i = 0; i < n; ++i) p[i] = 1.0f / (1.0f + expf(-p[i]));
        break;
    case ACT_SWISH:
        for (int64_t i = 0; i < n; ++i) p[i] = p[i] * (1.0f / (1.0f + expf(-p[i])));
        break;
    case ACT_LEAKY: {
        const float alpha = a[0];
        for (int64_t i = 0; i < n; ++i) p[i] = p[i] < 0.0f ? alpha * p[i] : p[i];
        break;
    }
    case ACT_TANH:
        for (int64_t i = 0; i < n; ++i) p[i] = tanhf(p[i]);
        break;
    case ACT_GELU:  /* torch's: x * 0.5 * (1 + erf(x / sqrt(2))); -Inf gives NaN, as the steps' */
        for (int64_t i = 0; i < n; ++i) p[i] = p[i] * 0.5f * (1.0f + erff(p[i] * 0.70710678f));
        break;
    default:
        break;
    }
}

/* NCHW (the caller's) to NHWC (the arena's), and back. */
static void import_nchw(const float *restrict x, float *restrict y, int64_t N, int64_t C,
                        int64_t HW) {
    for (int64_t n = 0; n < N; ++n, x += C * HW, y += C * HW)
        for (int64_t p = 0; p < HW; ++p)
            for (int64_t c = 0; c < C; ++c) y[p * C + c] = x[c * HW + p];
}

static void export_nchw(const float *restrict x, float *restrict y, int64_t N, int64_t C,
                        int64_t HW) {
    for (int64_t n = 0; n < N; ++n, x += C * HW, y += C * HW)
        for (int64_t c = 0; c < C; ++c)
            for (int64_t p = 0; p < HW; ++p) y[c * HW + p] = x[p * C + c];
}

/* A float16 edge (F_X1 set on an import or export record: a float16 partition computed in
   float32) converted on its way in or out, NCHW to NHWC as the float32 edges; the conversions
   round to nearest even, NaN stays NaN. Returns 0 where this compiler has no _Float16. */
static int half_edge(const int64_t *f, float *arena, float *const *ext, int in) {
#if defined(__FLT16_MAX__)
    const int64_t N = f[F_N], C = f[F_C], HW = f[F_H] * f[F_W];
    const int flat = HW == 1 || C == 1;
    if (in) {
        const _Float16 *restrict x = (const _Float16 *)ext[f[F_IN]];
        float *restrict y = arena + f[F_OUT];
        for (int64_t n = 0; n < N; ++n, x += C * HW, y += C * HW)
            for (int64_t p = 0; p < HW; ++p)
                for (int64_t c = 0; c < C; ++c)
                    y[p * C + c] = (float)x[flat ? p * C + c : c * HW + p];
    } else {
        const float *restrict x = arena + f[F_IN];
        _Float16 *restrict y = (_Float16 *)ext[f[F_OUT]];
        for (int64_t n = 0; n < N; ++n, x += C * HW, y += C * HW)
            for (int64_t c = 0; c < C; ++c)
                for (int64_t p = 0; p < HW; ++p)
                    y[flat ? p * C + c : c * HW + p] = (_Float16)x[p * C + c];
    }
    return 1;
#else
    (void)f, (void)arena, (void)ext, (void)in;
    return 0;
#endif
}

int backplane_cnn_half(void) {
#if defined(__FLT16_MAX__)
    return 1;
#else
    return 0;
#endif
}

/* The input copied into a zeroed frame of PH x PW pixels at (PT, PL): the convolution then reads
   its windows without a bounds check. */
static void pad_frame(const int64_t *f, const float *restrict x, float *restrict y) {
    const int64_t N = f[F_N], H = f[F_H], W = f[F_W], C = f[F_C], PH = f[F_PH], PW = f[F_PW];
    const int64_t PT = f[F_PT], PL = f[F_PL];
    const size_t row = sizeof(float) * PW * C, side = sizeof(float) * PL * C;
    const size_t rest = sizeof(float) * (PW - PL - W) * C;
    for (int64_t n = 0; n < N; ++n) {
        float *frame = y + n * PH * PW * C;
        memset(frame, 0, row * PT);  /* only the border is zeroed: the input overwrites the rest */
        for (int64_t h = 0; h < H; ++h) {
            float *line = frame + (h + PT) * PW * C;
            memset(line, 0, side);
            memcpy(line + PL * C, x + (n * H + h) * W * C, sizeof(float) * W * C);
            memset(line + (PL + W) * C, 0, rest);
        }
        memset(frame + (H + PT) * PW * C, 0, row * (PH - H - PT));
    }
}

/* pb output pixels of one row by VB (8 or 16) output channels of one group: the register tile
   (6 x 16 or 8 x 8: 12 or 8 accumulators of the 16 AVX registers). ip: the first pixel's window
   origin; xs: the step between the pixels' origins. */
enum { PB_MAX = 8 };
static inline __attribute__((always_inline)) void tile(
    int nv, int pb, const float *restrict ip, int64_t xs, int64_t rowstep, int64_t colstep,
    int64_t KH, int64_t KW, int64_t ICG, const float *restrict wk, const float *restrict bk,
    float *restrict op, int64_t OC, int64_t pixels, int64_t valid) {
    const int64_t VB = 8 * nv;
    v8 a0[PB_MAX], a1[PB_MAX];
    for (int r = 0; r < pb; ++r) {
        a0[r] = vload(bk);
        a1[r] = nv > 1 ? vload(bk + 8) : vsplat(0.0f);
    }
    for (int64_t kh = 0; kh < KH; ++kh)
        for (int64_t kw = 0; kw < KW; ++kw) {
            const float *x = ip + kh * rowstep + kw * colstep;
            const float *w = wk + (kh * KW + kw) * ICG * VB;
            for (int64_t ic = 0; ic < ICG; ++ic, w += VB) {
                const v8 w0 = vload(w), w1 = nv > 1 ? vload(w + 8) : vsplat(0.0f);
                for (int r = 0; r < pb; ++r) {
                    const v8 xr = vsplat(x[r * xs + ic]);
                    a0[r] = vfma(xr, w0, a0[r]);
                    if (nv > 1) a1[r] = vfma(xr, w1, a1[r]);
                }
            }
        }
    if (pixels == pb && valid == VB) {
        for (int r = 0; r < pb; ++r) {
            vstore(op + r * OC, a0[r]);
            if (nv > 1) vstore(op + r * OC + 8, a1[r]);
        }
        return;
    }
    float t[16];
    for (int64_t r = 0; r < pixels; ++r) {
        vstore(t, a0[r]);
        if (nv > 1) vstore(t + 8, a1[r]);
        for (int64_t j = 0; j < valid; ++j) op[r * OC + j] = t[j];
    }
}

enum { CHUNK = 48 };  /* pixels: a multiple of both tiles' 6 and 8 */

/* A convolution of any groups, its weights packed per group and block of VB output channels as
   [kh][kw][ic][VB] (zero past the group's channels), over a padded frame or the input itself. */
static void conv(const int64_t *f, float *A, const float *P) {
    const int64_t N = f[F_N], C = f[F_C], OH = f[F_OH], OW = f[F_OW], OC = f[F_OC];
    const int64_t KH = f[F_KH], KW = f[F_KW], SH = f[F_SH], SW = f[F_SW], DH = f[F_DH],
                  DW = f[F_DW], G = f[F_G], VB = f[F_VB], PH = f[F_PH], PW = f[F_PW];
    const int64_t ICG = C / G, OCG = OC / G, NB = (OCG + VB - 1) / VB;
    const float *src = A + f[F_IN];
    if (f[F_SCR] >= 0) {
        pad_frame(f, src, A + f[F_SCR]);
        src = A + f[F_SCR];
    }
    float *out = A + f[F_OUT];
    const float *res = f[F_IN2] >= 0 ? A + f[F_IN2] : 0;
    const int64_t xs = SW * C, rowstep = DH * PW * C, colstep = DW * C;
    /* the wide tile (6 or 8 pixels) unless a short row wastes it: a tile costs about its pixels
       and two more (8 pixels: two wide tiles of 6 cost 16, two of 4 cost 12) */
    const int64_t wide = VB == 16 ? 6 : 8;
    const int64_t pb = (OW + wide - 1) / wide * (wide + 2) <= (OW + 3) / 4 * 6 ? wide : 4;
    for (int64_t n = 0; n < N; ++n)
        for (int64_t oh = 0; oh < OH; ++oh) {
            float *orow = out + (n * OH + oh) * OW * OC;
            const float *irow = src + (n * PH + oh * SH) * PW * C;
            const float *rrow = res ? res + (n * OH + oh) * OW * OC : 0;
            /* CHUNK pixels at a time, every block of channels, then their residual and
               activation while they are in L1 (a 1x1's row is all its pixels) */
            for (int64_t ow0 = 0; ow0 < OW; ow0 += CHUNK) {
                const int64_t ow1 = OW - ow0 < CHUNK ? OW : ow0 + CHUNK;
                for (int64_t ow = ow0, pixels; ow < ow1; ow += pixels) {
                    pixels = ow1 - ow < pb ? ow1 - ow : pb;
                    for (int64_t g = 0; g < G; ++g)
                        for (int64_t b = 0; b < NB; ++b) {
                            const float *wk = P + f[F_WOFF] + (g * NB + b) * KH * KW * ICG * VB;
                            const float *bk = P + f[F_BOFF] + (g * NB + b) * VB;
                            const int64_t oc0 = g * OCG + b * VB;
                            const int64_t valid = OCG - b * VB < VB ? OCG - b * VB : VB;
                            const float *ip = irow + ow * SW * C + g * ICG;
                            float *op = orow + ow * OC + oc0;
                            if (VB == 16 && pb == 6)
                                tile(2, 6, ip, xs, rowstep, colstep, KH, KW, ICG, wk, bk, op, OC,
                                     pixels, valid);
                            else if (VB == 16)
                                tile(2, 4, ip, xs, rowstep, colstep, KH, KW, ICG, wk, bk, op, OC,
                                     pixels, valid);
                            else if (pb == 8)
                                tile(1, 8, ip, xs, rowstep, colstep, KH, KW, ICG, wk, bk, op, OC,
                                     pixels, valid);
                            else
                                tile(1, 4, ip, xs, rowstep, colstep, KH, KW, ICG, wk, bk, op, OC,
                                     pixels, valid);
                        }
                }
                finish(orow + ow0 * OC, rrow ? rrow + ow0 * OC : 0, (ow1 - ow0) * OC, f[F_ACT],
                       P + f[F_AOFF]);
            }
        }
}

/* Four output pixels of a depthwise convolution by 8 channels, taps [kh0, kh1) x KW: the register
   tile, for pixels whose windows lie inside the input's columns. */
static inline __attribute__((always_inline)) void dwtile(
    const float *restrict ip, int64_t xs, int64_t rowstep, int64_t colstep, int64_t kh0,
    int64_t kh1, int64_t KW, int64_t C, const float *restrict w, const float *restrict bias,
    float *restrict op, int64_t pixels) {
    v8 acc[4];
    for (int r = 0; r < 4; ++r) acc[r] = vload(bias);
    for (int64_t kh = kh0; kh < kh1; ++kh)
        for (int64_t kw = 0; kw < KW; ++kw) {
            const float *x = ip + kh * rowstep + kw * colstep;
            const v8 wv = vload(w + (kh * KW + kw) * C);
            for (int r = 0; r < 4; ++r) acc[r] = vfma(vload(x + r * xs), wv, acc[r]);
        }
    for (int64_t r = 0; r < pixels; ++r) vstore(op + r * C, acc[r]);
}

/* One output pixel of a depthwise convolution, its window checked against the input's columns
   (the border pixels; rows [kh0, kh1) are inside). ip: the window's origin, maybe outside. */
static void dwpixel(const float *ip, int64_t iw0, int64_t W, int64_t rowstep, int64_t colstep,
                    int64_t DW, int64_t kh0, int64_t kh1, int64_t KW, int64_t C,
                    const float *restrict wt, const float *restrict bias, float *restrict o) {
    for (int64_t c = 0; c < C; ++c) o[c] = bias[c];
    for (int64_t kh = kh0; kh < kh1; ++kh)
        for (int64_t kw = 0; kw < KW; ++kw) {
            const int64_t iw = iw0 + kw * DW;
            if (iw < 0 || iw >= W) continue;
            const float *restrict x = ip + kh * rowstep + kw * colstep;
            const float *restrict w = wt + (kh * KW + kw) * C;
            for (int64_t c = 0; c < C; ++c) o[c] = fmaf(x[c], w[c], o[c]);
        }
}

/* A depthwise convolution (one input and one output channel a group), weights [kh][kw][C], read
   from the input itself: the taps of rows outside it skipped per output row, the pixels whose
   windows cross a side column by column (dwpixel), the others 4 by 8 channels in registers. */
static void dwconv(const int64_t *f, float *A, const float *P) {
    const int64_t N = f[F_N], H = f[F_H], W = f[F_W], C = f[F_C], OH = f[F_OH], OW = f[F_OW];
    const int64_t KH = f[F_KH], KW = f[F_KW], SH = f[F_SH], SW = f[F_SW], DH = f[F_DH],
                  DW = f[F_DW], PT = f[F_PT], PL = f[F_PL];
    const float *src = A + f[F_IN];
    float *out = A + f[F_OUT];
    const float *res = f[F_IN2] >= 0 ? A + f[F_IN2] : 0;
    const float *restrict wt = P + f[F_WOFF], *restrict bias = P + f[F_BOFF];
    const int64_t xs = SW * C, rowstep = DH * W * C, colstep = DW * C, C8 = C / 8 * 8;
    int64_t lo = (PL + SW - 1) / SW, hi = (W - 1 - (KW - 1) * DW + PL) / SW + 1;
    if (W - 1 - (KW - 1) * DW + PL < 0) hi = 0;
    lo = lo < OW ? lo : OW;
    hi = hi < lo ? lo : hi < OW ? hi : OW;
    for (int64_t n = 0; n < N; ++n)
        for (int64_t oh = 0; oh < OH; ++oh) {
            float *orow = out + (n * OH + oh) * OW * C;
            const int64_t ih0 = oh * SH - PT;
            int64_t kh0 = 0, kh1 = KH;
            while (kh0 < KH && ih0 + kh0 * DH < 0) ++kh0;
            while (kh1 > kh0 && ih0 + (kh1 - 1) * DH >= H) --kh1;
            /* the window's origin row, maybe outside: only rows [kh0, kh1) are read */
            const float *irow = src + (n * H + ih0) * W * C;
            for (int64_t ow = 0; ow < OW; ++ow) {
                if (ow == lo) {
                    for (int64_t pixels; ow < hi; ow += pixels) {
                        pixels = hi - ow < 4 ? hi - ow : 4;
                        const float *ip = irow + (ow * SW - PL) * C;
                        for (int64_t c = 0; c < C8; c += 8)
                            dwtile(ip + c, xs, rowstep, colstep, kh0, kh1, KW, C, wt + c,
                                   bias + c, orow + ow * C + c, pixels);
                        for (int64_t r = 0; r < pixels; ++r)
                            for (int64_t c = C8; c < C; ++c) {
                                float acc = bias[c];
                                for (int64_t kh = kh0; kh < kh1; ++kh)
                                    for (int64_t kw = 0; kw < KW; ++kw)
                                        acc = fmaf(ip[r * xs + kh * rowstep + kw * colstep + c],
                                                   wt[(kh * KW + kw) * C + c], acc);
                                orow[(ow + r) * C + c] = acc;
                            }
                    }
                    if (ow >= OW) break;
                }
                dwpixel(irow + (ow * SW - PL) * C, ow * SW - PL, W, rowstep, colstep, DW, kh0,
                        kh1, KW, C, wt, bias, orow + ow * C);
            }
            finish(orow, res ? res + (n * OH + oh) * OW * C : 0, OW * C, f[F_ACT], P + f[F_AOFF]);
        }
}

#include "cnn_ops.h"

/* Runs the plan: records[count][NF] over the arena, with the packed parameters; ext holds the
   caller's input then output pointers (an import's F_IN, an export's F_OUT index it). */
static int step(const int64_t *f, const float *params, float *arena, float *const *ext);

int backplane_cnn_run(const int64_t *records, int64_t count, const float *params, float *arena,
                      float *const *ext) {
    for (int64_t i = 0; i < count; ++i)
        if (step(records + i * NF, params, arena, ext)) return (int)i + 1;
    return 0;
}

/* The same, with each record's thread CPU seconds summed into seconds[i] over `times` runs: the
   profiler's (and the bench's) per-layer figures. */
int backplane_cnn_profile(const int64_t *records, int64_t count, const float *params,
                          float *arena, float *const *ext, double *seconds, int64_t times) {
    struct timespec a, b;
    for (int64_t t = 0; t < times; ++t)
        for (int64_t i = 0; i < count; ++i) {
            clock_gettime(CLOCK_THREAD_CPUTIME_ID, &a);
            if (step(records + i * NF, params, arena, ext)) return (int)i + 1;
            clock_gettime(CLOCK_THREAD_CPUTIME_ID, &b);
            seconds[i] += (double)(b.tv_sec - a.tv_sec) + 1e-9 * (double)(b.tv_nsec - a.tv_nsec);
        }
    return 0;
}

static size_t bytes(const int64_t *f) {
    return sizeof(float) * (size_t)(f[F_N] * f[F_C] * f[F_H] * f[F_W]);
}

static int step(const int64_t *f, const float *params, float *arena, float *const *ext) {
    switch (f[F_OP]) {
    case OP_IMPORT:
        if (f[F_X1]) return !half_edge(f, arena, ext, 1);
        if (f[F_H] * f[F_W] == 1 || f[F_C] == 1)
            memcpy(arena + f[F_OUT], ext[f[F_IN]], bytes(f));
        else
            import_nchw(ext[f[F_IN]], arena + f[F_OUT], f[F_N], f[F_C], f[F_H] * f[F_W]);
        break;
    case OP_EXPORT:
        if (f[F_X1]) return !half_edge(f, arena, ext, 0);
        if (f[F_H] * f[F_W] == 1 || f[F_C] == 1)
            memcpy(ext[f[F_OUT]], arena + f[F_IN], bytes(f));
        else
            export_nchw(arena + f[F_IN], ext[f[F_OUT]], f[F_N], f[F_C], f[F_H] * f[F_W]);
        break;
    case OP_CONV: conv(f, arena, params); break;
    case OP_DWCONV: dwconv(f, arena, params); break;
    case OP_MAXPOOL: pool(f, arena, 1); break;
    case OP_AVGPOOL: pool(f, arena, 0); break;
    case OP_GAP: global_pool(f, arena, 0); break;
    case OP_GMP: global_pool(f, arena, 1); break;
    case OP_LINEAR: linear(f, arena, params); break;
    case OP_ADD: binary(f, arena, params, 0); break;
    case OP_MUL: binary(f, arena, params, 1); break;
    case OP_ACT:
        if (f[F_OUT] != f[F_IN])
            memcpy(arena + f[F_OUT], arena + f[F_IN], sizeof(float) * f[F_N]);
        finish(arena + f[F_OUT], 0, f[F_N], f[F_ACT], params + f[F_AOFF]);
        break;
    case OP_SLICE: slice_into(f, arena); break;
    case OP_DECONV: deconv(f, arena, params); break;
    case OP_RESIZE: resize(f, arena, params); break;
    case OP_GATHER: gather(f, arena, params); break;
    case OP_SCATTER: scatter(f, arena, params); break;
    case OP_ARITH: arith(f, arena, params); break;
    case OP_REDUCE: reduce(f, arena, params); break;
    case OP_GNORM: gnorm(f, arena, params); break;
    case OP_LNORM: lnorm(f, arena, params); break;
    default: return 1;
    }
    return 0;
}

int backplane_cnn_fields(void) { return NF; }
