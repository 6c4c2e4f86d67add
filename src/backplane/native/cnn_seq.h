/* cnn.c's records for a sequence model's first layers (cnn_seq.py plans them): integer and bool
   inputs imported as the arena's floats, and an embedding's Gather of a constant table by those
   indices. Included once, by cnn.c, after cnn_detect.h.

   Why: a byte classifier (bytes_int32_dyn20) reads int32 bytes and a bool mask; its Gather of the
   embedding table, the mask's Cast and Mul and the Transpose to (N, C, L) had kept the partition
   traced (its convolutions and gate too), ~10 torch calls around ~5 us of moves. Here the lookup,
   the mask and the transpose are one pass over the rows. */
enum { OP_EMBED = 27 };
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
