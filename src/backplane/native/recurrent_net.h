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
 * packed by recurrent_net.py's ``panels``: its outputs in panels of 16, each panel's K rows of 16
 * contiguous, the last padded with zeros, as the bias is. Panels outside, rows inside: a panel
 * (K x 16 floats) stays in L1 over every row, where a large W (the full tier's projections, 1 MB)
 * would be streamed from L3 again for each block of rows; six rows share each load of it. A
 * last panel narrower than 16 is made in a row of 16 on the stack, its columns copied out. */
static void linear(int64_t M, int64_t K, int64_t N, const float *x, int64_t xs,
                   const float *panels, const float *bias, float *y, int64_t kind) {
    float part[6][16];
    for (int64_t n = 0; n < N; n += 16) {
        const float *panel = panels + (n / 16) * K * 16;
        int64_t width = N - n < 16 ? N - n : 16;
        v8 b0 = {0}, b1 = {0};
        if (bias) { b0 = *(const v8u *)(bias + n); b1 = *(const v8u *)(bias + n + 8); }
        int64_t m = 0;
        for (; m + 6 <= M; m += 6) {
            const float *x0 = x + m * xs;
            v8 a00 = b0, a01 = b1, a10 = b0, a11 = b1, a20 = b0, a21 = b1, a30 = b0, a31 = b1,
               a40 = b0, a41 = b1, a50 = b0, a51 = b1;
            const float *w = panel;
            for (int64_t k = 0; k < K; ++k, w += 16) {
                v8 w0 = *(const v8u *)w, w1 = *(const v8u *)(w + 8), s;
                s = (v8){0} + x0[k]; a00 += s * w0; a01 += s * w1;
                s = (v8){0} + x0[xs + k]; a10 += s * w0; a11 += s * w1;
                s = (v8){0} + x0[2 * xs + k]; a20 += s * w0; a21 += s * w1;
                s = (v8){0} + x0[3 * xs + k]; a30 += s * w0; a31 += s * w1;
                s = (v8){0} + x0[4 * xs + k]; a40 += s * w0; a41 += s * w1;
                s = (v8){0} + x0[5 * xs + k]; a50 += s * w0; a51 += s * w1;
            }
            *(v8u *)part[0] = a00; *(v8u *)(part[0] + 8) = a01;
            *(v8u *)part[1] = a10; *(v8u *)(part[1] + 8) = a11;
            *(v8u *)part[2] = a20; *(v8u *)(part[2] + 8) = a21;
            *(v8u *)part[3] = a30; *(v8u *)(part[3] + 8) = a31;
            *(v8u *)part[4] = a40; *(v8u *)(part[4] + 8) = a41;
            *(v8u *)part[5] = a50; *(v8u *)(part[5] + 8) = a51;
            for (int r = 0; r < 6; ++r)
                memcpy(y + (m + r) * N + n, part[r], width * sizeof(float));
        }
        for (; m < M; ++m) {
            const float *xr = x + m * xs, *w = panel;
            v8 a0 = b0, a1 = b1;
            for (int64_t k = 0; k < K; ++k, w += 16) {
                v8 s = {0};
                s += xr[k];
                a0 += s * *(const v8u *)w;
                a1 += s * *(const v8u *)(w + 8);
            }
            *(v8u *)part[0] = a0; *(v8u *)(part[0] + 8) = a1;
            memcpy(y + m * N + n, part[0], width * sizeof(float));
        }
    }
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
 * their sum, expf's (torch's and ONNX Runtime's precision). A NaN in a row makes the row NaN. */
static void softmax(int64_t rows, int64_t n, float *x) {
    for (int64_t r = 0; r < rows; ++r, x += n) {
        float top = x[0], sum = 0.0f;
        for (int64_t j = 1; j < n; ++j)
            top = x[j] > top ? x[j] : top;
        for (int64_t j = 0; j < n; ++j) {
            x[j] = __builtin_expf(x[j] - top);
            sum += x[j];
        }
        float inverse = 1.0f / sum;
        for (int64_t j = 0; j < n; ++j)
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
