/* A recurrent partition in one call (recurrent_net.py plans it at load): its LSTM / GRU layers
 * (recurrent.c's row loop), the moves between them (Transpose, Slice, Gather, Concat: strided
 * copies; Squeeze, Unsqueeze and Reshape are views, planned away) and its Linear heads, as records
 * over one pointer table. Why: in a trace each recurrent op's Python dispatch cost 10-15 us and
 * the trace's other ops 2-5 us each, around layers whose arithmetic takes 5-20 us (lstm_bi2_ts14,
 * gru_tm3_ts13, the VAD's one-step LSTM).
 *
 * A record is REC int64: its kind, then its fields. A reference to memory is one int64: -1 for
 * none, else slot << 40 | offset in floats, slot 0 the arena, 1 the constants (params), 2 + i the
 * call's i-th input or output (ext). Included by recurrent.c (one translation unit). */
#include "panel_product.h"

#define REC 32
enum { R_RNN = 1, R_LINEAR = 2, R_COPY = 3, R_SOFTMAX = 4 };
enum { A_NONE = 0, A_RELU = 1, A_SIGMOID = 2, A_TANH = 3 };

static inline float *at_ref(int64_t ref, float *arena, const float *params, void **ext) {
    if (ref < 0)
        return NULL;
    int64_t slot = ref >> 40, offset = ref & (((int64_t)1 << 40) - 1);
    float *base = slot == 0 ? arena : slot == 1 ? (float *)params : (float *)ext[slot - 2];
    return base + offset;
}

static inline float act(float v, int64_t kind) {
    switch (kind) {
    case A_RELU: return v < 0.0f ? 0.0f : v; /* (NaN compares false: kept) */
    case A_SIGMOID: return sigmoid_r(v);
    case A_TANH: return tanh_r(v);
    default: return v;
    }
}

/* y[m, :] = act(bias + x[m, :] W^T) for M rows (x's rows xs floats apart, contiguous inside), W
 * packed by recurrent_net.py's ``panels`` (its outputs in panels of 16, each panel's K rows of 16
 * contiguous, the last padded with zeros, as the bias is): panel_product.h's register tile,
 * linear.c's too. */
static void linear(int64_t M, int64_t K, int64_t N, const float *x, int64_t xs,
                   const float *panels, const float *bias, float *y, int64_t kind) {
    panel_product(M, K, N, x, xs, panels, bias, y, N);
    if (kind != A_NONE)
        for (int64_t i = 0; i < M * N; ++i)
            y[i] = act(y[i], kind);
}

/* dst[i...] = src[i...] over up to six dimensions, each side's strides in floats. */
static void copy(const int64_t *sizes, const float *src, const int64_t *ss, float *dst,
                 const int64_t *ds) {
    int64_t i[6] = {0};
    for (;;) {
        const float *s = src + i[0] * ss[0] + i[1] * ss[1] + i[2] * ss[2] + i[3] * ss[3] +
                         i[4] * ss[4];
        float *d = dst + i[0] * ds[0] + i[1] * ds[1] + i[2] * ds[2] + i[3] * ds[3] + i[4] * ds[4];
        if (ss[5] == 1 && ds[5] == 1)
            memcpy(d, s, sizes[5] * sizeof(float));
        else
            for (int64_t j = 0; j < sizes[5]; ++j)
                d[j * ds[5]] = s[j * ss[5]];
        int a = 4;
        while (a >= 0 && ++i[a] == sizes[a])
            i[a--] = 0;
        if (a < 0)
            return;
    }
}

/* Each of ``rows`` rows of n floats (contiguous) made its softmax, in place: e^(x - max) over
 * their sum, by exp_r (Cephes' expf, as sigmoid's: within 2 ulp of expf, vectorized, where
 * libm's expf was a call an element: the CRNN's 80 rows of 40, 11.7 -> 2 us). A NaN in a row makes
 * the row NaN. */
static void softmax(int64_t rows, int64_t n, float *x) {
    for (int64_t r = 0; r < rows; ++r, x += n) {
        float top = x[0];
        for (int64_t j = 1; j < n; ++j)
            top = x[j] > top ? x[j] : top;
        for (int64_t j = 0; j < n; ++j)
            x[j] = exp_r(x[j] - top);
        v8 lanes = {0};
        int64_t j = 0;
        for (; j + 8 <= n; j += 8)
            lanes += *(const v8u *)(x + j);
        float sum = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) +
                    ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
        for (; j < n; ++j)
            sum += x[j];
        float inverse = 1.0f / sum;
        for (j = 0; j < n; ++j)
            x[j] *= inverse;
    }
}

/* The records in order; 0, or 1 + the index of the record that failed (work memory). */
int backplane_rnet_run(const int64_t *recs, int64_t count, const float *params, float *arena,
                       void **ext) {
    for (int64_t r = 0; r < count; ++r) {
        const int64_t *p = recs + r * REC;
#define REF(i) at_ref(p[i], arena, params, ext)
        switch (p[0]) {
        case R_RNN: {
            Call a = {(const Shape *)(p + 2), REF(17), REF(18), REF(19), REF(20), REF(21),
                      NULL, REF(23), REF(24), REF(25)};
            if (run(&a, (int)p[1]))
                return (int)r + 1;
            break;
        }
        case R_LINEAR:
            linear(p[1], p[2], p[3], REF(4), p[5], REF(6), REF(7), REF(8), p[9]);
            break;
        case R_COPY:
            copy(p + 1, REF(7), p + 8, REF(14), p + 15);
            break;
        case R_SOFTMAX:
            softmax(p[1], p[2], REF(3));
            break;
        default:
            return (int)r + 1;
        }
#undef REF
    }
    return 0;
}

int backplane_rnet_rec(void) { return REC; }

/* The product's tile rows: 12 where it was built with AVX-512's (recurrent_net.py reads it). */
int backplane_rnet_rows(void) { return PANEL_ROWS; }
