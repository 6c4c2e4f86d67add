/* A float32 product y = x w^T + bias for the Linear layers of CpuAcc's traces (transformers'
 * projections), over a weight packed once at load in panels of 16 columns (each K rows of 16
 * floats), read by panel_product.h's register tile (12 rows by 32 outputs with AVX-512, 6 by 16
 * with AVX2). backplane.native.linear says why: at a transformer's sizes (8-64 rows) torch's MKL
 * and oneDNN products run well below this machine's rate, and the smallest ones pay several
 * microseconds around a few of work. */
#include "panel_product.h"

#define BACKPLANE_LINEAR_VERSION 1

int backplane_linear_version(void) { return BACKPLANE_LINEAR_VERSION; }

/* The flavour built: the tile's rows (12: AVX-512, 6: AVX2 or generic vectors). */
int backplane_linear_rows(void) { return PANEL_ROWS; }

/* w (n, k) row-major -> ceil(n / 16) panels of k rows of 16 floats, zero past column n */
void backplane_linear_pack(const float *w, long n, long k, float *out) {
    for (long p = 0; p * PANEL < n; p++)
        for (long kk = 0; kk < k; kk++)
            for (int j = 0; j < PANEL; j++) {
                long c = p * PANEL + j;
                out[(p * k + kk) * PANEL + j] = c < n ? w[c * k + kk] : 0.0f;
            }
}

/* y (m, n) = x (m, k) row-major times the packed weight, plus bias (NULL, or padded to whole
 * panels) */
void backplane_linear(const float *x, long m, long k, const float *packed, long n,
                      const float *bias, float *y) {
    panel_product(m, k, n, x, k, packed, bias, y, n);
}
