/* An ONNX Loop whose body is small float32 layers, every iteration in one call
 * (backplane/backends/builtin/native_loop.py plans it).
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

int64_t backplane_loop_version(void) { return 1; }

enum {
    OP_COPY = 1,      /* out[0:n0] = a[0:n0] */
    OP_GATHER_I,      /* out[o, j] = a[o, i, j]: n0 outer, n1 the axis' length, n2 inner */
    OP_APPEND_I,      /* out[i * n0 : (i + 1) * n0] = a[0:n0] (a scan or sequence element) */
    OP_GEMM,          /* out (M=n0, N=n2) = alpha * A (M, K=n1) B (K, N) + beta * C */
    OP_ADD, OP_SUB, OP_MUL, OP_DIV, /* out[k] = a[k % na] op b[k % nb], k < n0; na = n1, nb = n2 */
    OP_TANH, OP_SIGMOID, OP_RELU, OP_ABS, OP_NEG, /* out[k] = f(a[k]), k < n0 */
};

/* GEMM's layout flags, in params[2 * r + 0 / 1] alpha, beta and the record's c field: the bias
 * record (-1: none); the flags in the high bits of the op: transA << 8, transB << 9, and the bias
 * as a row (N values, 1 << 10), a column (M values, 1 << 11), a scalar (1 << 12) or whole
 * (M x N). */
static void gemm(const int64_t *r, const double *p, float **ptrs) {
    int64_t M = r[5], K = r[6], N = r[7], op = r[0];
    int ta = (op >> 8) & 1, tb = (op >> 9) & 1;
    const float *A = ptrs[r[2]], *B = ptrs[r[3]], *C = r[4] >= 0 ? ptrs[r[4]] : 0;
    float alpha = (float)p[0], beta = (float)p[1];
    float *out = ptrs[r[1]];
    for (int64_t m = 0; m < M; ++m) {
        for (int64_t n = 0; n < N; ++n) {
            float sum = 0.0f;
            for (int64_t k = 0; k < K; ++k) {
                float x = ta ? A[k * M + m] : A[m * K + k];
                float w = tb ? B[n * K + k] : B[k * N + n];
                sum += x * w;
            }
            if (alpha != 1.0f) sum *= alpha;
            if (C) {
                float bias = (op >> 10) & 1 ? C[n] : (op >> 11) & 1 ? C[m]
                           : (op >> 12) & 1 ? C[0] : C[m * N + n];
                sum += beta != 1.0f ? beta * bias : bias;
            }
            out[m * N + n] = sum;
        }
    }
}

static void run(const int64_t *records, int64_t count, const double *params, float **ptrs,
                int64_t i) {
    for (int64_t k = 0; k < count; ++k) {
        const int64_t *r = records + 8 * k;
        float *out = ptrs[r[1]];
        const float *a = r[2] >= 0 ? ptrs[r[2]] : 0, *b = r[3] >= 0 ? ptrs[r[3]] : 0;
        int64_t n0 = r[5], n1 = r[6], n2 = r[7];
        switch (r[0] & 0xff) {
        case OP_COPY: memcpy(out, a, sizeof(float) * (size_t)n0); break;
        case OP_GATHER_I:
            for (int64_t o = 0; o < n0; ++o)
                memcpy(out + o * n2, a + (o * n1 + i) * n2, sizeof(float) * (size_t)n2);
            break;
        case OP_APPEND_I: memcpy(out + i * n0, a, sizeof(float) * (size_t)n0); break;
        case OP_GEMM: gemm(r, params + 2 * k, ptrs); break;
        case OP_ADD: for (int64_t j = 0; j < n0; ++j) out[j] = a[j % n1] + b[j % n2]; break;
        case OP_SUB: for (int64_t j = 0; j < n0; ++j) out[j] = a[j % n1] - b[j % n2]; break;
        case OP_MUL: for (int64_t j = 0; j < n0; ++j) out[j] = a[j % n1] * b[j % n2]; break;
        case OP_DIV: for (int64_t j = 0; j < n0; ++j) out[j] = a[j % n1] / b[j % n2]; break;
        case OP_TANH: for (int64_t j = 0; j < n0; ++j) out[j] = tanhf(a[j]); break;
        case OP_SIGMOID: /* CpuRef's: 1 / (1 + exp(-x)) */
            for (int64_t j = 0; j < n0; ++j) out[j] = 1.0f / (expf(-a[j]) + 1.0f);
            break;
        case OP_RELU: /* np.maximum(x, 0): NaN stays */
            for (int64_t j = 0; j < n0; ++j) out[j] = a[j] < 0.0f ? 0.0f : a[j];
            break;
        case OP_ABS: for (int64_t j = 0; j < n0; ++j) out[j] = fabsf(a[j]); break;
        case OP_NEG: for (int64_t j = 0; j < n0; ++j) out[j] = -a[j]; break;
        }
    }
}

/* `pre` once, then `body` for i in [0, trips); returns the iterations run. */
int64_t backplane_loop(const int64_t *pre, int64_t n_pre, const int64_t *body, int64_t n_body,
                       const double *params, int64_t *ptrs, int64_t trips) {
    float **table = (float **)ptrs;
    run(pre, n_pre, params, table, 0);
    for (int64_t i = 0; i < trips; ++i) run(body, n_body, params + 2 * n_pre, table, i);
    return trips;
}
