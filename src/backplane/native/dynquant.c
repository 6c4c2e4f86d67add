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
 * separate rounding: -std=c11 keeps GCC from contracting the two into one FMA).
 *
 * The layer is also a torch op whose kernel is this C (backplane_dynquant_op, at the end): called
 * through torch's stable C ABI, whose functions dynquant.py hands over as addresses, so the
 * library is still built without torch's headers and loads without torch. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512VNNI__) && defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define DYNQUANT_VNNI 1
#endif

#define BACKPLANE_DYNQUANT_VERSION 4
#define ROWS 4  /* rows of x a block of the product reads each weight value for */
#define COLS 16 /* columns a block keeps in registers: ROWS * COLS / 8 = 8 AVX2 accumulators */
#define STACK 4096

int backplane_dynquant_version(void) { return BACKPLANE_DYNQUANT_VERSION; }

typedef float v8 __attribute__((vector_size(32))); /* GCC's and Clang's vectors: AVX2's where
                                                       the target has it, two SSE halves else */

static inline v8 load8(const float *p) {
    v8 v;
    __builtin_memcpy(&v, p, sizeof v);
    return v;
}

static inline void store8(float *p, v8 v) { __builtin_memcpy(p, &v, sizeof v); }

typedef int32_t m8 __attribute__((vector_size(32))); /* a comparison's lanes: -1 or 0 */

/* x's scale and zero point: CpuRef's DynamicQuantizeLinear (its Python floats are doubles, the
 * scale rounded once to float32, 0 - low divided in float32, rounded half to even). 1 where the
 * range is not finite (a NaN or an infinity: the caller takes torch's route, CpuRef's cases).
 * Eight lanes at once (the scalar loop's compare-and-keep was most of the C's time besides the
 * product): each lane keeps what the scalar loop keeps (a value replaces the lowest only where
 * below it, so -0.0 never replaces the 0 the range starts from), the lanes then joined the same
 * way; v - v is 0 for a finite v and NaN for a NaN or an infinity, so the lanes' sum is 0 only
 * where every value is finite. */
static int grid(const float *x, long count, float *scale, float *zero) {
    v8 low8 = {0}, high8 = {0}, odd8 = {0};
    long i = 0;
    for (; i + 8 <= count; i += 8) {
        v8 v = load8(x + i);
        m8 below = v < low8, above = v > high8;
        low8 = (v8)((below & (m8)v) | (~below & (m8)low8));
        high8 = (v8)((above & (m8)v) | (~above & (m8)high8));
        odd8 += v - v;
    }
    float lowest = 0.0f, highest = 0.0f, odd = 0.0f; /* the range always holds 0 */
    for (int j = 0; j < 8; j++) {
        lowest = low8[j] < lowest ? low8[j] : lowest;
        highest = high8[j] > highest ? high8[j] : highest;
        odd += odd8[j];
    }
    for (; i < count; i++) {
        float v = x[i];
        lowest = v < lowest ? v : lowest;
        highest = v > highest ? v : highest;
        odd += v - v; /* NaN and infinities give NaN */
    }
    if (odd != 0.0f) /* NaN */
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

/* each sum times the two scales (w_scale's first: the graph's constant product), then the bias */
static void finish(float *y, long rows, long cols, const float *w_scale, long scales, float scale,
                   const float *bias) {
    for (long r = 0; r < rows; r++) {
        float *yr = y + r * cols;
        for (long c = 0; c < cols; c++)
            yr[c] = yr[c] * (w_scale[scales == 1 ? 0 : c] * scale);
        if (bias)
            for (long c = 0; c < cols; c++)
                yr[c] = yr[c] + bias[c];
    }
}

/* the product of x (rows, depth) on the grid (scale, zero) by w; 0 done, 2 no memory */
static int float_product(const float *x, long rows, long depth, const float *w, long cols,
                         const float *w_scale, long scales, const float *bias, float *y,
                         float scale, float zero) {
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
    finish(y, rows, cols, w_scale, scales, scale, bias);
    return 0;
}

/* x (rows, depth) row-major; w the centred weight (depth, cols) row-major; w_scale `scales`
 * values (1: per tensor, else cols); bias cols values or NULL; y (rows, cols). 0 done, 1 x's range
 * not finite (y untouched), 2 no memory. */
int backplane_dynquant_matmul(const float *x, long rows, long depth, const float *w, long cols,
                              const float *w_scale, long scales, const float *bias, float *y) {
    float scale, zero;
    if (grid(x, rows * depth, &scale, &zero))
        return 1;
    return float_product(x, rows, depth, w, cols, w_scale, scales, bias, y, scale, zero);
}

/* The product on bytes where the build has AVX-512 VNNI (backplane_dynquant_bytes): x quantized
 * to unsigned bytes (its centred value plus the zero point: 0..255), the weight centred as signed
 * bytes, packed at load (dynquant.py's pack: [ceil(cols / 16)][ceil(depth / 4)][16][4] int8, zero
 * past depth and cols, then each column's sum, int32), vpdpbusd adding 64 exact products an
 * instruction into 16 int32 sums; less the zero point times the column's sum, each is the
 * centred product's integer sum, so its float (exact below 2^24) is the float path's sum, bit for
 * bit. 0 done, 1 x's range not finite, 2 no memory, 3 not built with VNNI. */
#if defined(DYNQUANT_VNNI)
static int bytes_product(const float *x, long rows, long depth, const int8_t *packed, long cols,
                         const float *w_scale, long scales, const float *bias, float *y,
                         float scale, float zero) {
    const long quads = (depth + 3) / 4, blocks = (cols + 15) / 16, stride = 4 * quads;
    const int32_t *colsum = (const int32_t *)(packed + blocks * quads * 64);
    uint8_t stack[4 * STACK];
    uint8_t *q = rows * stride <= 4 * STACK ? stack : malloc((size_t)(rows * stride));
    if (!q)
        return 2;
    const float low = -zero, high = 255.0f - zero;
    for (long r = 0; r < rows; r++) {
        for (long k = 0; k < depth; k++) { /* centre()'s value, plus the zero point */
            float v = rintf(x[r * depth + k] / scale);
            q[r * stride + k] = (uint8_t)(int32_t)((v < low ? low : (v > high ? high : v)) + zero);
        }
        for (long k = depth; k < stride; k++)
            q[r * stride + k] = 0;
    }
    const __m512i vz = _mm512_set1_epi32((int32_t)zero);
    for (long b = 0; b < blocks; b++) {
        const int8_t *wb = packed + b * quads * 64;
        const long c0 = 16 * b, count = cols - c0 < 16 ? cols - c0 : 16;
        const __mmask16 m = (__mmask16)((1u << count) - 1);
        const __m512i correction = _mm512_mullo_epi32(vz, _mm512_loadu_si512(colsum + c0));
        long r = 0;
        for (; r + 4 <= rows; r += 4) { /* four rows: four accumulators a weight vector */
            __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
            const uint8_t *q0 = q + r * stride;
            for (long i = 0; i < quads; i++) {
                const __m512i w = _mm512_loadu_si512(wb + i * 64);
                int32_t f0, f1, f2, f3;
                memcpy(&f0, q0 + 4 * i, 4);
                memcpy(&f1, q0 + stride + 4 * i, 4);
                memcpy(&f2, q0 + 2 * stride + 4 * i, 4);
                memcpy(&f3, q0 + 3 * stride + 4 * i, 4);
                a0 = _mm512_dpbusd_epi32(a0, _mm512_set1_epi32(f0), w);
                a1 = _mm512_dpbusd_epi32(a1, _mm512_set1_epi32(f1), w);
                a2 = _mm512_dpbusd_epi32(a2, _mm512_set1_epi32(f2), w);
                a3 = _mm512_dpbusd_epi32(a3, _mm512_set1_epi32(f3), w);
            }
            _mm512_mask_storeu_ps(y + r * cols + c0, m,
                                  _mm512_cvtepi32_ps(_mm512_sub_epi32(a0, correction)));
            _mm512_mask_storeu_ps(y + (r + 1) * cols + c0, m,
                                  _mm512_cvtepi32_ps(_mm512_sub_epi32(a1, correction)));
            _mm512_mask_storeu_ps(y + (r + 2) * cols + c0, m,
                                  _mm512_cvtepi32_ps(_mm512_sub_epi32(a2, correction)));
            _mm512_mask_storeu_ps(y + (r + 3) * cols + c0, m,
                                  _mm512_cvtepi32_ps(_mm512_sub_epi32(a3, correction)));
        }
        for (; r < rows; r++) {
            __m512i a = _mm512_setzero_si512();
            for (long i = 0; i < quads; i++) {
                int32_t f;
                memcpy(&f, q + r * stride + 4 * i, 4);
                a = _mm512_dpbusd_epi32(a, _mm512_set1_epi32(f), _mm512_loadu_si512(wb + i * 64));
            }
            _mm512_mask_storeu_ps(y + r * cols + c0, m,
                                  _mm512_cvtepi32_ps(_mm512_sub_epi32(a, correction)));
        }
    }
    if (q != stack)
        free(q);
    finish(y, rows, cols, w_scale, scales, scale, bias);
    return 0;
}
#endif

int backplane_dynquant_bytes(const float *x, long rows, long depth, const int8_t *packed,
                             long cols, const float *w_scale, long scales, const float *bias,
                             float *y) {
#if defined(DYNQUANT_VNNI)
    float scale, zero;
    if (grid(x, rows * depth, &scale, &zero))
        return 1;
    return bytes_product(x, rows, depth, packed, cols, w_scale, scales, bias, y, scale, zero);
#else
    (void)x, (void)rows, (void)depth, (void)packed, (void)cols, (void)w_scale, (void)scales;
    (void)bias, (void)y;
    return 3;
#endif
}

/* backplane_dynquant_bytes with the layer's constants read from one array (dynquant.py's
 * _layer: the packed weight's address, depth, cols, w_scale's address, its count, the bias's
 * address or 0), made once a layer: four arguments a call where ctypes converts nine (0.30
 * against 0.68 us a call). */
int backplane_dynquant_bytes_at(const float *x, long rows, const int64_t *layer, float *y) {
    return backplane_dynquant_bytes(x, rows, (long)layer[1], (const int8_t *)(intptr_t)layer[0],
                                    (long)layer[2], (const float *)(intptr_t)layer[3],
                                    (long)layer[4], (const float *)(intptr_t)layer[5], y);
}

/* 1 where backplane_dynquant_bytes is built (AVX-512 VNNI), else 0. */
int backplane_dynquant_has_bytes(void) {
#if defined(DYNQUANT_VNNI)
    return 1;
#else
    return 0;
#endif
}

/* The layer as a torch op, its kernel this C: backplane::dynamic_quant_matmul_c(Tensor x, Tensor
 * weight, Tensor w_scale, Tensor bias, Tensor residual, int depth, int cols) -> Tensor, the weight
 * float32 (depth, cols) or packed bytes (int8), no bias or residual an empty tensor; the residual
 * (a tensor of the result's shape, the graph's Add after the product) added last. Why: the op's
 * kernel in Python cost ~5 us a call (torch's call into Python, its argument checks, torch.empty,
 * ctypes) around ~0.4 us of product; a boxed kernel of torch's stable C ABI (torch::Library's
 * impl of a function over a stack of 64-bit values: each tensor an owned handle, each int its
 * value) is called by torch's dispatcher without Python. The functions of that ABI (aoti_torch_*,
 * exported by libtorch) come as addresses (backplane_dynquant_bind), read by dynquant.py from the
 * torch it imported. Where this C does not take x or the residual (not float32 on the CPU, not
 * contiguous, empty, x's range not finite: CpuRef's NaN cases), the call goes on to
 * backplane::dynamic_quant_matmul, the op in Python (dynquant.py's torch route), with the same
 * stack: that op takes the handles over. */
typedef uint64_t StableIValue;
typedef void *Tensor; /* AtenTensorHandle: an owned at::Tensor */

static struct {
    int32_t (*data)(Tensor, void **);
    int32_t (*dim)(Tensor, int64_t *);
    int32_t (*numel)(Tensor, int64_t *);
    int32_t (*sizes)(Tensor, int64_t **);
    int32_t (*contiguous)(Tensor, _Bool *);
    int32_t (*dtype)(Tensor, int32_t *);
    int32_t (*device)(Tensor, int32_t *);
    int32_t (*empty)(int64_t, const int64_t *, const int64_t *, int32_t, int32_t, int32_t,
                     Tensor *);
    int32_t (*release)(Tensor);
    int32_t (*dispatch)(const char *, const char *, StableIValue *);
    void (*fail)(_Bool, const char *, const char *, uint32_t, const char *);
    const char *(*what)(void); /* the last error's message; NULL in a torch before 2.10 */
    int32_t float32, int8, cpu;
} abi;

#define ABI_FUNCTIONS 12
#define MAX_DIMS 8

/* dynquant.py's addresses, in the struct's order (the 12 functions, then the float32 and int8
 * dtype codes and the CPU's device code). 0 bound. */
int backplane_dynquant_bind(const int64_t *calls) {
    void **slots = (void **)&abi;
    for (int i = 0; i < ABI_FUNCTIONS; i++)
        memcpy(&slots[i], &calls[i], sizeof(void *));
    abi.float32 = (int32_t)calls[ABI_FUNCTIONS];
    abi.int8 = (int32_t)calls[ABI_FUNCTIONS + 1];
    abi.cpu = (int32_t)calls[ABI_FUNCTIONS + 2];
    return 0;
}

/* whether t is float32 on the CPU, contiguous, of the shape (dims, shape): its data in *data */
static int is_like(Tensor t, int64_t dims, const int64_t *shape, void **data) {
    int32_t type, device;
    int64_t own, *sizes;
    _Bool dense;
    if (abi.dtype(t, &type) || abi.device(t, &device) || abi.contiguous(t, &dense) ||
        abi.dim(t, &own) || abi.sizes(t, &sizes) || abi.data(t, data))
        return 0;
    if (type != abi.float32 || device != abi.cpu || !dense || own != dims)
        return 0;
    for (int64_t d = 0; d < dims; d++)
        if (sizes[d] != shape[d])
            return 0;
    return 1;
}

/* y (x's shape, its last size cols) computed here; 0 done, else x or the weight is one this C
 * does not take (the op in Python does), or no memory (y released) */
static int run_op(Tensor x, Tensor w, Tensor w_scale, Tensor bias, Tensor residual, long depth,
                  long cols, Tensor *y) {
    int32_t type, weight_type, device;
    int64_t dims, count, scales, added, summed, *sizes, shape[MAX_DIMS], strides[MAX_DIMS];
    _Bool dense;
    void *xs, *ws, *ss, *bs, *ys, *rs = NULL;
    if (abi.dtype(x, &type) || abi.device(x, &device) || abi.contiguous(x, &dense) ||
        abi.dim(x, &dims) || abi.numel(x, &count) || abi.sizes(x, &sizes) ||
        abi.dtype(w, &weight_type) || abi.numel(w_scale, &scales) || abi.numel(bias, &added) ||
        abi.numel(residual, &summed))
        return 1;
    if (type != abi.float32 || device != abi.cpu || !dense || dims < 1 || dims > MAX_DIMS ||
        depth < 1 || sizes[dims - 1] != depth || count == 0 || (added && added != cols))
        return 1;
#if !defined(DYNQUANT_VNNI)
    if (weight_type == abi.int8)
        return 1;
#endif
    if (abi.data(x, &xs) || abi.data(w, &ws) || abi.data(w_scale, &ss) || abi.data(bias, &bs))
        return 1;
    for (int64_t d = dims - 1, step = 1; d >= 0; d--) {
        shape[d] = d == dims - 1 ? cols : sizes[d];
        strides[d] = step;
        step *= shape[d];
    }
    if (summed && !is_like(residual, dims, shape, &rs))
        return 1;
    const long rows = (long)(count / depth);
    float scale, zero;
    if (grid(xs, count, &scale, &zero))
        return 1;
    if (abi.empty(dims, shape, strides, abi.float32, abi.cpu, 0, y))
        return 2;
    int code = abi.data(*y, &ys);
    const float *b = added ? bs : NULL;
#if defined(DYNQUANT_VNNI)
    if (!code && weight_type == abi.int8)
        code = bytes_product(xs, rows, depth, ws, cols, ss, (long)scales, b, ys, scale, zero);
    else
#endif
        if (!code)
        code = float_product(xs, rows, depth, ws, cols, ss, (long)scales, b, ys, scale, zero);
    if (code) {
        abi.release(*y);
        return code;
    }
    float *out = ys;
    const float *r = rs;
    for (int64_t i = 0; i < summed; i++) /* the graph's Add(product, residual): one rounding */
        out[i] = out[i] + r[i];
    return 0;
}

/* torch's boxed kernel of backplane::dynamic_quant_matmul_c: the stack holds the seven arguments
 * (x, weight, w_scale, bias, residual: owned handles; depth, cols), then the result */
void backplane_dynquant_op(StableIValue *stack, uint64_t arguments, uint64_t results) {
    (void)arguments, (void)results;
    Tensor x = (Tensor)(uintptr_t)stack[0], w = (Tensor)(uintptr_t)stack[1];
    Tensor w_scale = (Tensor)(uintptr_t)stack[2], bias = (Tensor)(uintptr_t)stack[3];
    Tensor residual = (Tensor)(uintptr_t)stack[4], y = NULL;
    long depth = (long)(int64_t)stack[5], cols = (long)(int64_t)stack[6];
    if (run_op(x, w, w_scale, bias, residual, depth, cols, &y) == 0) {
        abi.release(x), abi.release(w), abi.release(w_scale), abi.release(bias);
        abi.release(residual);
        stack[0] = (StableIValue)(uintptr_t)y; /* torch takes the handle over */
        return;
    }
    if (abi.dispatch("backplane::dynamic_quant_matmul", "", stack)) /* raises a c10::Error: */
        abi.fail(0, "backplane_dynquant_op", __FILE__, __LINE__,
                 abi.what ? abi.what() : "backplane::dynamic_quant_matmul failed");
}
