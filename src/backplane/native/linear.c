/* A float32 product y = x w^T + bias for the Linear layers of CpuAcc's traces (transformers'
 * projections), over a weight packed once at load: panels of NR columns, each K rows of NR
 * floats, read by a 6 x 16 register block (12 AVX2 accumulators, FMAs). backplane.native.linear
 * says why: at a transformer's sizes (8-64 rows) torch's MKL and oneDNN products run well below
 * this machine's rate, and the smallest ones pay several microseconds around a few of work. */
#include <string.h>

#define BACKPLANE_LINEAR_VERSION 1
#define NR 16 /* a panel's columns: two AVX2 vectors */

typedef float v8 __attribute__((vector_size(32))); /* GCC's and Clang's vectors */

static inline v8 load8(const float *p) {
    v8 v;
    __builtin_memcpy(&v, p, sizeof v);
    return v;
}

static inline void store8(float *p, v8 v) { __builtin_memcpy(p, &v, sizeof v); }

int backplane_linear_version(void) { return BACKPLANE_LINEAR_VERSION; }

/* w (n, k) row-major -> ceil(n / NR) panels of k rows of NR floats, zero past column n */
void backplane_linear_pack(const float *w, long n, long k, float *out) {
    for (long p = 0; p * NR < n; p++)
        for (long kk = 0; kk < k; kk++)
            for (int j = 0; j < NR; j++) {
                long c = p * NR + j;
                out[(p * k + kk) * NR + j] = c < n ? w[c * k + kk] : 0.0f;
            }
}

/* R rows of x by one panel; `width` of its NR columns stored, the bias (whole panels) added */
#define KERNEL(R)                                                                              \
    static __attribute__((optimize("fp-contract=fast"))) void kernel##R(                      \
        const float *x, long k, const float *panel, const float *bias, float *y, long ldy,     \
        long width) {                                                                          \
        v8 c0[R], c1[R];                                                                       \
        for (int r = 0; r < R; r++) {                                                          \
            c0[r] = (v8){0};                                                                   \
            c1[r] = (v8){0};                                                                   \
        }                                                                                      \
        for (long kk = 0; kk < k; kk++) {                                                      \
            v8 b0 = load8(panel + kk * NR), b1 = load8(panel + kk * NR + 8);                   \
            for (int r = 0; r < R; r++) {                                                      \
                float s = x[r * k + kk];                                                       \
                c0[r] += s * b0;                                                               \
                c1[r] += s * b1;                                                               \
            }                                                                                  \
        }                                                                                      \
        v8 d0 = {0}, d1 = {0};                                                                 \
        if (bias) {                                                                            \
            d0 = load8(bias);                                                                  \
            d1 = load8(bias + 8);                                                              \
        }                                                                                      \
        for (int r = 0; r < R; r++) {                                                          \
            if (width == NR) {                                                                 \
                store8(y + r * ldy, c0[r] + d0);                                               \
                store8(y + r * ldy + 8, c1[r] + d1);                                           \
            } else {                                                                           \
                float t[NR];                                                                   \
                store8(t, c0[r] + d0);                                                         \
                store8(t + 8, c1[r] + d1);                                                     \
                memcpy(y + r * ldy, t, sizeof(float) * width);                                 \
            }                                                                                  \
        }                                                                                      \
    }
KERNEL(1)
KERNEL(2)
KERNEL(3)
KERNEL(4)
KERNEL(5)
KERNEL(6)

/* y (m, n) = x (m, k) row-major times the packed weight, plus bias (NULL, or padded to whole
 * panels) */
void backplane_linear(const float *x, long m, long k, const float *packed, long n,
                      const float *bias, float *y) {
    for (long p = 0; p * NR < n; p++) {
        const float *panel = packed + p * k * NR, *b = bias ? bias + p * NR : NULL;
        long width = n - p * NR < NR ? n - p * NR : NR, r = 0;
        float *yp = y + p * NR;
        for (; r + 6 <= m; r += 6)
            kernel6(x + r * k, k, panel, b, yp + r * n, n, width);
        switch (m - r) {
        case 5: kernel5(x + r * k, k, panel, b, yp + r * n, n, width); break;
        case 4: kernel4(x + r * k, k, panel, b, yp + r * n, n, width); break;
        case 3: kernel3(x + r * k, k, panel, b, yp + r * n, n, width); break;
        case 2: kernel2(x + r * k, k, panel, b, yp + r * n, n, width); break;
        case 1: kernel1(x + r * k, k, panel, b, yp + r * n, n, width); break;
        }
    }
}
