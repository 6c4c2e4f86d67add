/* cnn.c's convolutions: dense and grouped (register tiles of 6 x 16 or 8 x 8 over flat runs of
   output pixels, weights packed at load; on AVX-512 cnn_conv512.h's 16-lane tiles, 14 x 16,
   12 x 32, 8 x 48 and 12 x (8 channels x 2 taps), the library saying its width to the packer:
   backplane_cnn_vector_width) and depthwise (row by row, 3x3 weights in registers).
   Included once, by cnn.c, after its record fields, vector helpers and finish(): one translation
   unit (the build keys a library by this header too). Why the tiles are shaped so:
   docs/torch-backends.md, "The native CNN route". */
/* The input copied into a zeroed frame of PH x PW pixels at (PT, PL): the convolution then reads
   its windows without a bounds check. */
static void pad_frame(const int64_t *f, const float *restrict x, float *restrict y) {
    const int64_t N = f[F_N], H = f[F_H], W = f[F_W], C = f[F_C], PH = f[F_PH], PW = f[F_PW];
    const int64_t PT = f[F_PT], PL = f[F_PL];
    const size_t row = sizeof(float) * PW * C, side = sizeof(float) * PL * C;
    const size_t rest = sizeof(float) * (PW - PL - W) * C;
    for (int64_t n = 0; n < N; ++n) {
        float *frame = y + n * PH * PW * C;
        memset(frame, 0, row * PT);  /* only the border is zeroed: the input overwrites the rest */
        for (int64_t h = 0; h < H; ++h) {
            float *line = frame + (h + PT) * PW * C;
            memset(line, 0, side);
            memcpy(line + PL * C, x + (n * H + h) * W * C, sizeof(float) * W * C);
            memset(line + (PL + W) * C, 0, rest);
        }
        memset(frame + (H + PT) * PW * C, 0, row * (PH - H - PT));
    }
}

/* The epilogue in registers: residual (where r), then ReLU or Clip (lo and hi: 0 for ReLU);
   finish()'s steps, NaN kept (a NaN compares false). */
static inline __attribute__((always_inline)) v8 epilogue(v8 x, const float *r, int64_t act,
                                                        v8 lo, v8 hi) {
    if (r) x += vload(r);
    if (act == ACT_RELU || act == ACT_CLIP) x = vselect(x < lo, lo, x);
    if (act == ACT_CLIP) x = vselect(x > hi, hi, x);
    return x;
}

/* pb output pixels (each its own window origin ip[r]: a tile may cross rows) by 8 * nv (8 or 16)
   output channels of one group: the register tile (6 x 16 or 8 x 8: 12 or 8 accumulators of the
   16 AVX registers, the FMAs, not the loads, the bound). The taps run as KH x KW x inner, where
   inner is ICG, or KW * ICG with KW 1 where a window's row is contiguous (groups 1, dilation 1:
   the packed weights' [kw][ic] order is the input's). The weights' rows are VB floats apart (the
   block's width: 8 * nv, or a wider block's 16-lane part where this build has no AVX-512). The
   epilogue (residual, ReLU or Clip) in registers where `fused`; else finish() passes over the
   chunk after. */
enum { PB_MAX = 8 };
static inline __attribute__((always_inline)) void tile(
    int nv, int pb, const float *const *ip, int64_t rowstep, int64_t colstep, int64_t KH,
    int64_t KW, int64_t inner, const float *restrict wk, const float *restrict bk,
    float *restrict op, int64_t OC, int64_t pixels, int64_t valid, int fused,
    const float *restrict res, int64_t act, const float *a, int64_t VB) {
    const int64_t lanes = 8 * nv;
    v8 a0[PB_MAX], a1[PB_MAX];
    const float *p[PB_MAX];
    for (int r = 0; r < pb; ++r) {
        p[r] = ip[r];
        a0[r] = vload(bk);
        a1[r] = nv > 1 ? vload(bk + 8) : vsplat(0.0f);
    }
    const float *w = wk;
    int64_t kh = 0;
    do {  /* do-while: at least one tap and channel, so the accumulators stay in registers */
        int64_t kw = 0;
        do {
            const int64_t at = kh * rowstep + kw * colstep;
            int64_t ic = 0;
            do {
                const v8 w0 = vload(w), w1 = nv > 1 ? vload(w + 8) : vsplat(0.0f);
                for (int r = 0; r < pb; ++r) {
                    const v8 xr = vsplat(p[r][at + ic]);
                    a0[r] = vfma(xr, w0, a0[r]);
                    if (nv > 1) a1[r] = vfma(xr, w1, a1[r]);
                }
                w += VB;
            } while (++ic < inner);
        } while (++kw < KW);
    } while (++kh < KH);
    if (fused) {  /* valid == lanes here; pb, not pixels: unrolled, in registers */
        const v8 lo = vsplat(act == ACT_CLIP ? a[0] : 0.0f),
                 hi = vsplat(act == ACT_CLIP ? a[1] : 0.0f);
        for (int r = 0; r < pb; ++r)
            if (r < pixels) {
                a0[r] = epilogue(a0[r], res ? res + r * OC : 0, act, lo, hi);
                if (nv > 1) a1[r] = epilogue(a1[r], res ? res + r * OC + 8 : 0, act, lo, hi);
            }
    }
    if (valid == lanes && pixels == pb) {
        for (int r = 0; r < pb; ++r) {
            vstore(op + r * OC, a0[r]);
            if (nv > 1) vstore(op + r * OC + 8, a1[r]);
        }
        return;
    }
    float t[16];
    for (int64_t r = 0; r < pixels; ++r) {
        vstore(t, a0[r]);
        if (nv > 1) vstore(t + 8, a1[r]);
        for (int64_t j = 0; j < valid; ++j) op[r * OC + j] = t[j];
    }
}

#if defined(__AVX512F__)
#include "cnn_conv512.h"
#endif

/* The vector width the convolutions' weights are packed for (cnn_layers.py asks the library):
   16 where this build has AVX-512 (blocks of 16, 32 or 48 output channels), else 8 (blocks of 8
   or 16). Either build runs a plan packed for the other: a block of 32 or 48 runs here as 16-lane
   parts, 8 as 8. */
int backplane_cnn_vector_width(void) {
#if defined(__AVX512F__)
    return 16;
#else
    return 8;
#endif
}

enum { PB_ALL = 14 };  /* the most pixels a tile takes in either build */

/* Whether this build runs a block of `taps` taps a lane group (cnn_conv512.h's tile_pairs, 2;
   tile_quads, 4) in registers; else one pixel at a time (taps_by_one). */
static inline int taps_in_registers(int64_t taps) {
#if defined(__AVX512VL__)
    return taps == 2 || taps == 4;
#elif defined(__AVX512F__)
    return taps == 2;
#else
    return (void)taps, 0;
#endif
}

/* The pixels a tile of VB output channels (or of `taps` taps a lane group) takes in this build. */
static inline int64_t tile_pixels(int64_t VB, int64_t taps) {
#if defined(__AVX512F__)
    if (taps) return taps_in_registers(taps) ? PB2 : 1;
    return VB == 8 ? 8 : VB == 16 ? 14 : VB == 32 ? 12 : 8;
#else
    return taps ? 1 : VB == 8 ? 8 : 6;
#endif
}

/* A block of taps in lane groups (cnn_conv512.h's tile_pairs, tile_quads) one pixel at a time,
   in a build that has not those tiles (a plan packed for one that has): each output channel's
   sums of the taps t = e mod `taps`, then their sum. */
static void taps_by_one(int64_t taps, const float *x, int64_t rowstep, int64_t colstep,
                        int64_t KH, int64_t KW, int64_t inner, const float *restrict wk,
                        const float *restrict bk, float *restrict o, int64_t valid) {
    const int64_t step = (inner + taps - 1) / taps * 16;
    for (int64_t c = 0; c < valid; ++c) {
        float s[4] = {bk[taps * c], 0.0f, 0.0f, 0.0f};
        for (int64_t kh = 0; kh < KH; ++kh)
            for (int64_t kw = 0; kw < KW; ++kw) {
                const float *w = wk + (kh * KW + kw) * step + taps * c;
                const float *xt = x + kh * rowstep + kw * colstep;
                for (int64_t t = 0; t < inner; ++t)
                    s[t % taps] = fmaf(xt[t], w[t / taps * 16 + t % taps], s[t % taps]);
            }
        o[c] = (s[0] + s[1]) + (s[2] + s[3]);
    }
}

/* One tile of pixels by one block of VB output channels: the build's widest tile for it. */
static inline __attribute__((always_inline)) void block(
    int64_t VB, int64_t taps, const float *const *ip, int64_t rowstep, int64_t colstep, int64_t KH,
    int64_t KW, int64_t inner, const float *restrict wk, const float *restrict bk,
    float *restrict op, int64_t OC, int64_t pixels, int64_t valid, int fused,
    const float *restrict res, int64_t act, const float *a) {
    if (taps) {
#if defined(__AVX512F__)
        if (taps == 2) {
            tile_pairs(ip, rowstep, colstep, KH, KW, inner, wk, bk, op, OC, pixels, valid, fused,
                       res, act, a);
            return;
        }
#endif
#if defined(__AVX512VL__)
        tile_quads(ip, rowstep, colstep, KH, KW, inner, wk, bk, op, OC, pixels, valid, fused,
                   res, act, a);
        return;
#endif
        taps_by_one(taps, ip[0], rowstep, colstep, KH, KW, inner, wk, bk, op, valid);
        return;
    }
    if (VB == 8) {
        tile(1, 8, ip, rowstep, colstep, KH, KW, inner, wk, bk, op, OC, pixels, valid, fused, res,
             act, a, 8);
        return;
    }
#if defined(__AVX512F__)
    if (VB == 16)
        tile16(1, 14, ip, rowstep, colstep, KH, KW, inner, wk, bk, op, OC, pixels, valid, fused,
               res, act, a);
    else if (VB == 32)
        tile16(2, 12, ip, rowstep, colstep, KH, KW, inner, wk, bk, op, OC, pixels, valid, fused,
               res, act, a);
    else
        tile16(3, 8, ip, rowstep, colstep, KH, KW, inner, wk, bk, op, OC, pixels, valid, fused,
               res, act, a);
#else
    for (int64_t h = 0; h < VB && h < valid; h += 16)  /* 16 lanes of the block at a time */
        tile(2, 6, ip, rowstep, colstep, KH, KW, inner, wk + h, bk + h, op + h, OC, pixels,
             valid - h < 16 ? valid - h : 16, fused, res ? res + h : 0, act, a, VB);
#endif
}

/* finish() after a chunk of pixels, while they are in L1: 48 (a multiple of the AVX2 tiles' 6 and
   8), or 4 tiles of the AVX-512 tile's 14, 12 or 8 */
#if defined(__AVX512F__)
static inline int64_t chunk_of(int64_t pb) { return 4 * pb; }
#else
static inline int64_t chunk_of(int64_t pb) { return (void)pb, 48; }
#endif

/* A convolution's output pixels come in chunks (finish() runs after each, while its rows are in
   L1): the pool's items (cnn_pool.h). */
static int64_t conv_chunk(const int64_t *f) {
    return chunk_of(tile_pixels(f[F_VB], f[F_X1]));
}

static int64_t conv_items(const int64_t *f) {
    const int64_t chunk = conv_chunk(f);
    return (f[F_N] * f[F_OH] * f[F_OW] + chunk - 1) / chunk;
}

/* The padded frame a convolution reads (before any chunk of it runs). */
static void conv_frame(const int64_t *f, float *A) {
    if (f[F_SCR] >= 0) pad_frame(f, A + f[F_IN], A + f[F_SCR]);
}

/* A convolution of any groups, its weights packed per group and block of VB output channels as
   [kh][kw][ic][VB] (zero past the group's channels), over a padded frame or the input itself:
   chunks [c0, c1) of its output pixels. The output's pixels are taken flat (n, oh, ow in order)
   in tiles of the block's pixels, each pixel's window origin its own: a short row (8x8's 8) no
   longer wastes a tile's width. */
static void conv_part(const int64_t *f, float *A, const float *P, int64_t c0, int64_t c1) {
    const int64_t N = f[F_N], C = f[F_C], OH = f[F_OH], OW = f[F_OW], OC = f[F_OC];
    const int64_t KH = f[F_KH], KW = f[F_KW], SH = f[F_SH], SW = f[F_SW], DH = f[F_DH],
                  DW = f[F_DW], G = f[F_G], VB = f[F_VB], PH = f[F_PH], PW = f[F_PW];
    const int64_t ICG = C / G, OCG = OC / G, NB = (OCG + VB - 1) / VB, act = f[F_ACT];
    const float *src = A + (f[F_SCR] >= 0 ? f[F_SCR] : f[F_IN]);
    float *out = A + f[F_OUT];
    const float *res = f[F_IN2] >= 0 ? A + f[F_IN2] : 0;
    const float *a = P + f[F_AOFF];
    const int64_t rowstep = DH * PW * C, colstep = DW * C;
    const int merged = G == 1 && DW == 1;  /* a window's row contiguous: kw and ic as one loop */
    const int64_t KWo = merged ? 1 : KW, inner = merged ? KW * ICG : ICG;
    const int64_t taps = f[F_X1];  /* taps a lane group: 2 or 4 (cnn_conv512.h), else 0 */
#if defined(__AVX512F__)
    /* the 16-lane tiles apply any act16_takes in registers; taps in lane groups with fewer than
       8 useful lanes only the cheap ones (an exp for 4 useful lanes of 16: finish's 8 a win) */
    const int cheap = act == ACT_NONE || act == ACT_RELU || act == ACT_CLIP || act == ACT_LEAKY;
    const int fused = taps ? taps_in_registers(taps) && act16_takes(act) &&
                             (OCG * taps >= 8 || cheap) :
                      VB != 8 ? act16_takes(act) : OCG % VB == 0 && cheap && act != ACT_LEAKY;
#else
    const int fused = !taps && OCG % VB == 0 &&
                      (act == ACT_NONE || act == ACT_RELU || act == ACT_CLIP);
#endif
    const int64_t pb = tile_pixels(VB, taps), total = N * OH * OW, chunk = chunk_of(pb);
    const int64_t wblock = taps ? KH * KWo * ((inner + taps - 1) / taps) * 16 : KH * KW * ICG * VB,
                  bblock = taps ? 16 : VB;
    const float *ip[PB_ALL];
    const int64_t first = c0 * chunk;
    int64_t n = first / (OH * OW), oh = first / OW % OH, ow = first % OW;  /* the next tile's */
    const int64_t last = c1 * chunk < total ? c1 * chunk : total;
    for (int64_t q0 = first; q0 < last; q0 += chunk) {
        const int64_t q1 = total - q0 < chunk ? total : q0 + chunk;
        for (int64_t q = q0, pixels; q < q1; q += pixels) {
            pixels = q1 - q < pb ? q1 - q : pb;
            const float *at = src + ((n * PH + oh * SH) * PW + ow * SW) * C;
            for (int64_t r = 0; r < pb; ++r) {  /* past the last pixel: the last one's again */
                ip[r] = at;
                if (r + 1 < pixels) {
                    if (++ow == OW) {
                        ow = 0;
                        if (++oh == OH) oh = 0, ++n;
                        at = src + ((n * PH + oh * SH) * PW) * C;
                    } else
                        at += SW * C;
                }
            }
            if (++ow == OW) {
                ow = 0;
                if (++oh == OH) oh = 0, ++n;
            }
            for (int64_t g = 0; g < G; ++g) {
                const float *gp[PB_ALL];
                for (int64_t r = 0; r < pb; ++r) gp[r] = ip[r] + g * ICG;
                for (int64_t b = 0; b < NB; ++b) {
                    const float *wk = P + f[F_WOFF] + (g * NB + b) * wblock;
                    const float *bk = P + f[F_BOFF] + (g * NB + b) * bblock;
                    const int64_t oc0 = g * OCG + b * VB;
                    const int64_t valid = OCG - b * VB < VB ? OCG - b * VB : VB;
                    block(VB, taps, gp, rowstep, colstep, KH, KWo, inner, wk, bk,
                          out + q * OC + oc0, OC, pixels, valid, fused,
                          fused && res ? res + q * OC + oc0 : 0, act, a);
                }
            }
        }
        if (!fused)
            finish(out + q0 * OC, res ? res + q0 * OC : 0, (q1 - q0) * OC, act, a);
    }
}

static void conv(const int64_t *f, float *A, const float *P) {
    conv_frame(f, A);
    conv_part(f, A, P, 0, conv_items(f));
}

/* np adjacent output pixels of a depthwise row from ow, by 8 channels (c), their windows inside
   the input's columns; w: the K x K weights in registers (K 3), else read from wt. FMAs in
   CpuRef's order: bias, then kh, kw. */
static inline __attribute__((always_inline)) void dwtile(
    int K, int np, int64_t ow, const float *irow, float *orow, const float *rrow, const v8 *w,
    const float *restrict wt, v8 b, int64_t c, int64_t C, int64_t SW, int64_t PL, int64_t KW,
    int64_t DW, int64_t rowstep, int64_t kh0, int64_t kh1, int fused, int64_t act,
    v8 lo, v8 hi) {
    const int64_t xs = SW * C, colstep = DW * C;
    const float *ip = irow + (ow * SW - PL) * C + c;
    v8 acc[6];
    for (int r = 0; r < np; ++r) acc[r] = b;
    for (int64_t kh = K ? 0 : kh0; kh < (K ? K : kh1); ++kh) {
        if (K && (kh < kh0 || kh >= kh1)) continue;
        for (int64_t kw = 0; kw < (K ? K : KW); ++kw) {
            const float *x = ip + kh * rowstep + kw * colstep;
            const v8 wv = K ? w[kh * K + kw] : vload(wt + (kh * KW + kw) * C + c);
            for (int r = 0; r < np; ++r) acc[r] = vfma(vload(x + r * xs), wv, acc[r]);
        }
    }
    for (int r = 0; r < np; ++r) {
        float *o = orow + (ow + r) * C + c;
        vstore(o, fused ? epilogue(acc[r], rrow ? rrow + (ow + r) * C + c : 0, act, lo, hi)
                        : acc[r]);
    }
}

/* Two side pixels (u, v: u == v for one) of a depthwise row, each tap's column checked. */
static inline __attribute__((always_inline)) void dwsides(
    int K, int64_t u, int64_t v, const float *irow, float *orow, const float *rrow, const v8 *w,
    const float *restrict wt, v8 b, int64_t c, int64_t W, int64_t C, int64_t SW, int64_t PL,
    int64_t KW, int64_t DW, int64_t rowstep, int64_t kh0, int64_t kh1, int fused, int64_t act,
    v8 lo, v8 hi) {
    const int64_t u0 = u * SW - PL, v0 = v * SW - PL;
    v8 au = b, av = b;
    for (int64_t kh = K ? 0 : kh0; kh < (K ? K : kh1); ++kh) {
        if (K && (kh < kh0 || kh >= kh1)) continue;
        const float *x = irow + kh * rowstep + c;
        for (int64_t kw = 0; kw < (K ? K : KW); ++kw) {
            const v8 wv = K ? w[kh * K + kw] : vload(wt + (kh * KW + kw) * C + c);
            const int64_t iu = u0 + kw * DW, iv = v0 + kw * DW;
            if (iu >= 0 && iu < W) au = vfma(vload(x + iu * C), wv, au);
            if (iv >= 0 && iv < W) av = vfma(vload(x + iv * C), wv, av);
        }
    }
    vstore(orow + v * C + c, fused ? epilogue(av, rrow ? rrow + v * C + c : 0, act, lo, hi) : av);
    vstore(orow + u * C + c, fused ? epilogue(au, rrow ? rrow + u * C + c : 0, act, lo, hi) : au);
}

/* One output row of a depthwise convolution, 8 channels (c) at a time: the block's 3 x 3
   weights held in registers (K 3: 9 of the 16 beside a tile of 6 accumulators; K 0: any KH x KW
   read from memory), the taps of rows [kh0, kh1) only (the others fall outside the input), the
   pixels [lo, hi) whose windows lie inside the input's columns 6, 2 or 1 at a time, the others
   (the sides) two at a time with their columns checked: independent accumulators, never one
   chain of FMAs waiting on the last. */
static inline __attribute__((always_inline)) void dwrow(
    int K, const float *irow, float *orow, const float *rrow, int64_t W, int64_t C, int64_t OW,
    int64_t SW, int64_t PL, int64_t KW, int64_t DW, int64_t rowstep, int64_t kh0,
    int64_t kh1, int64_t lo, int64_t hi, const float *restrict wt,
    const float *restrict bias, int fused, int64_t act, const float *a) {
    const v8 vlo = vsplat(act == ACT_CLIP ? a[0] : 0.0f),
             vhi = vsplat(act == ACT_CLIP ? a[1] : 0.0f);
#if defined(__AVX512F__)
    dwrow16(K, irow, orow, rrow, W, C, OW, SW, PL, KW, DW, rowstep, kh0, kh1, lo, hi, wt, bias,
            fused, act, a);
    for (int64_t c = C / 16 * 16; c + 8 <= C; c += 8) {  /* the 8 past the last 16 */
#else
    for (int64_t c = 0; c + 8 <= C; c += 8) {
#endif
        v8 w[9];
        if (K)
            for (int t = 0; t < K * K; ++t) w[t] = vload(wt + t * C + c);
        const v8 b = vload(bias + c);
#define DWT(np) dwtile(K, np, ow, irow, orow, rrow, w, wt, b, c, C, SW, PL, KW, DW, \
                       rowstep, kh0, kh1, fused, act, vlo, vhi)
#define DWS(u, v) dwsides(K, u, v, irow, orow, rrow, w, wt, b, c, W, C, SW, PL, KW, DW, \
                          rowstep, kh0, kh1, fused, act, vlo, vhi)
        int64_t ow = lo;
        for (; ow + 6 <= hi; ow += 6) DWT(6);
        for (; ow + 2 <= hi; ow += 2) DWT(2);
        if (ow < hi) DWT(1);
        int64_t left = 0, right = hi;  /* the sides: [0, lo) and [hi, OW), paired */
        while (left < lo || right < OW) {
            const int64_t u = left < lo ? left++ : right++;
            const int64_t v = left < lo ? left++ : right < OW ? right++ : u;
            DWS(u, v);
        }
#undef DWT
#undef DWS
    }
    for (int64_t c = C / 8 * 8; c < C; ++c)  /* the channels past the last 8 */
        for (int64_t ow = 0; ow < OW; ++ow) {
            const int64_t iw0 = ow * SW - PL;
            float acc = bias[c];
            for (int64_t kh = kh0; kh < kh1; ++kh)
                for (int64_t kw = 0; kw < KW; ++kw) {
                    const int64_t iw = iw0 + kw * DW;
                    if (iw < 0 || iw >= W) continue;
                    acc = fmaf(irow[iw * C + kh * rowstep + c], wt[(kh * KW + kw) * C + c], acc);
                }
            orow[ow * C + c] = acc;
        }
}

/* A depthwise convolution (one input and one output channel a group), weights [kh][kw][C], read
   from the input itself (no padded copy): rows [r0, r1) of its N x OH output rows (the pool's
   items), each by dwrow's registers (3x3, the common kernel, its own instance). */
static void dw_part(const int64_t *f, float *A, const float *P, int64_t r0, int64_t r1) {
    const int64_t H = f[F_H], W = f[F_W], C = f[F_C], OH = f[F_OH], OW = f[F_OW];
    const int64_t KH = f[F_KH], KW = f[F_KW], SH = f[F_SH], SW = f[F_SW], DH = f[F_DH],
                  DW = f[F_DW], PT = f[F_PT], PL = f[F_PL], act = f[F_ACT];
    const float *src = A + f[F_IN];
    float *out = A + f[F_OUT];
    const float *res = f[F_IN2] >= 0 ? A + f[F_IN2] : 0;
    const float *restrict wt = P + f[F_WOFF], *restrict bias = P + f[F_BOFF];
    const float *a = P + f[F_AOFF];
    const int64_t rowstep = DH * W * C;
    /* the epilogue in registers for whole blocks of 8 channels; else finish() after each row */
    int fused = C % 8 == 0 && (act == ACT_NONE || act == ACT_RELU || act == ACT_CLIP);
#if defined(__AVX512F__)
    fused = fused || (C % 16 == 0 && act16_takes(act));  /* dwrow16's lanes only: any act16's */
#endif
    int64_t lo = (PL + SW - 1) / SW, hi = (W - 1 - (KW - 1) * DW + PL) / SW + 1;
    if (W - 1 - (KW - 1) * DW + PL < 0) hi = 0;
    lo = lo < OW ? lo : OW;
    hi = hi < lo ? lo : hi < OW ? hi : OW;
    for (int64_t row = r0; row < r1; ++row) {
        const int64_t n = row / OH, oh = row % OH;
        float *orow = out + (n * OH + oh) * OW * C;
        const float *rrow = res ? res + (n * OH + oh) * OW * C : 0;
        const int64_t ih0 = oh * SH - PT;
        int64_t kh0 = 0, kh1 = KH;
        while (kh0 < KH && ih0 + kh0 * DH < 0) ++kh0;
        while (kh1 > kh0 && ih0 + (kh1 - 1) * DH >= H) --kh1;
        /* the window's origin row, maybe outside: only rows [kh0, kh1) are read */
        const float *irow = src + (n * H + ih0) * W * C;
        if (KH == 3 && KW == 3)
            dwrow(3, irow, orow, rrow, W, C, OW, SW, PL, KW, DW, rowstep, kh0, kh1, lo, hi,
                  wt, bias, fused, act, a);
        else
            dwrow(0, irow, orow, rrow, W, C, OW, SW, PL, KW, DW, rowstep, kh0, kh1, lo, hi,
                  wt, bias, fused, act, a);
        if (!fused) finish(orow, rrow, OW * C, act, a);
    }
}

static void dwconv(const int64_t *f, float *A, const float *P) {
    dw_part(f, A, P, 0, f[F_N] * f[F_OH]);
}
