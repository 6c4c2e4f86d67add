/* Scaled dot-product attention of CpuAcc's traces (fusion/attention.py's ScaledDotAttention) in
 * one call: per batch-head and block of query rows, the scores alpha Q K^T, masked (an additive
 * mask, a boolean condition's fill, or a causal diagonal), their softmax and its product with V,
 * the scores kept in a few rows of L1 instead of a (heads, L, S) tensor written and read three
 * times by torch's baddbmm, softmax and bmm. backplane.native.attention says why and where.
 *
 * Layouts: every operand's last axis contiguous, the rest strided (the heads of one fused Q/K/V
 * product are views of it, the output may be the merged-heads layout): q[b*qb + i*ql + e],
 * k[b*kb + j*ks + e] (K, not K^T), v[b*vb + j*vs + c], out[b*ob + i*ol + c], an additive mask
 * m[b*mb + i*ml + j*ms] or a condition c[...] of bytes (strides 0 where it broadcasts).
 *
 * Semantics as ONNX's ops compute them: a NaN in a row's scores makes the row NaN, a row of -inf
 * (masked throughout by -inf) is NaN, a condition's fill replaces whatever the scores held. e^x
 * is Cephes' expf (within 2 ulp of libm's, 0 below -87.3 where expf is a denormal or 0). The
 * softmax's 1 / sum multiplies the product's rows (not each probability), sums in j's order: a
 * rounding or so from torch's, not bit for bit. GCC's generic vectors, 16 floats with AVX-512, 8
 * without (AVX2, or plain code on other CPUs): one source for every flavour. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#pragma GCC optimize("fp-contract=fast") /* FMAs: a rounding or so from separate ops */

#define BACKPLANE_ATTENTION_VERSION 3
#define ROWS 8 /* query rows a block: ROWS accumulators share each load of K^T or V */
#define NO_DIAGONAL INT64_MAX

#if defined(__AVX512F__)
#define VL 16
#else
#define VL 8
#endif
typedef float vf __attribute__((vector_size(VL * 4), aligned(4)));

int backplane_attention_version(void) { return BACKPLANE_ATTENTION_VERSION; }

/* The flavour built: floats a vector (16 with AVX-512, 8 without). */
int backplane_attention_width(void) { return VL; }

typedef int32_t vi __attribute__((vector_size(VL * 4), aligned(4)));

/* m ? a : b, lane by lane (m a comparison's all-ones or zero lanes) */
static inline vf pick(vi m, vf a, vf b) { return (vf)(((vi)a & m) | ((vi)b & ~m)); }

/* e^x, VL lanes (Cephes' expf: x = n ln 2 + r, a degree-5 polynomial of r, 2^n in the
 * exponent's bits, n rounded by adding and taking away 1.5 * 2^23); 0 below -87.3, NaN for NaN
 * (the polynomial of a NaN r; n taken as 0 so that no NaN is converted to an integer) */
static inline vf vexp(vf x) {
    const vi low = x < -87.3f;
    const vf c = pick(low, (vf){0} - 87.3f, x);
    vf n = (c * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    n = pick(n == n, n, (vf){0});
    vf r = c - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    vf p = (vf){0} + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
    return pick(low, (vf){0}, p * (vf)bits);
}

static inline float exp_a(float x) {
    vf lanes = (vf){0} + x;
    return vexp(lanes)[0];
}

typedef struct {
    int64_t L, S, E, Ev;
    const float *q, *k, *v, *mask;
    int64_t ql, ks, vs, ml, ms, cl, cs, ol;
    const uint8_t *cond;
    int invert;
    int64_t diagonal; /* keys j >= i + diagonal are masked (the fill); NO_DIAGONAL: none */
    float fill, alpha;
    float *out;
} Head;

/* s[r][0, jend) = alpha q_(i0 + r) . k_j for r < R, from kt (E rows of sp floats: K^T, zero
 * past S): R accumulators share each load of kt */
#define SCORES(R)                                                                              \
    static void scores_##R(const Head *h, int64_t i0, int64_t jend, const float *kt,          \
                           int64_t sp, float *s) {                                             \
        const float *q[R];                                                                     \
        for (int r = 0; r < R; ++r)                                                            \
            q[r] = h->q + (i0 + r) * h->ql;                                                    \
        const int64_t E = h->E;                                                                \
        const float alpha = h->alpha;                                                          \
        for (int64_t j = 0; j < jend; j += VL) {                                               \
            vf acc[R];                                                                         \
            for (int r = 0; r < R; ++r)                                                        \
                acc[r] = (vf){0};                                                              \
            for (int64_t e = 0; e < E; ++e) {                                                  \
                const vf b = *(const vf *)(kt + e * sp + j);                                   \
                for (int r = 0; r < R; ++r)                                                    \
                    acc[r] += q[r][e] * b;                                                     \
            }                                                                                  \
            for (int r = 0; r < R; ++r)                                                        \
                *(vf *)(s + r * sp + j) = acc[r] * alpha;                                      \
        }                                                                                      \
    }
SCORES(8)
SCORES(1)

/* With 16-float vectors, 8 columns left (a head size of 8, 24, 40, ...) in 8-float ones */
#if VL > 8
typedef float v8 __attribute__((vector_size(32), aligned(4)));
#define HALF_VALUES(R)                                                                         \
    if (c + 8 <= Ev) {                                                                         \
        v8 half[R];                                                                            \
        for (int r = 0; r < R; ++r)                                                            \
            half[r] = (v8){0};                                                                 \
        for (int64_t j = 0; j < jend; ++j) {                                                   \
            const v8 b = *(const v8 *)(v + j * vs + c);                                        \
            for (int r = 0; r < R; ++r)                                                        \
                half[r] += s[r * sp + j] * b;                                                  \
        }                                                                                      \
        for (int r = 0; r < R; ++r)                                                            \
            *(v8 *)(h->out + (i0 + r) * h->ol + c) = half[r] * inverse[r];                     \
        c += 8;                                                                                \
    }
#else
#define HALF_VALUES(R)
#endif

/* out_(i0 + r) = inverse[r] * sum_(j < jend) s[r][j] v_j for r < R */
#define VALUES(R)                                                                              \
    static void values_##R(const Head *h, int64_t i0, int64_t jend, const float *s,           \
                           int64_t sp, const float *inverse) {                                 \
        const float *v = h->v;                                                                 \
        const int64_t vs = h->vs, Ev = h->Ev;                                                  \
        int64_t c = 0;                                                                         \
        for (; c + VL <= Ev; c += VL) {                                                        \
            vf acc[R];                                                                         \
            for (int r = 0; r < R; ++r)                                                        \
                acc[r] = (vf){0};                                                              \
            for (int64_t j = 0; j < jend; ++j) {                                               \
                const vf b = *(const vf *)(v + j * vs + c);                                    \
                for (int r = 0; r < R; ++r)                                                    \
                    acc[r] += s[r * sp + j] * b;                                               \
            }                                                                                  \
            for (int r = 0; r < R; ++r)                                                        \
                *(vf *)(h->out + (i0 + r) * h->ol + c) = acc[r] * inverse[r];                  \
        }                                                                                      \
        HALF_VALUES(R)                                                                         \
        for (; c < Ev; ++c)                                                                    \
            for (int r = 0; r < R; ++r) {                                                      \
                float acc = 0.0f;                                                              \
                for (int64_t j = 0; j < jend; ++j)                                             \
                    acc += s[r * sp + j] * v[j * vs + c];                                      \
                h->out[(i0 + r) * h->ol + c] = acc * inverse[r];                               \
            }                                                                                  \
    }
VALUES(8)
VALUES(1)

/* Row i's scores s[0, S) masked, made e^(x - max) in place (s has room for whole vectors);
 * returns 1 / their sum. Under a diagonal only the keys before it are computed: the rest are
 * the fill, e^(fill - max) each. *zero: whether that is 0 (the masked keys add nothing to the
 * product) */
static float softmax_row(const Head *h, int64_t i, float *s, int *zero) {
    const int64_t S = h->S;
    int64_t n = S;  /* the keys before the diagonal */
    if (h->diagonal != NO_DIAGONAL) {
        n = i + h->diagonal < 0 ? 0 : i + h->diagonal;
        n = n < S ? n : S;
    } else if (h->mask) {
        const float *m = h->mask + i * h->ml;
        int64_t j = 0;
        if (h->ms == 1)
            for (; j + VL <= S; j += VL)
                *(vf *)(s + j) += *(const vf *)(m + j);
        for (; j < S; ++j)
            s[j] += m[j * h->ms];
    } else if (h->cond) {
        const uint8_t *c = h->cond + i * h->cl;
        for (int64_t j = 0; j < S; ++j)
            s[j] = (c[j * h->cs] != 0) != h->invert ? h->fill : s[j];
    }
    const int64_t whole = n / VL * VL;
    float most = n < S ? h->fill : s[0];
    vf top = (vf){0} + (n ? s[0] : most);
    int64_t j = 0;
    for (; j < whole; j += VL) {
        const vf x = *(const vf *)(s + j);
        top = pick(x > top, x, top);
    }
    for (int l = 0; l < VL; ++l)
        most = top[l] > most ? top[l] : most;
    for (; j < n; ++j)
        most = s[j] > most ? s[j] : most;
    vf sum = (vf){0};
    for (j = 0; j < whole; j += VL) {
        const vf e = vexp(*(const vf *)(s + j) - most);
        *(vf *)(s + j) = e;
        sum += e;
    }
    float total = 0.0f;
    for (int l = 0; l < VL; ++l)
        total += sum[l];
    for (; j < n; ++j) {
        s[j] = exp_a(s[j] - most);
        total += s[j];
    }
    const float masked = exp_a(h->fill - most);
    for (j = n; j < S; ++j)
        s[j] = masked;
    total += (float)(S - n) * masked;
    *zero = masked == 0.0f;
    return 1.0f / total;
}

/* Whether V holds no NaN and no infinity (0 times each is NaN) */
static int finite_values(const Head *h) {
    vf lanes = (vf){0};
    float rest = 0.0f;
    for (int64_t j = 0; j < h->S; ++j) {
        const float *v = h->v + j * h->vs;
        int64_t c = 0;
        for (; c + VL <= h->Ev; c += VL)
            lanes += *(const vf *)(v + c) * 0.0f;
        for (; c < h->Ev; ++c)
            rest += v[c] * 0.0f;
    }
    for (int l = 0; l < VL; ++l)
        rest += lanes[l];
    return rest == 0.0f;
}

/* Query rows [i0, i1) of one batch-head: the keys they may attend transposed into kt (E rows of
 * sp), then blocks of ROWS rows, the rest one by one */
static void rows_of(const Head *h, int64_t i0, int64_t i1, float *kt, int64_t sp, float *s) {
    int64_t keys = h->S;  /* the keys any row may attend */
    if (h->diagonal != NO_DIAGONAL) {
        const int64_t last = i1 - 1 + h->diagonal;
        keys = last < 0 ? 0 : (last < h->S ? last : h->S);
    }
    const int64_t kp = (keys + VL - 1) / VL * VL;
    for (int64_t e = 0; e < h->E; ++e) {
        for (int64_t j = 0; j < keys; ++j)
            kt[e * sp + j] = h->k[j * h->ks + e];
        for (int64_t j = keys; j < kp; ++j)
            kt[e * sp + j] = 0.0f;
    }
    /* the masked keys weigh e^(fill - max): skipped where that is 0 for every row of a block
       and V finite (0 times a NaN or infinity of V is NaN, as the whole product gives) */
    const int finite = h->diagonal != NO_DIAGONAL && finite_values(h);
    while (i0 < i1) {
        const int rows = i1 - i0 < ROWS ? 1 : ROWS;
        int64_t jend = h->S;
        if (h->diagonal != NO_DIAGONAL) {
            const int64_t last = i0 + rows - 1 + h->diagonal;
            jend = last < 0 ? 0 : (last < h->S ? last : h->S);
        }
        if (rows == ROWS)
            scores_8(h, i0, jend, kt, sp, s);
        else
            scores_1(h, i0, jend, kt, sp, s);
        float inverse[ROWS];
        int zero = 1;
        for (int r = 0; r < rows; ++r) {
            int z;
            inverse[r] = softmax_row(h, i0 + r, s + r * sp, &z);
            zero &= z;
        }
        const int64_t used = zero && finite ? jend : h->S;
        if (rows == ROWS)
            values_8(h, i0, used, s, sp, inverse);
        else
            values_1(h, i0, used, s, sp, inverse);
        i0 += rows;
    }
}

/* The call's arguments (backplane.native.attention's plan): pointers, sizes, strides */
enum { A_Q, A_K, A_V, A_MASK, A_COND, A_OUT, A_B, A_H, A_L, A_S, A_E, A_EV, A_QB, A_QH, A_QL,
       A_KB, A_KH, A_KS, A_VB, A_VH, A_VS, A_MB, A_MH, A_ML, A_MS, A_CB, A_CH, A_CL, A_CS, A_OB,
       A_OH, A_OL, A_INVERT, A_DIAGONAL, A_COUNT };

#define CHUNK 32 /* query rows an item: a call runs its heads x chunks in turn */

static void *at(const int64_t *a, int i) { return (void *)(intptr_t)a[i]; }

/* The attention the plan `a` (A_COUNT values: pointers, sizes, strides; A_DIAGONAL NO_DIAGONAL
 * or keys j >= i + diagonal masked by the fill) and f (fill, alpha) say, on the calling thread
 * (backplane.native.attention says why not on torch's team). 0, or -1 where the work memory was
 * not had. */
int backplane_attention(const int64_t *a, const float *f) {
    const int64_t H = a[A_H], L = a[A_L], S = a[A_S], E = a[A_E];
    const int64_t chunks = (L + CHUNK - 1) / CHUNK, items = a[A_B] * H * chunks;
    const int64_t sp = (S + VL - 1) / VL * VL;
    const float *mask = at(a, A_MASK);
    const uint8_t *cond = at(a, A_COND);
    float *work = malloc(sizeof(float) * (size_t)(sp * (E + ROWS)));
    if (!work)
        return -1;
    for (int64_t item = 0; item < items; ++item) {
        const int64_t bh = item / chunks, b = bh / H, hh = bh % H, i0 = item % chunks * CHUNK;
        Head h = {L, S, E, a[A_EV],
                  (const float *)at(a, A_Q) + b * a[A_QB] + hh * a[A_QH],
                  (const float *)at(a, A_K) + b * a[A_KB] + hh * a[A_KH],
                  (const float *)at(a, A_V) + b * a[A_VB] + hh * a[A_VH],
                  mask ? mask + b * a[A_MB] + hh * a[A_MH] : NULL,
                  a[A_QL], a[A_KS], a[A_VS], a[A_ML], a[A_MS], a[A_CL], a[A_CS], a[A_OL],
                  cond ? cond + b * a[A_CB] + hh * a[A_CH] : NULL, (int)a[A_INVERT],
                  a[A_DIAGONAL], f[0], f[1],
                  (float *)at(a, A_OUT) + b * a[A_OB] + hh * a[A_OH]};
        rows_of(&h, i0, i0 + CHUNK < L ? i0 + CHUNK : L, work, sp, work + sp * E);
    }
    free(work);
    return 0;
}

int backplane_attention_arguments(void) { return A_COUNT; }

#include "attention_op.h"
