/* The smallest native library: what the build's tests compile, load and call. */
#include <math.h>
#include <stddef.h>

/* out[i] = max(x[i], 0), NaN kept (a comparison with NaN is false, so NaN takes x). */
void backplane_relu(const float *x, float *out, ptrdiff_t n) {
    for (ptrdiff_t i = 0; i < n; ++i)
        out[i] = x[i] < 0.0f ? 0.0f : x[i];
}

int backplane_native_version(void) { return 1; }
