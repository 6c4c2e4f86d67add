/* A small CNN partition run in one call: a plan of layer records over one arena (cnn.py plans it).

Why: torch's oneDNN Graph partitions cost 6-9 us each beyond their arithmetic and its bridge 1-3 us
more, and a 32x32 CNN's layers each do a few microseconds of work; here a layer costs its loops.
Tensors live in the arena channels-last (NHWC: the channels contiguous, which every kernel's inner
loop runs over); the partition's inputs are copied in from NCHW and its outputs copied out to NCHW
by the first and last records. No -ffast-math (the build's flags): NaN in, NaN out, and every
comparison below is written so that a NaN takes the comparison's "keep x" side. */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#if defined(__FMA__) || defined(__AVX2__)
#include <immintrin.h>
#endif

typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4)));

/* A record's fields (cnn.py's FIELDS, in this order): int64 each, NF of them per record; F_SPLIT
   set where the record's work is split across the run's threads (cnn_pool.h). */
enum { F_OP, F_IN, F_IN2, F_OUT, F_N, F_H, F_W, F_C, F_OH, F_OW, F_OC, F_KH, F_KW, F_SH, F_SW,
       F_DH, F_DW, F_PT, F_PL, F_G, F_WOFF, F_BOFF, F_ACT, F_AOFF, F_SCR, F_PH, F_PW, F_VB,
       F_X1, F_X2, F_MACS, F_SPLIT, NF = 32 };
enum { OP_IMPORT = 1, OP_EXPORT, OP_CONV, OP_DWCONV, OP_MAXPOOL, OP_AVGPOOL, OP_GAP, OP_GMP,
       OP_LINEAR, OP_ADD, OP_MUL, OP_ACT, OP_SLICE, OP_DECONV, OP_RESIZE, OP_GATHER,
       OP_SCATTER, OP_ARITH, OP_REDUCE, OP_GNORM, OP_LNORM };
enum { AR_ADD, AR_SUB, AR_MUL, AR_DIV, AR_POW, AR_AFFINE };
enum { RD_MAX, RD_MIN, RD_SUM, RD_MEAN };
enum { ACT_NONE, ACT_RELU, ACT_CLIP, ACT_HSWISH, ACT_HSIGMOID, ACT_SIGMOID, ACT_SWISH, ACT_LEAKY,
       ACT_TANH, ACT_GELU, ACT_ERF };

static inline v8 vload(const float *p) { return *(const v8u *)p; }
static inline void vstore(float *p, v8 v) { *(v8u *)p = v; }
static inline v8 vsplat(float x) { return (v8){x, x, x, x, x, x, x, x}; }
typedef int32_t v8i __attribute__((vector_size(32)));
/* m ? y : x, lane by lane (m a comparison's all-ones or zero lanes) */
static inline v8 vselect(v8i m, v8 y, v8 x) { return (v8)((m & (v8i)y) | (~m & (v8i)x)); }
static inline v8 vfma(v8 a, v8 b, v8 c) {
#if defined(__FMA__)
    return (v8)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
    return a * b + c;
#endif
}

/* e^x, 8 lanes, for the logistic function (Cephes' expf: a degree-5 polynomial on x - n ln 2,
   times 2^n; within 1.2e-7 of expf over [-87.3, 88]): 0 below -87.3 and infinity above 88.7
   (where expf is within a denormal of 0, or infinite: sigmoid's 1 and 0, swish's NaN at -inf as
   libm's), NaN in, NaN out. */
static inline v8 vexp(v8 x) {
    const v8 lo = vsplat(-87.3f), hi = vsplat(88.0f), in = x;
    x = vselect(x < lo, lo, x);
    x = vselect(x > hi, hi, x);
    v8 t = x * vsplat(1.44269504088896341f) + vsplat(0.5f);
    t = vselect(t != t, vsplat(0.0f), t);  /* a NaN converted to int is undefined */
    v8i n = __builtin_convertvector(t, v8i);
    n -= (v8i)(__builtin_convertvector(n, v8) > t) & 1;  /* floor */
    const v8 fn = __builtin_convertvector(n, v8);
    x = x - fn * vsplat(0.693359375f) - fn * vsplat(-2.12194440e-4f);
    v8 y = vsplat(1.9875691500e-4f);
    y = vfma(y, x, vsplat(1.3981999507e-3f));
    y = vfma(y, x, vsplat(8.3334519073e-3f));
    y = vfma(y, x, vsplat(4.1665795894e-2f));
    y = vfma(y, x, vsplat(1.6666665459e-1f));
    y = vfma(y, x, vsplat(5.0000001201e-1f));
    y = vfma(y, x * x, x + vsplat(1.0f));
    y *= (v8)((n + 127) << 23);
    y = vselect(in < lo, vsplat(0.0f), y);
    return vselect(in > vsplat(88.7f), vsplat(INFINITY), y);
}

/* erf(x), 8 lanes, for GELU's 1 + erf(x / sqrt 2), where libm's erff was a call per element
   (audio_conv1d's GELUs, 2192 of them: ~half its plan's time): Abramowitz and Stegun's 7.1.26,
   1 - t P(t) e^-x^2 with t = 1 / (1 + p|x|), the sign restored (torch's own vectorized erf):
   within 4.9e-7 of erf (near 0, where 1 - ... cancels; 1 + erf does not see it there), GELU
   within 1.9e-7 of x / 2 (1 + erf) or of 1. erf(+-inf) is +-1 (e^-inf 0 in vexp); NaN in, NaN
   out. */
static inline v8 verf(v8 x) {
    const v8 ax = vselect(x < vsplat(0.0f), -x, x);
    const v8 t = vsplat(1.0f) / (vsplat(1.0f) + vsplat(0.3275911f) * ax);
    v8 r = vsplat(1.061405429f);
    r = vfma(r, t, vsplat(-1.453152027f));
    r = vfma(r, t, vsplat(1.421413741f));
    r = vfma(r, t, vsplat(-0.284496736f));
    r = vfma(r, t, vsplat(0.254829592f));
    const v8 y = vsplat(1.0f) - r * t * vexp(-(ax * ax));
    return vselect(x < vsplat(0.0f), -y, y);
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
    case ACT_SWISH: {  /* 8 at a time by vexp (libm's expf a call per element: ~7 ns each) */
        const int swish = kind == ACT_SWISH;
        int64_t i = 0;
        for (; i + 8 <= n; i += 8) {
            const v8 x = vload(p + i), s = vsplat(1.0f) / (vsplat(1.0f) + vexp(-x));
            vstore(p + i, swish ? x * s : s);
        }
        for (; i < n; ++i) {
            const float s = 1.0f / (1.0f + expf(-p[i]));
            p[i] = swish ? p[i] * s : s;
        }
        break;
    }
    case ACT_LEAKY: {
        const float alpha = a[0];
        for (int64_t i = 0; i < n; ++i) p[i] = p[i] < 0.0f ? alpha * p[i] : p[i];
        break;
    }
    case ACT_TANH:
        for (int64_t i = 0; i < n; ++i) p[i] = tanhf(p[i]);
        break;
    case ACT_GELU: {  /* torch's: x * 0.5 * (1 + erf(x / sqrt(2))); -Inf gives NaN, as the steps' */
        int64_t i = 0;
        for (; i + 8 <= n; i += 8) {
            const v8 x = vload(p + i);
            vstore(p + i, x * vsplat(0.5f) * (vsplat(1.0f) + verf(x * vsplat(0.70710678f))));
        }
        for (; i < n; ++i) p[i] = p[i] * 0.5f * (1.0f + erff(p[i] * 0.70710678f));
        break;
    }
    case ACT_ERF: {  /* an Erf of its own (a GELU written otherwise than the plan folds) */
        int64_t i = 0;
        for (; i + 8 <= n; i += 8) vstore(p + i, verf(vload(p + i)));
        for (; i < n; ++i) p[i] = erff(p[i]);
        break;
    }
    default:
        break;
    }
}

/* NCHW (the caller's) to NHWC (the arena's), and back. */
static void import_nchw(const float *restrict x, float *restrict y, int64_t N, int64_t C,
                        int64_t HW) {
    for (int64_t n = 0; n < N; ++n, x += C * HW, y += C * HW) {
        if (C == 3) {  /* an image's RGB: the channel loop unrolled (4.4 -> ~1 us at 32x32) */
            const float *restrict r = x, *restrict g = x + HW, *restrict b = x + 2 * HW;
            for (int64_t p = 0; p < HW; ++p) {
                y[3 * p] = r[p];
                y[3 * p + 1] = g[p];
                y[3 * p + 2] = b[p];
            }
            continue;
        }
        for (int64_t p = 0; p < HW; ++p)
            for (int64_t c = 0; c < C; ++c) y[p * C + c] = x[c * HW + p];
    }
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

#include "cnn_conv.h"
#include "cnn_ops.h"
#include "cnn_detect.h"
#include "cnn_seq.h"
#include "cnn_pool.h"
#include "cnn_split.h"

/* Runs the plan: records[count][NF] over the arena, with the packed parameters; ext holds the
   caller's input then output pointers (an import's F_IN, an export's F_OUT index it). */
static int step(const int64_t *f, const float *params, float *arena, float *const *ext);

/* One record: on the pool's `workers` and the caller where it is split, else on the caller. */
static inline int run_record(const int64_t *f, const float *params, float *arena,
                             float *const *ext, int workers) {
    if (workers && f[F_SPLIT] && split_step(f, params, arena, ext, workers)) return 0;
    return step(f, params, arena, ext);
}

/* On the threads backplane_cnn_threads asked for in this thread: the split records on the pool
   (where no other run holds it), the others on the caller; else every record on the caller. */
int backplane_cnn_run(const int64_t *records, int64_t count, const float *params, float *arena,
                      float *const *ext) {
    if (asked > 1 && pthread_mutex_trylock(&team.owner) == 0) {
        int64_t by = 0, all = 0;
        const int pooled = pool_ready(&by, &all);
        const int workers = pooled ? pool_workers((int)asked - 1) : 0;
        int failed = 0;
        for (int64_t i = 0; i < count && !failed; ++i)
            if (run_record(records + i * NF, params, arena, ext, workers)) failed = (int)i + 1;
        if (pooled) pool_judge(by, all);
        pthread_mutex_unlock(&team.owner);
        return failed;
    }
    for (int64_t i = 0; i < count; ++i)
        if (step(records + i * NF, params, arena, ext)) return (int)i + 1;
    return 0;
}

/* Each record's best wall seconds over `times` runs (seconds[i], at most its value given) on the
   threads asked, as backplane_cnn_run runs it: on a busy machine a record's best run is one
   that met a quiet moment, where a whole run's seldom does (the bench's per-layer figures at
   more than one thread). */
int backplane_cnn_profile_best(const int64_t *records, int64_t count, const float *params,
                               float *arena, float *const *ext, double *seconds, int64_t times) {
    const int pooled = asked > 1 && pthread_mutex_trylock(&team.owner) == 0;
    const int workers = pooled ? pool_workers((int)asked - 1) : 0;
    int failed = 0;
    for (int64_t t = 0; t < times && !failed; ++t)
        for (int64_t i = 0; i < count && !failed; ++i) {
            const int64_t start = now_ns();
            if (run_record(records + i * NF, params, arena, ext, workers)) failed = (int)i + 1;
            const double took = 1e-9 * (double)(now_ns() - start);
            seconds[i] = took < seconds[i] ? took : seconds[i];
        }
    if (pooled) pthread_mutex_unlock(&team.owner);
    return failed;
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
        if (f[F_X1] >= EDGE_INT32) return import_integers(f, arena, ext);
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
        act_pass(arena + f[F_OUT], f[F_N], f[F_ACT], params + f[F_AOFF]);
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
    case OP_EMBED: return embed(f, arena, params);
    case OP_ROWNORM: rownorm(f, arena, params); break;
    default: return detect_step(f, params, arena, ext);
    }
    return 0;
}

int backplane_cnn_fields(void) { return NF; }
