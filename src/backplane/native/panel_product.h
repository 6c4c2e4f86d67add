/* y = bias + x W^T for M rows over a weight packed in panels of 16 outputs (each panel its K rows
 * of 16 contiguous floats, the last panel padded with zeros, as the bias is): the register-tiled
 * product of linear.c (a Linear in a CpuAcc trace) and recurrent_net.h (a recurrent net's heads
 * and input projections), one copy. Why a tile: a block of rows shares each load of a panel row
 * and a broadcast of x shares its panels, so the sums stay in registers while k runs (the FMAs,
 * not the loads, bound it); panels outside, rows inside: a panel stays in L1 over every row where
 * a large W would be streamed from L3 again for each block of rows.
 *
 * Two flavours, one layout. With AVX-512 (32 registers of 16 floats) a tile is 12 rows by two
 * panels (24 accumulators), 1 of them where one panel is left: 32 multiply-adds an instruction
 * pair, twice AVX2's. Without it, 6 rows by one panel as two 8-float vectors (12 of 16 AVX2
 * registers; GCC's generic vectors, so other CPUs build it too). Same layout, so the packing
 * (linear.py's pack, recurrent_net.py's panels) does not depend on the CPU; sums are taken in k's
 * order in both (float32 results a rounding or so from torch's, not bit for bit).
 *
 * x's rows are xs floats apart (contiguous inside), y's ldy. The bias may be NULL. A tile narrower
 * than its panels (the last, padded ones) is stored through a row on the stack. */
#ifndef BACKPLANE_PANEL_PRODUCT_H
#define BACKPLANE_PANEL_PRODUCT_H

#include <stdint.h>
#include <string.h>

#define PANEL 16 /* a panel's outputs */

typedef float pp_v8 __attribute__((vector_size(32), aligned(4)));

#if defined(__AVX512F__)
#define PANEL_ROWS 12 /* the AVX-512 tile's rows */
typedef float pp_v16 __attribute__((vector_size(64), aligned(4)));

/* R rows (R <= 12) by P panels (1 or 2) of ``width`` outputs (<= P * 16) */
#define PANEL_KERNEL(R, P)                                                                     \
    static __attribute__((optimize("fp-contract=fast"))) void pp_kernel_##R##_##P(           \
        int64_t K, const float *x, int64_t xs, const float *panel, const float *bias,        \
        float *y, int64_t ldy, int64_t width) {                                              \
        pp_v16 c[R][P], d[P];                                                                \
        for (int p = 0; p < P; ++p)                                                          \
            d[p] = bias ? *(const pp_v16 *)(bias + 16 * p) : (pp_v16){0};                    \
        for (int r = 0; r < R; ++r)                                                          \
            for (int p = 0; p < P; ++p)                                                      \
                c[r][p] = d[p];                                                              \
        const float *w1 = panel + K * 16 * (P - 1);                                          \
        for (int64_t k = 0; k < K; ++k) {                                                    \
            pp_v16 b0 = *(const pp_v16 *)(panel + k * 16), b1 = *(const pp_v16 *)(w1 + k * 16); \
            for (int r = 0; r < R; ++r) {                                                    \
                float s = x[r * xs + k];                                                     \
                c[r][0] += s * b0;                                                           \
                if (P == 2)                                                                  \
                    c[r][P - 1] += s * b1;                                                   \
            }                                                                                \
        }                                                                                    \
        for (int r = 0; r < R; ++r) {                                                        \
            if (width == 16 * P) {                                                           \
                for (int p = 0; p < P; ++p)                                                  \
                    *(pp_v16 *)(y + r * ldy + 16 * p) = c[r][p];                             \
            } else {                                                                         \
                float t[32];                                                                 \
                for (int p = 0; p < P; ++p)                                                  \
                    *(pp_v16 *)(t + 16 * p) = c[r][p];                                       \
                memcpy(y + r * ldy, t, sizeof(float) * (size_t)width);                       \
            }                                                                                \
        }                                                                                    \
    }
#define PANEL_KERNELS(R) PANEL_KERNEL(R, 1) PANEL_KERNEL(R, 2)
PANEL_KERNELS(1)
PANEL_KERNELS(2)
PANEL_KERNELS(3)
PANEL_KERNELS(4)
PANEL_KERNELS(5)
PANEL_KERNELS(6)
PANEL_KERNELS(7)
PANEL_KERNELS(8)
PANEL_KERNELS(9)
PANEL_KERNELS(10)
PANEL_KERNELS(11)
PANEL_KERNELS(12)

typedef void (*pp_kernel)(int64_t, const float *, int64_t, const float *, const float *, float *,
                          int64_t, int64_t);
static const pp_kernel pp_kernels[PANEL_ROWS + 1][2] = {
    {0, 0},
    {pp_kernel_1_1, pp_kernel_1_2},   {pp_kernel_2_1, pp_kernel_2_2},
    {pp_kernel_3_1, pp_kernel_3_2},   {pp_kernel_4_1, pp_kernel_4_2},
    {pp_kernel_5_1, pp_kernel_5_2},   {pp_kernel_6_1, pp_kernel_6_2},
    {pp_kernel_7_1, pp_kernel_7_2},   {pp_kernel_8_1, pp_kernel_8_2},
    {pp_kernel_9_1, pp_kernel_9_2},   {pp_kernel_10_1, pp_kernel_10_2},
    {pp_kernel_11_1, pp_kernel_11_2}, {pp_kernel_12_1, pp_kernel_12_2}};

static void panel_product(int64_t M, int64_t K, int64_t N, const float *x, int64_t xs,
                          const float *panels, const float *bias, float *y, int64_t ldy) {
    for (int64_t n = 0; n < N; n += 32) {
        const float *panel = panels + (n / 16) * K * 16, *b = bias ? bias + n : NULL;
        int64_t width = N - n < 32 ? N - n : 32, two = width > 16;
        for (int64_t m = 0; m < M; m += PANEL_ROWS) {
            int64_t rows = M - m < PANEL_ROWS ? M - m : PANEL_ROWS;
            pp_kernels[rows][two](K, x + m * xs, xs, panel, b, y + m * ldy + n, ldy, width);
        }
    }
}

#else /* AVX2, or any other CPU: GCC's generic vectors of 8 floats */
#define PANEL_ROWS 6

#define PANEL_KERNEL(R)                                                                        \
    static __attribute__((optimize("fp-contract=fast"))) void pp_kernel_##R(                 \
        int64_t K, const float *x, int64_t xs, const float *panel, const float *bias,        \
        float *y, int64_t ldy, int64_t width) {                                              \
        pp_v8 c0[R], c1[R], d0 = {0}, d1 = {0};                                              \
        if (bias) {                                                                          \
            d0 = *(const pp_v8 *)bias;                                                       \
            d1 = *(const pp_v8 *)(bias + 8);                                                 \
        }                                                                                    \
        for (int r = 0; r < R; ++r) {                                                        \
            c0[r] = d0;                                                                      \
            c1[r] = d1;                                                                      \
        }                                                                                    \
        for (int64_t k = 0; k < K; ++k) {                                                    \
            pp_v8 b0 = *(const pp_v8 *)(panel + k * 16), b1 = *(const pp_v8 *)(panel + k * 16 + 8); \
            for (int r = 0; r < R; ++r) {                                                    \
                float s = x[r * xs + k];                                                     \
                c0[r] += s * b0;                                                             \
                c1[r] += s * b1;                                                             \
            }                                                                                \
        }                                                                                    \
        for (int r = 0; r < R; ++r) {                                                        \
            if (width == 16) {                                                               \
                *(pp_v8 *)(y + r * ldy) = c0[r];                                             \
                *(pp_v8 *)(y + r * ldy + 8) = c1[r];                                         \
            } else {                                                                         \
                float t[16];                                                                 \
                *(pp_v8 *)t = c0[r];                                                         \
                *(pp_v8 *)(t + 8) = c1[r];                                                   \
                memcpy(y + r * ldy, t, sizeof(float) * (size_t)width);                       \
            }                                                                                \
        }                                                                                    \
    }
PANEL_KERNEL(1)
PANEL_KERNEL(2)
PANEL_KERNEL(3)
PANEL_KERNEL(4)
PANEL_KERNEL(5)
PANEL_KERNEL(6)

typedef void (*pp_kernel)(int64_t, const float *, int64_t, const float *, const float *, float *,
                          int64_t, int64_t);
static const pp_kernel pp_kernels[PANEL_ROWS + 1] = {0, pp_kernel_1, pp_kernel_2, pp_kernel_3,
                                                     pp_kernel_4, pp_kernel_5, pp_kernel_6};

static void panel_product(int64_t M, int64_t K, int64_t N, const float *x, int64_t xs,
                          const float *panels, const float *bias, float *y, int64_t ldy) {
    for (int64_t n = 0; n < N; n += 16) {
        const float *panel = panels + (n / 16) * K * 16, *b = bias ? bias + n : NULL;
        int64_t width = N - n < 16 ? N - n : 16;
        for (int64_t m = 0; m < M; m += PANEL_ROWS) {
            int64_t rows = M - m < PANEL_ROWS ? M - m : PANEL_ROWS;
            pp_kernels[rows](K, x + m * xs, xs, panel, b, y + m * ldy + n, ldy, width);
        }
    }
}
#endif

#endif
