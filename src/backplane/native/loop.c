/* An ONNX Loop whose body is small float32 layers, every iteration in one call
 * (backplane/backends/builtin/native_loop.py plans it); and a whole network of such layers and
 * Ifs, run once (`backplane_net`: backplane/backends/builtin/native_net.py plans it).
 *
 * Why: a body of Gemms and elementwise layers on a few dozen values costs its NumPy calls (1-3 us
 * each, a scripted RNN's body 7 a step), where the arithmetic is nanoseconds. The plan is records
 * of eight int64 each over a table of buffer addresses (`ptrs`: the body's constants, the values
 * it reads from outside, its own values in one arena); `params` holds each record's floats.
 *
 * Records: op, out, a, b, c, n0, n1, n2 (sizes as the op reads them). `pre` runs once (the carried
 * values' first copies), `body` once an iteration with the iteration number `i`. The arithmetic is
 * CpuRef's in float32, each operation rounded on its own (-std=c11: no FMA contraction); a Gemm
 * sums over k in order, where BLAS sums in blocks: the same values to rounding. */
#include <math.h>
#include <stdint.h>
#include <string.h>

int64_t backplane_loop_version(void) { return 4; }

enum {
    OP_COPY = 1,      /* out[0:n0] = a[0:n0], n0 bytes */
    OP_GATHER_I,      /* out[o, j] = a[o, i, j]: n0 outer, n1 the axis' length, n2 inner bytes */
    OP_APPEND_I,      /* out[i * n0 : (i + 1) * n0] = a[0:n0], bytes (a scan or sequence row) */
    OP_GEMM,          /* out (M=n0, N=n2) = alpha * A (M, K=n1) B (K, N) + beta * C */
    OP_ADD, OP_SUB, OP_MUL, OP_DIV, /* float32: out[k] = a[k % na] op b[k % nb], k < n0;
                                       na = n1, nb = n2 */
    OP_TANH, OP_SIGMOID, OP_RELU, OP_ABS, OP_NEG, /* float32: out[k] = f(a[k]), k < n0 */
    OP_ADD_I, OP_SUB_I, OP_MUL_I,  /* int64, broadcast as the float32 ones */
    OP_GT, OP_LT, OP_EQ,           /* float32 -> bool (one byte), broadcast as above */
    OP_GT_I, OP_LT_I, OP_EQ_I,     /* int64 -> bool */
    OP_MAX_ALL,       /* float32: out[0] = the largest of a[0:n0], NaN where one is */
    OP_GATHER_C,      /* OP_GATHER_I at the int64 index in buffer c (negative: from the end;
                         out of range: the call fails, -1) */
    OP_IF,            /* the records [n0, n0 + n1) where the bool a is true, else [n2, n2 + c) */
    OP_SUM_ALL,       /* float32: out[0] = the sum of a[0:n0], NumPy's pairwise order */
    OP_MEAN_ALL,      /* float32: out[0] = that sum / n0 */
};

/* np.add.reduce's float32 sum of a contiguous run (NumPy's pairwise_sum, accumulated in float32):
 * under 8 values in order; up to 128 in eight running sums, paired, then the rest in order; past
 * that the two halves (the first a multiple of 8) summed so and added. The same order gives
 * CpuRef's sum bit for bit, so a predicate read from a mean takes CpuRef's branch. */
static float pairwise_sum(const float *a, int64_t n) {
    if (n < 8) {
        float res = 0.0f;
        for (int64_t i = 0; i < n; ++i) res += a[i];
        return res;
    }
    if (n <= 128) {
        float r[8];
        int64_t i;
        for (int j = 0; j < 8; ++j) r[j] = a[j];
        for (i = 8; i < n - (n % 8); i += 8)
            for (int j = 0; j < 8; ++j) r[j] += a[i + j];
        float res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
        for (; i < n; ++i) res += a[i];
        return res;
    }
    int64_t n2 = n / 2;
    n2 -= n2 % 8;
    return pairwise_sum(a, n2) + pairwise_sum(a + n2, n - n2);
}

/* GEMM's layout flags, in params[2 * r + 0 / 1] alpha, beta and the record's c field: the bias
 * record (-1: none); the flags in the high bits of the op: transA << 8, transB << 9, and the bias
 * as a row (N values, 1 << 10), a column (M values, 1 << 11), a scalar (1 << 12) or whole
 * (M x N). */
static void gemm(const int64_t *r, const double *p, void **ptrs) {
    int64_t M = r[5], K = r[6], N = r[7], op = r[0];
    int ta = (op >> 8) & 1, tb = (op >> 9) & 1;
    const float *A = ptrs[r[2]], *B = ptrs[r[3]];
    const float *C = r[4] >= 0 ? (const float *)ptrs[r[4]] : 0;
    float alpha = (float)p[0], beta = (float)p[1];
    float *out = ptrs[r[1]];
    /* each output's sum over k in order, as before, but a row of them at a time (k outer, n
     * inner: the n loop vectorizes without reordering any one sum) where B is not transposed
     * (the plan transposes a constant B once) */
    for (int64_t m = 0; m < M; ++m) {
        float *row = out + m * N;
        for (int64_t n = 0; n < N; ++n) row[n] = 0.0f;
        for (int64_t k = 0; k < K; ++k) {
            float x = ta ? A[k * M + m] : A[m * K + k];
            if (tb) {
                for (int64_t n = 0; n < N; ++n) row[n] += x * B[n * K + k];
            } else {
                const float *b = B + k * N;
                for (int64_t n = 0; n < N; ++n) row[n] += x * b[n];
            }
        }
        for (int64_t n = 0; n < N; ++n) {
            float sum = row[n];
            if (alpha != 1.0f) sum *= alpha;
            if (C) {
                float bias = (op >> 10) & 1 ? C[n] : (op >> 11) & 1 ? C[m]
                           : (op >> 12) & 1 ? C[0] : C[m * N + n];
                sum += beta != 1.0f ? beta * bias : bias;
            }
            row[n] = sum;
        }
    }
}

/* out[j] = expr(u = a[j % n1], v = b[j % n2]): where one side is whole (n0 values) and the other
 * repeats (n0 a multiple of its size: a scalar, a row) in rows of that size with no division per
 * value (the loops vectorize); the modulo for any other. */
#define BROADCAST(T, U, expr)                                              \
    do {                                                                   \
        const T *x = a, *y = b;                                            \
        U *o = out;                                                        \
        if (n1 == n0 && n2 > 0 && n0 % n2 == 0) {                          \
            for (int64_t s = 0; s < n0; s += n2)                           \
                for (int64_t c = 0; c < n2; ++c) {                         \
                    T u = x[s + c], v = y[c];                              \
                    o[s + c] = (expr);                                     \
                }                                                          \
        } else if (n2 == n0 && n1 > 0 && n0 % n1 == 0) {                   \
            for (int64_t s = 0; s < n0; s += n1)                           \
                for (int64_t c = 0; c < n1; ++c) {                         \
                    T u = x[c], v = y[s + c];                              \
                    o[s + c] = (expr);                                     \
                }                                                          \
        } else {                                                           \
            for (int64_t j = 0; j < n0; ++j) {                             \
                T u = x[j % n1], v = y[j % n2];                            \
                o[j] = (expr);                                             \
            }                                                              \
        }                                                                  \
    } while (0)

static int run(const int64_t *records, const double *params, int64_t start, int64_t count,
               void **ptrs, int64_t i) {
    for (int64_t k = start; k < start + count; ++k) {
        const int64_t *r = records + 8 * k;
        void *out = ptrs[r[1]];
        const void *a = r[2] >= 0 ? ptrs[r[2]] : 0, *b = r[3] >= 0 ? ptrs[r[3]] : 0;
        const float *fa = a;
        float *fo = out;
        int64_t n0 = r[5], n1 = r[6], n2 = r[7];
        switch (r[0] & 0xff) {
        case OP_COPY: memcpy(out, a, (size_t)n0); break;
        case OP_GATHER_I:
        case OP_GATHER_C: {
            int64_t at = i;
            if ((r[0] & 0xff) == OP_GATHER_C) {
                at = *(const int64_t *)ptrs[r[4]];
                if (at < 0) at += n1;
                if (at < 0 || at >= n1) return 1;
            }
            for (int64_t o = 0; o < n0; ++o)
                memcpy((char *)out + o * n2, (const char *)a + (o * n1 + at) * n2, (size_t)n2);
            break;
        }
        case OP_APPEND_I: memcpy((char *)out + i * n0, a, (size_t)n0); break;
        case OP_GEMM: gemm(r, params + 2 * k, ptrs); break;
        case OP_ADD: BROADCAST(float, float, u + v); break;
        case OP_SUB: BROADCAST(float, float, u - v); break;
        case OP_MUL: BROADCAST(float, float, u * v); break;
        case OP_DIV: BROADCAST(float, float, u / v); break;
        case OP_ADD_I: BROADCAST(int64_t, int64_t, (int64_t)((uint64_t)u + (uint64_t)v)); break;
        case OP_SUB_I: BROADCAST(int64_t, int64_t, (int64_t)((uint64_t)u - (uint64_t)v)); break;
        case OP_MUL_I: BROADCAST(int64_t, int64_t, (int64_t)((uint64_t)u * (uint64_t)v)); break;
        case OP_GT: BROADCAST(float, uint8_t, u > v); break;
        case OP_LT: BROADCAST(float, uint8_t, u < v); break;
        case OP_EQ: BROADCAST(float, uint8_t, u == v); break;
        case OP_GT_I: BROADCAST(int64_t, uint8_t, u > v); break;
        case OP_LT_I: BROADCAST(int64_t, uint8_t, u < v); break;
        case OP_EQ_I: BROADCAST(int64_t, uint8_t, u == v); break;
        case OP_TANH: for (int64_t j = 0; j < n0; ++j) fo[j] = tanhf(fa[j]); break;
        case OP_SIGMOID: /* CpuRef's: 1 / (1 + exp(-x)) */
            for (int64_t j = 0; j < n0; ++j) fo[j] = 1.0f / (expf(-fa[j]) + 1.0f);
            break;
        case OP_RELU: /* np.maximum(x, 0): NaN stays */
            for (int64_t j = 0; j < n0; ++j) fo[j] = fa[j] < 0.0f ? 0.0f : fa[j];
            break;
        case OP_ABS: for (int64_t j = 0; j < n0; ++j) fo[j] = fabsf(fa[j]); break;
        case OP_NEG: for (int64_t j = 0; j < n0; ++j) fo[j] = -fa[j]; break;
        case OP_MAX_ALL: { /* np.maximum.reduce: a NaN wins */
            float best = fa[0];
            for (int64_t j = 1; j < n0 && best == best; ++j)
                if (fa[j] > best || fa[j] != fa[j]) best = fa[j];
            fo[0] = best;
            break;
        }
        case OP_SUM_ALL: fo[0] = 0.0f + pairwise_sum(fa, n0); break; /* the reduction's 0 first */
        case OP_MEAN_ALL: fo[0] = (0.0f + pairwise_sum(fa, n0)) / (float)n0; break;
        case OP_IF:
            if (*(const uint8_t *)a ? run(records, params, n0, n1, ptrs, i)
                                    : run(records, params, n2, r[4], ptrs, i))
                return 1;
            break;
        }
    }
    return 0;
}

/* Records [0, n_pre) once, then [body, body + n_body) for i in [0, trips) while the bool buffer
 * `cond` (-1: none) is true after an iteration; returns the iterations run, or -1 where a Gather's
 * index was out of range (the caller runs the body's kernels, which say so). */
int64_t backplane_loop(const int64_t *records, const double *params, int64_t n_pre, int64_t body,
                       int64_t n_body, int64_t *ptrs, int64_t trips, int64_t cond) {
    void **table = (void **)ptrs;
    if (run(records, params, 0, n_pre, table, 0)) return -1;
    for (int64_t i = 0; i < trips; ++i) {
        if (run(records, params, body, n_body, table, i)) return -1;
        if (cond >= 0 && !*(const uint8_t *)table[cond]) return i + 1;
    }
    return trips;
}

/* A network's records run once (`backplane_net`, planned by native_net.py): `call` holds the
 * records' and the params' addresses, the records' count, then the table of buffer addresses,
 * the call's inputs and outputs among them (written by the caller). Returns 0, or -1 where a
 * Gather's index was out of range (the caller runs the kernels, which say so). */
int64_t backplane_net(int64_t *call) {
    const int64_t *records = (const int64_t *)(intptr_t)call[0];
    const double *params = (const double *)(intptr_t)call[1];
    return run(records, params, 0, call[2], (void **)(call + 3), 0) ? -1 : 0;
}
