/* cnn.c's records for a detector's head after its convolutions (cnn_detect.py plans them): TopK,
   gathers by computed indices (Gather, GatherElements, GatherND), ArgMax / ArgMin, Softmax, and
   an export to int64. Included once, by cnn.c, after cnn_ops.h; step() hands it every op code it
   does not know itself (detect_step).

   Why: a detector's partition ended in TopK and GatherElements, which kept its last layers traced
   (~70 us of torch calls around ~2 us of work, detect_nms_ts14); here they are loops over the
   arena like the others, and the partition is one call.

   Indices live in the arena as floats (exact below 2^24, where every index of a planned tensor
   is: the plan's tables are int32): a TopK's or an ArgMax's written as floats, a gather's read
   back and checked against its axis (out of range: the record fails and the call returns its
   number, as CpuRef raises). */
enum { OP_TOPK = 22, OP_DGATHER, OP_EXPORT_INT, OP_ARGREDUCE, OP_SOFTMAX };

/* Whether a is ranked before b: CpuRef's stable sorts (indexing.top_k: NumPy's argsort puts NaN
   last), so a NaN is above every number for the largest and below for the smallest; equal
   values (and two NaN) keep their order, which the caller's scan gives. */
static inline int ranks_before(float a, float b, int largest) {
    if (largest) return (a != a && b == b) || a > b;
    return (a == a && b != b) || a < b;
}

/* Whether (a, ia) comes after (b, ib) in the order: b ranks before a, or they tie and a's index
   is the later. */
static inline int after(float a, float ia, float b, float ib, int largest) {
    return ranks_before(b, a, largest) || (!ranks_before(a, b, largest) && ia > ib);
}

/* The heap's element at j moved down below those that come after it (the root: the last of the
   kept, the one a candidate must beat). */
static inline void sift(float *restrict v, float *restrict ix, int64_t j, int64_t n, int largest) {
    const float x = v[j], xi = ix[j];
    for (int64_t c; (c = 2 * j + 1) < n; j = c) {
        if (c + 1 < n && after(v[c + 1], ix[c + 1], v[c], ix[c], largest)) ++c;
        if (!after(v[c], ix[c], x, xi, largest)) break;
        v[j] = v[c];
        ix[j] = ix[c];
    }
    v[j] = x;
    ix[j] = xi;
}

/* TopK of F_N rows of F_C candidates (a row's places: the int32 table at F_WOFF, in the axis's
   order): the F_OC best of each in order, values to F_OUT and indices (floats) to F_X2, row by
   row ([row][k]); F_X1: 1 the largest, 0 the smallest. The kept are a heap whose root is their
   last (a candidate that does not rank before it costs one compare; one that ties it comes
   later and stays out), sorted at the end by taking the root out k times: candidates x log k
   compares at worst, where an insertion into a sorted array moved k / 2 a candidate. */
static void topk(const int64_t *f, float *A, const float *P) {
    const int64_t rows = f[F_N], M = f[F_C], K = f[F_OC];
    const int largest = (int)f[F_X1];
    const int32_t *restrict at = (const int32_t *)(P + f[F_WOFF]);
    const float *restrict x = A + f[F_IN];
    float *restrict values = A + f[F_OUT], *restrict index = A + f[F_X2];
    for (int64_t r = 0; r < rows; ++r, at += M, values += K, index += K) {
        for (int64_t i = 0; i < K; ++i) {
            values[i] = x[at[i]];
            index[i] = (float)i;
        }
        for (int64_t j = K / 2 - 1; j >= 0; --j) sift(values, index, j, K, largest);
        for (int64_t i = K; i < M; ++i) {
            const float v = x[at[i]];
            if (!ranks_before(v, values[0], largest)) continue;
            values[0] = v;
            index[0] = (float)i;
            sift(values, index, 0, K, largest);
        }
        for (int64_t end = K - 1; end > 0; --end) {  /* the last kept to the end, and so on */
            const float v = values[0], ix = index[0];
            values[0] = values[end];
            index[0] = index[end];
            values[end] = v;
            index[end] = ix;
            sift(values, index, 0, end, largest);
        }
    }
}

/* F_N outputs, each the input element at the int32 place F_WOFF names plus, for each of the F_C
   index components, the index read from the arena (F_IN2 + the int32 place at F_BOFF + the
   component's index step) times the component's step: (step, size, index step) int32 triples
   at F_X2. A negative index counts from the end; one outside its axis fails the record. */
static int dgather(const int64_t *f, float *A, const float *P) {
    const int64_t n = f[F_N], K = f[F_C];
    const int32_t *restrict base = (const int32_t *)(P + f[F_WOFF]);
    const int32_t *restrict where = (const int32_t *)(P + f[F_BOFF]);
    const int32_t *restrict axes = (const int32_t *)(P + f[F_X2]);
    const float *restrict x = A + f[F_IN], *restrict idx = A + f[F_IN2];
    float *restrict o = A + f[F_OUT];
    for (int64_t i = 0; i < n; ++i) {
        int64_t place = base[i];
        for (int64_t k = 0; k < K; ++k) {
            const float v = idx[where[i] + k * axes[3 * k + 2]];
            const float size = (float)axes[3 * k + 1];
            if (!(v >= -size && v < size)) return 1;  /* NaN too */
            const int64_t j = (int64_t)v;
            place += (j < 0 ? j + axes[3 * k + 1] : j) * axes[3 * k];
        }
        o[i] = x[place];
    }
    return 0;
}

/* An export of integer values (indices kept as floats) to the caller's int64, NCHW. */
static void export_int(const int64_t *f, const float *arena, float *const *ext) {
    const int64_t N = f[F_N], C = f[F_C], HW = f[F_H] * f[F_W];
    const float *restrict x = arena + f[F_IN];
    int64_t *restrict y = (int64_t *)ext[f[F_OUT]];
    for (int64_t n = 0; n < N; ++n, x += C * HW, y += C * HW)
        for (int64_t c = 0; c < C; ++c)
            for (int64_t p = 0; p < HW; ++p) y[c * HW + p] = (int64_t)x[p * C + c];
}

/* ArgMax (F_X1 0) or ArgMin (1) of F_N rows of F_C elements (their places: the int32 table at
   F_WOFF), each row's index (a float) to F_OUT; F_X2: the last of equal ones, else the first.
   NumPy's argmax and argmin, which CpuRef calls: a NaN wins (the first NaN, or the last). */
static void argreduce(const int64_t *f, float *A, const float *P) {
    const int64_t rows = f[F_N], M = f[F_C];
    const int is_min = (int)f[F_X1], last = (int)f[F_X2];
    const int32_t *restrict at = (const int32_t *)(P + f[F_WOFF]);
    const float *restrict x = A + f[F_IN];
    float *restrict o = A + f[F_OUT];
    for (int64_t r = 0; r < rows; ++r, at += M) {
        int64_t best = 0;
        float b = x[at[0]];
        for (int64_t i = 1; i < M; ++i) {
            const float v = x[at[i]];
            int take;
            if (b != b) take = last && v != v;
            else if (v != v) take = 1;
            else take = is_min ? (last ? v <= b : v < b) : (last ? v >= b : v > b);
            if (take) best = i, b = v;
        }
        o[r] = (float)best;
    }
}

/* Softmax of F_N rows of F_C elements (the int32 table at F_WOFF: a row's places, in and out
   alike), CpuRef's: exp(x - max) / sum, the max a NaN where the row has one (np.max's). */
static void softmax_rows(const int64_t *f, float *A, const float *P, int64_t r0, int64_t r1) {
    const int64_t M = f[F_C];
    const int32_t *restrict at = (const int32_t *)(P + f[F_WOFF]) + r0 * M;
    const float *restrict x = A + f[F_IN];
    float *restrict o = A + f[F_OUT];
    for (int64_t r = r0; r < r1; ++r, at += M) {
        float peak = x[at[0]], sum = 0.0f;
        for (int64_t i = 1; i < M; ++i) {
            const float v = x[at[i]];
            peak = (v > peak || v != v) ? v : peak;
        }
        for (int64_t i = 0; i < M; ++i) {
            const float e = expf(x[at[i]] - peak);
            o[at[i]] = e;
            sum += e;
        }
        for (int64_t i = 0; i < M; ++i) o[at[i]] = o[at[i]] / sum;
    }
}

static void softmax(const int64_t *f, float *A, const float *P) {
    softmax_rows(f, A, P, 0, f[F_N]);
}

/* The records of this header; 1 for an op code no one knows or a failed record. */
static int detect_step(const int64_t *f, const float *params, float *arena, float *const *ext) {
    switch (f[F_OP]) {
    case OP_TOPK: topk(f, arena, params); return 0;
    case OP_DGATHER: return dgather(f, arena, params);
    case OP_EXPORT_INT: export_int(f, arena, ext); return 0;
    case OP_ARGREDUCE: argreduce(f, arena, params); return 0;
    case OP_SOFTMAX: softmax(f, arena, params); return 0;
    default: return 1;
    }
}
