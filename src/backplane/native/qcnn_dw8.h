/* A depthwise quantized convolution on bytes (OP_QDW8): the input padded as unsigned bytes (the
   pads hold its zero point, qcnn_bytes.h's pad_rows), the weights centred as signed bytes, four
   taps' u8 x s8 products an int32 lane with vpdpbusd.

   Why: qdwconv widens the input to int16 and multiplies two taps of 16 channels an instruction
   (vpdpwssd), after a permute of each pair of loads: the full tier's MobileNet spent 0.86 of its
   2.8 ms a run (1 thread) in its four depthwise layers. Here four 64-byte loads (64 channels, four
   taps) become, by two rounds of byte and word unpacking within each 128-bit lane, four vectors
   of 16 channels' four taps each, for four vpdpbusd: 256 products in 12 instructions; the 64
   channels' sums come back in channel order by eight 128-bit shuffles a pixel, then
   requantize16. The weights are packed in that order at load (qcnn_bytes.py's pack_depthwise).

   Exact, the same sums as qdwconv: sum (x - zx) w = sum x w - zx sum w, the pads hold zx, the
   correction folded into the int32 bias at load. A scalar path for builds without VNNI (the plan
   takes this record only where the library has it; the tests run it on every build). Included
   once by qcnn.c, after qcnn_bytes.h. */

enum { DW8 = 64 }; /* channels a weight group */

/* The weight of channel k, tap t, in the packed layout [groups][quads][4][64]. */
static inline int32_t dw8_weight(const int8_t *w, int64_t quads, int64_t k, int64_t t) {
    const int64_t g = k / DW8, lane = (k % DW8) / 16, r = (k % 16) / 4, j = k % 4;
    return w[((g * quads + t / 4) * 4 + r) * 64 + lane * 16 + j * 4 + t % 4];
}

#if defined(BYTES_VNNI)
/* Group g's 64 channels of ow output pixels of one row (corners at `corner` + ox * step): with Q
   a constant (a 3x3 kernel's 3 quads, inlined) the group's weights are loaded once into
   registers; Q 0: `quads` of them, loaded a pixel. Per pixel four loads, unpacking and four
   vpdpbusd a quad, the shuffles to channel order, requantize16. */
static inline __attribute__((always_inline)) void dw8_span(
    const uint8_t *corner, int64_t step, int64_t ow, const int64_t *at, const int8_t *wq,
    int64_t quads, uint8_t *out, int64_t c, int64_t g, const Requant *rq, const int Q) {
    __m512i wv[12];
#pragma GCC unroll 12
    for (int v = 0; v < 4 * Q; ++v) wv[v] = _mm512_loadu_si512((const void *)(wq + 64 * v));
    const int64_t nq = Q ? Q : quads;
    for (int64_t ox = 0; ox < ow; ++ox) {
        const uint8_t *p = corner + ox * step + g * DW8;
        __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
#pragma GCC unroll 3
        for (int64_t q = 0; q < nq; ++q) {
            const __m512i x0 = _mm512_loadu_si512((const void *)(p + at[4 * q]));
            const __m512i x1 = _mm512_loadu_si512((const void *)(p + at[4 * q + 1]));
            const __m512i x2 = _mm512_loadu_si512((const void *)(p + at[4 * q + 2]));
            const __m512i x3 = _mm512_loadu_si512((const void *)(p + at[4 * q + 3]));
            const __m512i l01 = _mm512_unpacklo_epi8(x0, x1), h01 = _mm512_unpackhi_epi8(x0, x1);
            const __m512i l23 = _mm512_unpacklo_epi8(x2, x3), h23 = _mm512_unpackhi_epi8(x2, x3);
            const int8_t *w = wq + 256 * q;
#define DW8_W(v) (Q ? wv[4 * q + (v)] : _mm512_loadu_si512((const void *)(w + 64 * (v))))
            a0 = _mm512_dpbusd_epi32(a0, _mm512_unpacklo_epi16(l01, l23), DW8_W(0));
            a1 = _mm512_dpbusd_epi32(a1, _mm512_unpackhi_epi16(l01, l23), DW8_W(1));
            a2 = _mm512_dpbusd_epi32(a2, _mm512_unpacklo_epi16(h01, h23), DW8_W(2));
            a3 = _mm512_dpbusd_epi32(a3, _mm512_unpackhi_epi16(h01, h23), DW8_W(3));
#undef DW8_W
        }
        /* a_r's lane L holds channels 16 L + 4 r + (0..3): lane L of each, in order */
        const __m512i t0 = _mm512_shuffle_i32x4(a0, a1, 0x44), t1 = _mm512_shuffle_i32x4(a2, a3, 0x44);
        const __m512i t2 = _mm512_shuffle_i32x4(a0, a1, 0xEE), t3 = _mm512_shuffle_i32x4(a2, a3, 0xEE);
        const __m512i o[4] = {_mm512_shuffle_i32x4(t0, t1, 0x88), _mm512_shuffle_i32x4(t0, t1, 0xDD),
                              _mm512_shuffle_i32x4(t2, t3, 0x88), _mm512_shuffle_i32x4(t2, t3, 0xDD)};
        for (int lane = 0; lane < 4; ++lane) {
            if (g * DW8 + lane * 16 >= c) break;
            requantize16(o[lane], &rq[lane], out + ox * c + g * DW8 + lane * 16);
        }
    }
}
#endif

/* Output rows [begin, end) of n * oh, the input padded into the scratch as bytes. */
static void qdw8_part(const int64_t *r, const uint8_t *params, uint8_t *arena, int64_t begin,
                      int64_t end) {
    const int64_t c = r[F_C], oh = r[F_OH], ow = r[F_OW], kh = r[F_KH], kw = r[F_KW];
    const int64_t sh = r[F_SH], sw = r[F_SW], dh = r[F_DH], dw = r[F_DW], ph = r[F_PH];
    const int64_t pw = r[F_PW], taps = kh * kw, quads = (taps + 3) / 4, groups = (c + DW8 - 1) / DW8;
    const uint8_t *s = arena + r[F_SCR];
    const int8_t *weights = (const int8_t *)(params + r[F_WOFF]);
    const int32_t *bias = (const int32_t *)(params + r[F_BOFF]);
    const float *mult = (const float *)(params + r[F_MOFF]);
    const float *fb = r[F_IN2] >= 0 ? (const float *)(params + r[F_IN2]) : 0; /* a float bias */
    const int64_t blocks = (c + OCB - 1) / OCB;
    uint8_t *y = arena + r[F_OUT];
    float fl, fh;
    bounds(r, params, &fl, &fh);
    int64_t at[4 * quads]; /* each tap's offset from the window's corner; past the last, the last */
    for (int64_t t = 0; t < 4 * quads; ++t) {
        const int64_t tap = t < taps ? t : taps - 1;
        at[t] = ((tap / kw) * dh * pw + (tap % kw) * dw) * c;
    }
    for (int64_t row = begin; row < end; ++row) {
        const int64_t b = row / oh, oy = row % oh;
        const uint8_t *first = s + (b * ph + oy * sh) * pw * c; /* the corner of ox 0 */
        uint8_t *row_out = y + (b * oh + oy) * ow * c;
#if defined(BYTES_VNNI)
        for (int64_t g = 0; g < groups; ++g) {
            Requant rq[4]; /* the group's four blocks of 16 (past c: the first's, unused) */
            for (int lane = 0; lane < 4; ++lane) {
                const int64_t k = g * DW8 + lane * 16 < c ? g * DW8 + lane * 16 : g * DW8;
                rq[lane] = (Requant){bias + k, mult + k, fb ? fb + blocks * OCB + k : 0,
                                     fb ? fb + k : 0, fb ? fb[2 * blocks * OCB] : 0.0f, fl, fh,
                                     (int32_t)r[F_ZY], c - k < 16 ? c - k : 16, r[F_LO] < 0};
            }
            const int8_t *wq = weights + g * quads * 256;
            if (quads == 3)
                dw8_span(first, sw * c, ow, at, wq, quads, row_out, c, g, rq, 3);
            else
                dw8_span(first, sw * c, ow, at, wq, quads, row_out, c, g, rq, 0);
        }
#else
        (void)groups;
        for (int64_t ox = 0; ox < ow; ++ox) {
            const uint8_t *corner = first + ox * sw * c;
            uint8_t *out = row_out + ox * c;
            for (int64_t k0 = 0; k0 < c; k0 += OCB) {
                const int64_t count = c - k0 < OCB ? c - k0 : OCB;
                uint32_t sum[OCB] = {0}; /* unsigned: wraps as vpdpbusd's (within int32 anyway) */
                for (int64_t j = 0; j < count; ++j)
                    for (int64_t t = 0; t < taps; ++t)
                        sum[j] += (uint32_t)((int32_t)corner[at[t] + k0 + j] *
                                             dw8_weight(weights, quads, k0 + j, t));
                int32_t acc[OCB];
                for (int j = 0; j < OCB; ++j) acc[j] = (int32_t)sum[j];
                if (fb) {
                    for (int64_t j = 0; j < count; ++j) acc[j] += bias[k0 + j];
                    requantize_f(acc, fb + k0, fb + blocks * OCB + k0, fb[2 * blocks * OCB],
                                 out + k0, count, (int32_t)r[F_ZY], fl, fh);
                } else
                    requantize(acc, mult + k0, bias + k0, out + k0, count, (int32_t)r[F_ZY], fl,
                               fh, r[F_LO] < 0);
            }
        }
#endif
    }
}

static void qdw8(const int64_t *r, const uint8_t *params, uint8_t *arena) {
    pad_part(r, params, arena, 0, r[F_N] * r[F_PH]);
    qdw8_part(r, params, arena, 0, r[F_N] * r[F_OH]);
}
