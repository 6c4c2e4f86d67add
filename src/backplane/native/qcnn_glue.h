/* The int8 plan's elementwise records, by ranges of values (the crew's items, qcnn_pool.h):
   QuantizeLinear and DequantizeLinear (qcnn_bytes.h's quantize, dequantize), the float glue
   (add_f, addc_f, hsig_f, mul_f, relu_f) and the byte glue qcnn_lookup.py makes of chains of
   them: lut8, a single-source chain as a 256-byte table, and qadd8, a residual Add of two byte
   tensors in one pass. Each value's operations are the same wherever a range starts, so a
   record split across threads writes the one-thread run's values. Included once by qcnn.c
   (its F_* fields and OP_* codes, after qcnn_bytes.h and qcnn_float.h). */

/* y[i] = table[x[i]] (OP_LUT8: qcnn_lookup.py's tables, a chain of float glue between two
   byte tensors): with AVX-512 VBMI 64 bytes by two vpermi2b over the table's halves (a byte's
   low 7 bits index one) and a blend by its top bit. */
static void lookup_bytes(const uint8_t *restrict x, uint8_t *restrict y, int64_t n,
                         const uint8_t *table) {
    int64_t i = 0;
#if defined(__AVX512VBMI__) && defined(__AVX512BW__)
    const __m512i t0 = _mm512_loadu_si512((const void *)table);
    const __m512i t1 = _mm512_loadu_si512((const void *)(table + 64));
    const __m512i t2 = _mm512_loadu_si512((const void *)(table + 128));
    const __m512i t3 = _mm512_loadu_si512((const void *)(table + 192));
    for (; i + 64 <= n; i += 64) {
        const __m512i v = _mm512_loadu_si512((const void *)(x + i));
        const __m512i lo = _mm512_permutex2var_epi8(t0, v, t1);
        const __m512i hi = _mm512_permutex2var_epi8(t2, v, t3);
        _mm512_storeu_si512((void *)(y + i), _mm512_mask_blend_epi8(_mm512_movepi8_mask(v), lo, hi));
    }
#endif
    for (; i < n; ++i) y[i] = table[x[i]];
}

/* y = quantize(dequantize(a) + dequantize(b)) in one pass (OP_QADD8: qcnn_lookup.py's sums, a
   residual Add between byte tensors): dequantize's, the sum's and quantize's float32 operations
   in their order, bit for bit the three records'. s: a's, b's and y's scales; z: a's and b's
   zero points, then whether each is signed. */
static void qadd_bytes(const uint8_t *a, const uint8_t *b, uint8_t *restrict y, int64_t n,
                       const float *s, const int32_t *z, int32_t zy, int32_t lo, int32_t hi) {
    const float fl = (float)(lo - zy), fh = (float)(hi - zy);
    int64_t i = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
    const __m512i za = _mm512_set1_epi32(z[0]), zb = _mm512_set1_epi32(z[1]);
    const __m512 sa = _mm512_set1_ps(s[0]), sb = _mm512_set1_ps(s[1]), sy = _mm512_set1_ps(s[2]);
    for (; i + 16 <= n; i += 16) {
        const __m128i ka = _mm_loadu_si128((const __m128i *)(a + i));
        const __m128i kb = _mm_loadu_si128((const __m128i *)(b + i));
        const __m512 va = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(
            z[2] ? _mm512_cvtepi8_epi32(ka) : _mm512_cvtepu8_epi32(ka), za)), sa);
        const __m512 vb = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(
            z[3] ? _mm512_cvtepi8_epi32(kb) : _mm512_cvtepu8_epi32(kb), zb)), sb);
        __m512 v = _mm512_div_ps(_mm512_add_ps(va, vb), sy);
        v = _mm512_min_ps(_mm512_max_ps(v, _mm512_set1_ps(fl)), _mm512_set1_ps(fh));
        _mm_storeu_si128((__m128i *)(y + i), _mm512_cvtepi32_epi8(_mm512_add_epi32(
                                                  _mm512_cvtps_epi32(v), _mm512_set1_epi32(zy))));
    }
#endif
    for (; i < n; ++i) {
        const int32_t ka = z[2] ? (int32_t)(int8_t)a[i] : (int32_t)a[i];
        const int32_t kb = z[3] ? (int32_t)(int8_t)b[i] : (int32_t)b[i];
        const float va = (float)(ka - z[0]) * s[0], vb = (float)(kb - z[1]) * s[1];
        float v = (va + vb) / s[2];
        v = v > fl ? v : fl;
        v = v < fh ? v : fh;
        y[i] = (uint8_t)((int32_t)nearbyintf(v) + zy);
    }
}

enum { CHUNK = 16384 }; /* values an item of an elementwise record's job */

static int64_t eltwise_items(const int64_t *r) {
    return (r[F_N] * r[F_C] * r[F_H] * r[F_W] + CHUNK - 1) / CHUNK;
}

/* Values [begin * CHUNK, end * CHUNK) of an elementwise record (quant, dequant, add_f, addc_f,
   hsig_f, mul_f, relu_f, lut8, qadd8): each value's operations are the same wherever the range starts. */
static void eltwise_part(const int64_t *r, const uint8_t *params, uint8_t *arena, int64_t begin,
                         int64_t end) {
    const int64_t c = r[F_C], count = r[F_N] * c * r[F_H] * r[F_W];
    const int64_t lo = begin * CHUNK, m = (end * CHUNK < count ? end * CHUNK : count) - lo;
    const float *fp = (const float *)params;
    const float *a = (const float *)(arena + r[F_IN]) + lo;
    float *y = (float *)(arena + r[F_OUT]) + lo;
    switch (r[F_OP]) {
    case OP_QUANT:
        quantize(a, arena + r[F_OUT] + lo, m, fp[r[F_MOFF] / 4], (int32_t)r[F_ZY],
                 (int32_t)r[F_LO], (int32_t)r[F_HI], (int)r[F_SIGNED]);
        break;
    case OP_DEQUANT:
        dequantize(arena + r[F_IN] + lo, y, m, fp[r[F_MOFF] / 4], (int32_t)r[F_ZX],
                   (int)r[F_SIGNED], (int)r[F_X1]);
        break;
    case OP_ADD_F: {
        const float *b = (const float *)(arena + r[F_IN2]) + lo;
        for (int64_t i = 0; i < m; ++i) y[i] = a[i] + b[i];
        break;
    }
    case OP_ADDC_F: { /* a constant per channel (or one) */
        const float *k = fp + r[F_BOFF] / 4;
        if (r[F_X1] == 1) /* the constant's length: c or 1 */
            for (int64_t i = 0; i < m; ++i) y[i] = a[i] + k[0];
        else
            for (int64_t i = 0; i < m; ++i) y[i] = a[i] + k[(lo + i) % c];
        break;
    }
    case OP_HSIG_F: /* alpha, beta at moff */
        hard_sigmoid(a, y, m, fp[r[F_MOFF] / 4], fp[r[F_MOFF] / 4 + 1]);
        break;
    case OP_MUL_F:
        mul_f(a, (const float *)(arena + r[F_IN2]) + lo, y, m);
        break;
    case OP_RELU_F:
        for (int64_t i = 0; i < m; ++i) y[i] = a[i] < 0.0f ? 0.0f : a[i];
        break;
    case OP_LUT8:
        lookup_bytes(arena + r[F_IN] + lo, arena + r[F_OUT] + lo, m, params + r[F_WOFF]);
        break;
    case OP_QADD8:
        qadd_bytes(arena + r[F_IN] + lo, arena + r[F_IN2] + lo, arena + r[F_OUT] + lo, m,
                   fp + r[F_MOFF] / 4, (const int32_t *)(params + r[F_WOFF]), (int32_t)r[F_ZY],
                   (int32_t)r[F_LO], (int32_t)r[F_HI]);
        break;
    }
}

