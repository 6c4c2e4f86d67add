/* Which records cnn.c's threads share, and how (cnn_pool.h runs them): each kind's items and the
   part function that runs a range of them. Items are output rows (depthwise convolutions, pools,
   resizes, softmax rows, a padded frame's rows), chunks of output pixels (convolutions) or runs of
   SPAN elements (the moves and elementwise records), each written by one thread with the
   one-thread run's arithmetic: a split run's outputs are the one-thread run's bit for bit. cnn.py
   marks a record split (F_SPLIT) where its work is worth a worker's wake-up. */
enum { SPAN = 16384 };  /* elements an item of an elementwise or moving record (a multiple of 16) */

/* Where item `item`'s elements start, of n (n past the last item): items [b, e) are elements
   [span_at(b), span_at(e)). */
static inline int64_t span_at(int64_t item, int64_t n) { return item * SPAN < n ? item * SPAN : n; }

/* A padded frame's rows [r0, r1) of its N x PH (pad_frame's, row by row). */
static void frame_part(const int64_t *f, float *A, const float *P, int64_t r0, int64_t r1) {
    (void)P;
    const int64_t H = f[F_H], W = f[F_W], C = f[F_C], PH = f[F_PH], PW = f[F_PW], PT = f[F_PT],
                  PL = f[F_PL];
    const float *x = A + f[F_IN];
    float *y = A + f[F_SCR];
    for (int64_t r = r0; r < r1; ++r) {
        const int64_t n = r / PH, h = r % PH - PT;
        float *line = y + r * PW * C;
        if (h < 0 || h >= H) {
            memset(line, 0, sizeof(float) * PW * C);
            continue;
        }
        memset(line, 0, sizeof(float) * PL * C);
        memcpy(line + PL * C, x + (n * H + h) * W * C, sizeof(float) * W * C);
        memset(line + (PL + W) * C, 0, sizeof(float) * (PW - PL - W) * C);
    }
}

static void maxpool_part(const int64_t *f, float *A, const float *P, int64_t r0, int64_t r1) {
    (void)P;
    pool_rows(f, A, 1, r0, r1);
}

static void avgpool_part(const int64_t *f, float *A, const float *P, int64_t r0, int64_t r1) {
    (void)P;
    pool_rows(f, A, 0, r0, r1);
}

static void slice_items(const int64_t *f, float *A, const float *P, int64_t b, int64_t e) {
    (void)P;  /* pixels: an item SPAN / 16 of them */
    const int64_t n = f[F_N], p0 = b * (SPAN / 16), p1 = e * (SPAN / 16);
    slice_part(f, A, p0 < n ? p0 : n, p1 < n ? p1 : n);
}

static void gather_items(const int64_t *f, float *A, const float *P, int64_t b, int64_t e) {
    gather_part(f, A, P, span_at(b, f[F_N]), span_at(e, f[F_N]));
}

static void scatter_items(const int64_t *f, float *A, const float *P, int64_t b, int64_t e) {
    scatter_part(f, A, P, span_at(b, f[F_N]), span_at(e, f[F_N]));
}

static void arith_items(const int64_t *f, float *A, const float *P, int64_t b, int64_t e) {
    arith_part(f, A, P, span_at(b, f[F_N]), span_at(e, f[F_N]));
}

/* OP_ACT's elements [i0, i1) (its copy where it has its own output, then the activation). */
static void act_items(const int64_t *f, float *A, const float *P, int64_t b, int64_t e) {
    const int64_t i0 = span_at(b, f[F_N]), i1 = span_at(e, f[F_N]);
    if (f[F_OUT] != f[F_IN])
        memcpy(A + f[F_OUT] + i0, A + f[F_IN] + i0, sizeof(float) * (size_t)(i1 - i0));
    act_pass(A + f[F_OUT] + i0, i1 - i0, f[F_ACT], P + f[F_AOFF]);
}

static void softmax_part(const int64_t *f, float *A, const float *P, int64_t r0, int64_t r1) {
    softmax_rows(f, A, P, r0, r1);
}

/* An import's or export's items: blocks of SPAN / 16 pixels of one image. */
static inline int64_t edge_blocks(const int64_t *f) {
    return (f[F_H] * f[F_W] + SPAN / 16 - 1) / (SPAN / 16);
}

/* NCHW to NHWC (import_nchw's moves) or back (export_nchw's), blocks [b, e) of the N images'. */
static void edge_part(const int64_t *f, float *A, const float *P, int64_t b, int64_t e) {
    (void)P;
    const int64_t C = f[F_C], HW = f[F_H] * f[F_W], blocks = edge_blocks(f);
    const int in = f[F_OP] == OP_IMPORT;
    for (int64_t item = b; item < e; ++item) {
        const int64_t n = item / blocks, p0 = item % blocks * (SPAN / 16);
        const int64_t p1 = p0 + SPAN / 16 < HW ? p0 + SPAN / 16 : HW;
        if (in) {
            const float *restrict x = team.ext[f[F_IN]] + n * C * HW;
            float *restrict y = A + f[F_OUT] + n * C * HW;
            for (int64_t p = p0; p < p1; ++p)
                for (int64_t c = 0; c < C; ++c) y[p * C + c] = x[c * HW + p];
        } else {
            const float *restrict x = A + f[F_IN] + n * C * HW;
            float *restrict y = team.ext[f[F_OUT]] + n * C * HW;
            for (int64_t c = 0; c < C; ++c)
                for (int64_t p = p0; p < p1; ++p) y[c * HW + p] = x[p * C + c];
        }
    }
}

static inline int64_t spans(int64_t n) { return (n + SPAN - 1) / SPAN; }

/* A split record on the pool's `workers` and the caller; 0 where its kind is not split (the
   caller runs it alone). */
static int split_step(const int64_t *f, const float *P, float *A, float *const *ext,
                      int workers) {
    const int64_t rows = f[F_N] * f[F_OH];
    switch (f[F_OP]) {
    case OP_IMPORT:
    case OP_EXPORT:  /* float32 edges in NCHW only (not float16, indices, nor a plain copy) */
        if (f[F_X1] || f[F_H] * f[F_W] == 1 || f[F_C] == 1) return 0;
        team.ext = ext;
        pool_run(edge_part, f, A, P, f[F_N] * edge_blocks(f), 1, workers);
        return 1;
    case OP_CONV:
        if (f[F_SCR] >= 0) pool_run(frame_part, f, A, P, f[F_N] * f[F_PH], 8, workers);
        pool_run(conv_part, f, A, P, conv_items(f), 1, workers);
        return 1;
    case OP_DWCONV: pool_run(dw_part, f, A, P, rows, 1, workers); return 1;
    case OP_MAXPOOL: pool_run(maxpool_part, f, A, P, rows, 1, workers); return 1;
    case OP_AVGPOOL: pool_run(avgpool_part, f, A, P, rows, 1, workers); return 1;
    case OP_RESIZE: pool_run(resize_part, f, A, P, rows, 1, workers); return 1;
    case OP_SLICE:
        pool_run(slice_items, f, A, P, (f[F_N] + SPAN / 16 - 1) / (SPAN / 16), 1, workers);
        return 1;
    case OP_GATHER: pool_run(gather_items, f, A, P, spans(f[F_N]), 1, workers); return 1;
    case OP_SCATTER: pool_run(scatter_items, f, A, P, spans(f[F_N]), 1, workers); return 1;
    case OP_ARITH: pool_run(arith_items, f, A, P, spans(f[F_N]), 1, workers); return 1;
    case OP_ACT: pool_run(act_items, f, A, P, spans(f[F_N]), 1, workers); return 1;
    case OP_SOFTMAX: {
        const int64_t grain = SPAN / (f[F_C] > 0 ? f[F_C] : 1);
        pool_run(softmax_part, f, A, P, f[F_N], grain < 1 ? 1 : grain, workers);
        return 1;
    }
    default:
        return 0;
    }
}
