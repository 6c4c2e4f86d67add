/* cnn.c's records for a sequence model's first layers (cnn_seq.py plans them): integer and bool
   inputs imported as the arena's floats, and an embedding's Gather of a constant table by those
   indices. Included once, by cnn.c, after cnn_detect.h.

   Why: a byte classifier (bytes_int32_dyn20) reads int32 bytes and a bool mask; its Gather of the
   embedding table, the mask's Cast and Mul and the Transpose to (N, C, L) had kept the partition
   traced (its convolutions and gate too), ~10 torch calls around ~5 us of moves. Here the lookup,
   the mask and the transpose are one pass over the rows. */
enum { OP_EMBED = 27, OP_ROWNORM };
enum { EDGE_HALF = 1, EDGE_INT32, EDGE_INT64, EDGE_BOOL };

/* An integer or bool input (F_X1: EDGE_INT32, EDGE_INT64, EDGE_BOOL) to the arena's floats,
   NCHW to NHWC as the float inputs. An integer of magnitude above 2^24 has no exact float: the
   record fails (the call raises) rather than carry a rounded index. */
static int import_integers(const int64_t *f, float *arena, float *const *ext) {
    const int64_t N = f[F_N], C = f[F_C], HW = f[F_H] * f[F_W], kind = f[F_X1];
    const int flat = HW == 1 || C == 1;
    const void *source = ext[f[F_IN]];
    float *restrict y = arena + f[F_OUT];
    int bad = 0;
    for (int64_t n = 0, at = 0; n < N; ++n, y += C * HW, at += C * HW)
        for (int64_t p = 0; p < HW; ++p)
            for (int64_t c = 0; c < C; ++c) {
                const int64_t i = at + (flat ? p * C + c : c * HW + p);
                int64_t v;
                if (kind == EDGE_INT32) v = ((const int32_t *)source)[i];
                else if (kind == EDGE_INT64) v = ((const int64_t *)source)[i];
                else v = ((const uint8_t *)source)[i] != 0;
                bad |= v > 16777216 || v < -16777216;
                y[p * C + c] = (float)v;
            }
    return bad;
}

/* out[n, l, e] = table[index[n, l], e] (times scale[n, l] where F_IN2 is given), over F_N
   batches of F_H indices (read in ONNX order at F_IN), rows of F_C floats from the table at
   F_WOFF of F_OC rows; written at F_OUT + n * F_X1 + l * F_SH + e * F_SW: the output's own
   channels-last order, or its transpose's (F_SW 1: a row's floats contiguous). An index
   outside [-F_OC, F_OC) fails the record, as CpuRef's Gather raises; a negative one counts
   from the end. The scale multiplies (0 times a NaN or an infinity is NaN, as the Mul's). */
static int embed(const int64_t *f, float *A, const float *P) {
    const int64_t N = f[F_N], L = f[F_H], E = f[F_C], V = f[F_OC];
    const int64_t sl = f[F_SH], se = f[F_SW], sn = f[F_X1];
    const float *restrict index = A + f[F_IN], *restrict table = P + f[F_WOFF];
    const float *restrict scale = f[F_IN2] >= 0 ? A + f[F_IN2] : 0;
    for (int64_t n = 0; n < N; ++n)
        for (int64_t l = 0; l < L; ++l) {
            const float x = index[n * L + l];
            if (!(x >= (float)-V && x < (float)V)) return 1;  /* NaN too */
            const int64_t i = (int64_t)x + (x < 0.0f ? V : 0);
            const float *restrict row = table + i * E;
            float *restrict out = A + f[F_OUT] + n * sn + l * sl;
            const float s = scale ? scale[n * L + l] : 1.0f;
            if (se == 1 && scale)
                for (int64_t e = 0; e < E; ++e) out[e] = row[e] * s;
            else if (se == 1)
                memcpy(out, row, sizeof(float) * (size_t)E);
            else
                for (int64_t e = 0; e < E; ++e) out[e * se] = scale ? row[e] * s : row[e];
        }
    return 0;
}

/* An activation record's pass over n floats (an OP_ACT: a GELU after a norm, a gate's Sigmoid
   where no convolution takes it): 16 lanes at a time by the convolution tiles' own act16 where
   the build has AVX-512 (audio_conv1d's GELU after its GroupNorm had run 8 lanes at a time),
   the rest (and every other build) by finish(). */
static void act_pass(float *p, int64_t n, int64_t kind, const float *a) {
    int64_t i = 0;
#if defined(__AVX512F__)
    if (act16_takes(kind))
        for (; i + 16 <= n; i += 16)
            _mm512_storeu_ps(p + i, act16(_mm512_loadu_ps(p + i), kind, a));
#endif
    finish(p + i, 0, n - i, kind, a);
}

typedef float v4f __attribute__((vector_size(16), aligned(4)));
typedef double v4d __attribute__((vector_size(32)));

/* The sum of n floats in double, and of their squared distances to mean: four partial sums (a
   chain of adds a quarter as long as one sum's). */
static inline double sum4(const float *restrict x, int64_t n) {
    v4d s = {0.0, 0.0, 0.0, 0.0};
    int64_t k = 0;
    for (; k + 4 <= n; k += 4) s += __builtin_convertvector(*(const v4f *)(x + k), v4d);
    double total = (s[0] + s[1]) + (s[2] + s[3]);
    for (; k < n; ++k) total += x[k];
    return total;
}

static inline double dev4(const float *restrict x, int64_t n, double mean) {
    v4d s = {0.0, 0.0, 0.0, 0.0};
    int64_t k = 0;
    for (; k + 4 <= n; k += 4) {
        const v4d d = __builtin_convertvector(*(const v4f *)(x + k), v4d) - mean;
        s += d * d;
    }
    double total = (s[0] + s[1]) + (s[2] + s[3]);
    for (; k < n; ++k) total += ((double)x[k] - mean) * ((double)x[k] - mean);
    return total;
}

/* OP_ROWNORM: F_N rows of F_C contiguous floats at F_IN (a transposed line's channels-last rows)
   each normalized (mean and variance in double; a NaN or an infinity in a row makes it NaN, as
   lnorm's), times the scale at F_WOFF plus the bias at F_BOFF (epsilon at F_AOFF); where F_OC,
   then times the [F_C][F_OC] weight at F_X2 plus its bias at F_PH, four rows at a time and 8
   outputs a register (each output's sum in k's order, as linear's), then F_ACT (its numbers at
   F_PW). Why: lnorm by a table, then linear's row at a time through memory had been 2.4 us of
   audio_conv1d's 7.9 (19 rows of 16 into 24). */
static void rownorm(const int64_t *f, float *A, const float *P) {
    const int64_t rows = f[F_N], C = f[F_C], OC = f[F_OC];
    const float eps = P[f[F_AOFF]], *restrict scale = P + f[F_WOFF], *restrict shift = P + f[F_BOFF];
    const float *restrict x = A + f[F_IN], *restrict w = P + f[F_X2], *restrict bias = P + f[F_PH];
    float *restrict y = A + f[F_OUT];
    float t[4 * C];
    for (int64_t r0 = 0; r0 < rows; r0 += 4) {
        const int64_t R = rows - r0 < 4 ? rows - r0 : 4;
        for (int64_t i = 0; i < 4; ++i) {
            float *restrict tr = OC ? t + i * C : y + (r0 + i) * C;
            if (i >= R) {
                if (OC) memset(tr, 0, sizeof(float) * (size_t)C);
                continue;
            }
            const float *restrict xr = x + (r0 + i) * C;
            const double mean = sum4(xr, C) / (double)C, dev = dev4(xr, C, mean);
            const float m = (float)mean, inv = (float)(1.0 / sqrt(dev / (double)C + eps));
            for (int64_t k = 0; k < C; ++k) tr[k] = (xr[k] - m) * inv * scale[k] + shift[k];
        }
        if (!OC) continue;
        int64_t j = 0;
        for (; j + 8 <= OC; j += 8) {
            v8 acc0 = vload(bias + j), acc1 = acc0, acc2 = acc0, acc3 = acc0;
            for (int64_t k = 0; k < C; ++k) {
                const v8 wk = vload(w + k * OC + j);
                acc0 = vfma(vsplat(t[k]), wk, acc0);
                acc1 = vfma(vsplat(t[C + k]), wk, acc1);
                acc2 = vfma(vsplat(t[2 * C + k]), wk, acc2);
                acc3 = vfma(vsplat(t[3 * C + k]), wk, acc3);
            }
            const v8 acc[4] = {acc0, acc1, acc2, acc3};
            for (int64_t i = 0; i < R; ++i) vstore(y + (r0 + i) * OC + j, acc[i]);
        }
        for (; j < OC; ++j)
            for (int64_t i = 0; i < R; ++i) {
                float o = bias[j];
                for (int64_t k = 0; k < C; ++k) o = fmaf(t[i * C + k], w[k * OC + j], o);
                y[(r0 + i) * OC + j] = o;
            }
    }
    if (OC) act_pass(y, rows * OC, f[F_ACT], P + f[F_PW]);
}
