/* A dynamically quantized MatMul (onnxruntime.quantization.quantize_dynamic's
 * DynamicQuantizeLinear -> MatMulInteger -> Cast -> Mul(scales) [-> Add(bias)]) in one call:
 * x's range, scale and zero point as CpuRef computes them, x quantized and centred, its product
 * with the centred weight, the scales and the bias. In torch ops inside a trace this was about 20
 * ops of 1-3 us each, on tensors of a few hundred values (backplane.native.dynquant says more).
 *
 * Exact: the centred x (integers in [-255, 255]) times the centred weight (integers, checked at
 * the fusion: every sum below 2^24) sums in float32 without rounding in any order, so the sums are
 * MatMulInteger's int32 ones; each is then multiplied by x's scale times the weight's (that
 * product rounded to float32 first, as the graph's Mul makes it) and the bias added after (a
 * separate rounding: -std=c11 keeps GCC from contracting the two into one FMA). */
#include <math.h>
#include <stdlib.h>

#define BACKPLANE_DYNQUANT_VERSION 1
#define ROWS 4  /* rows of x a block of the product reads each weight value for */
#define COLS 16 /* columns a block keeps in registers: ROWS * COLS / 8 = 8 AVX2 accumulators */
#define STACK 4096

int backplane_dynquant_version(void) { return BACKPLANE_DYNQUANT_VERSION; }

/* x's scale and zero point: CpuRef's DynamicQuantizeLinear (its Python floats are doubles, the
 * scale rounded once to float32, 0 - low divided in float32, rounded half to even). 1 where the
 * range is not finite (a NaN or an infinity: the caller takes torch's route, CpuRef's cases). */
static int grid(const float *x, long count, float *scale, float *zero) {
    float lowest = 0.0f, highest = 0.0f; /* the range always holds 0 */
    int finite = 1;
    for (long i = 0; i < count; i++) {
        float v = x[i];
        lowest = v < lowest ? v : lowest;
        highest = v > highest ? v : highest;
        finite &= (v - v) == 0.0f; /* NaN and infinities give NaN */
    }
    if (!finite)
        return 1;
    double range = (double)highest - (double)lowest;
    *scale = highest > lowest ? (float)(range / 255.0) : 1.0f;
    float z = rintf((float)(0.0 - (double)lowest) / *scale);
    *zero = z < 0.0f ? 0.0f : (z > 255.0f ? 255.0f : z);
    return 0;
}

/* rows of x quantized on the grid and centred: round(x / scale) within [-zero, 255 - zero] */
static void centre(const float *x, long count, float scale, float zero, float *q) {
    float low = -zero, high = 255.0f - zero;
    for (long i = 0; i < count; i++) {
        float v = rintf(x[i] / scale);
        q[i] = v < low ? low : (v > high ? high : v);
    }
}

typedef float v8 __attribute__((vector_size(32))); /* GCC's and Clang's vectors: AVX2's where
                                                       the target has it, two SSE halves else */

static inline v8 load8(const float *p) {
    v8 v;
    __builtin_memcpy(&v, p, sizeof v);
    return v;
}

static inline void store8(float *p, v8 v) { __builtin_memcpy(p, &v, sizeof v); }

/* y[r, c] = sum_k q[r, k] * w[k, c] for ROWS rows and COLS columns from c0, the sums kept in
 * eight registers (exact: see above) */
static void block(const float *q, long depth, const float *w, long cols, long c0, float *y) {
    v8 a0 = {0}, a1 = {0}, b0 = {0}, b1 = {0}, c_0 = {0}, c_1 = {0}, d0 = {0}, d1 = {0};
    const float *q0 = q, *q1 = q + depth, *q2 = q + 2 * depth, *q3 = q + 3 * depth;
    for (long k = 0; k < depth; k++) {
        const float *wk = w + k * cols + c0;
        v8 w0 = load8(wk), w1 = load8(wk + 8);
        a0 += q0[k] * w0;
        a1 += q0[k] * w1;
        b0 += q1[k] * w0;
        b1 += q1[k] * w1;
        c_0 += q2[k] * w0;
        c_1 += q2[k] * w1;
        d0 += q3[k] * w0;
        d1 += q3[k] * w1;
    }
    store8(y + c0, a0);
    store8(y + c0 + 8, a1);
    store8(y + cols + c0, b0);
    store8(y + cols + c0 + 8, b1);
    store8(y + 2 * cols + c0, c_0);
    store8(y + 2 * cols + c0 + 8, c_1);
    store8(y + 3 * cols + c0, d0);
    store8(y + 3 * cols + c0 + 8, d1);
}

/* one row's COLS columns from c0 (the rows left over, fewer than ROWS) */
static void row(const float *q, long depth, const float *w, long cols, long c0, float *y) {
    v8 a0 = {0}, a1 = {0};
    for (long k = 0; k < depth; k++) {
        const float *wk = w + k * cols + c0;
        a0 += q[k] * load8(wk);
        a1 += q[k] * load8(wk + 8);
    }
    store8(y + c0, a0);
    store8(y + c0 + 8, a1);
}

/* the columns left over (fewer than COLS) of `rows` rows */
static void edge(const float *q, long rows, long depth, const float *w, long cols, long c0,
                 float *y) {
    for (long r = 0; r < rows; r++)
        for (long j = c0; j < cols; j++) {
            float sum = 0.0f;
            for (long k = 0; k < depth; k++)
                sum += q[r * depth + k] * w[k * cols + j];
            y[r * cols + j] = sum;
        }
}

/* x (rows, depth) row-major; w the centred weight (depth, cols) row-major; w_scale `scales`
 * values (1: per tensor, else cols); bias cols values or NULL; y (rows, cols). 0 done, 1 x's range
 * not finite (y untouched), 2 no memory. */
int backplane_dynquant_matmul(const float *x, long rows, long depth, const float *w, long cols,
                              const float *w_scale, long scales, const float *bias, float *y) {
    float scale, zero;
    if (grid(x, rows * depth, &scale, &zero))
        return 1;
    float stack[STACK];
    long need = ROWS * depth;
    float *q = need <= STACK ? stack : malloc(sizeof(float) * need);
    if (!q)
        return 2;
    for (long r0 = 0; r0 < rows; r0 += ROWS) {
        long n = rows - r0 < ROWS ? rows - r0 : ROWS;
        centre(x + r0 * depth, n * depth, scale, zero, q);
        long c0 = 0;
        for (; c0 + COLS <= cols; c0 += COLS)
            if (n == ROWS)
                block(q, depth, w, cols, c0, y + r0 * cols);
            else
                for (long r = 0; r < n; r++)
                    row(q + r * depth, depth, w, cols, c0, y + (r0 + r) * cols);
        if (c0 < cols)
            edge(q, n, depth, w, cols, c0, y + r0 * cols);
    }
    if (q != stack)
        free(q);
    for (long r = 0; r < rows; r++) {
        float *yr = y + r * cols;
        for (long c = 0; c < cols; c++)
            yr[c] = yr[c] * (w_scale[scales == 1 ? 0 : c] * scale);
        if (bias)
            for (long c = 0; c < cols; c++)
                yr[c] = yr[c] + bias[c];
    }
    return 0;
}
