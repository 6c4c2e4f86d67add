/* ONNX's LSTM and GRU over every step of every direction in one call (the default activations,
 * no clip, no peepholes): per step one product of [x_t, h] by the input and recurrent weights
 * stacked, from the biases, then the gates. Why native: stepped in torch ops a step costs 6-14
 * us (5-7 ops of 1-4 us, MKL's one-row product on its generic kernel on AMD), where this loop
 * costs what its arithmetic does; the input projection in torch (a GEMM of every step before
 * the loop) was one more op and its reshapes, for less work than the op costs at these sizes.
 *
 * The weights are packed once (recurrent.py's prepared): per direction and matrix ([W, R] rows
 * k over the gates' outputs), the outputs in blocks of BW = 64, each block's rows k contiguous
 * (BW floats each), the last block padded with zeros. A block's 64 sums start from the biases and
 * stay in registers while k runs (``product``: AVX-512's 16-float vectors where the CPU has them,
 * else 8-float ones, AVX2's): the weights are streamed once a step and the sums never go through
 * memory. The packing is the same for both, so recurrent.py does not know which was built.
 *
 * Strides are in floats, for x (time, batch) and for Y (time, direction, batch) and the states
 * (direction, batch): ONNX's layouts 0 and 1 both read and write in place. A row (direction,
 * batch) runs its own steps: with lens (sequence_lens), only its first lens[b] (backward: from
 * step lens[b] - 1 down), its Y past them zero, its final states those of its last step.
 *
 * Sigmoid and tanh are approximations the compiler vectorizes: tanh Eigen's rational one (a few
 * ulp from tanhf), sigmoid 1 / (1 + e^-x) with Cephes' expf. NaN in gives NaN out: the clamps are
 * written as comparisons, which keep a NaN. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#pragma GCC optimize("fp-contract=fast", "no-trapping-math")

#define BW 64
typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4)));

static inline float tanh_r(float x) {
    const float limit = 7.90531110763549805f;
    float c = x > limit ? limit : (x < -limit ? -limit : x);
    float x2 = c * c;
    float p = -2.76076847742355e-16f;
    p = p * x2 + 2.00018790482477e-13f;
    p = p * x2 + -8.60467152213735e-11f;
    p = p * x2 + 5.12229709037114e-08f;
    p = p * x2 + 1.48572235717979e-05f;
    p = p * x2 + 6.37261928875436e-04f;
    p = p * x2 + 4.89352455891786e-03f;
    p = p * c;
    float q = 1.19825839466702e-06f;
    q = q * x2 + 1.18534705686654e-04f;
    q = q * x2 + 2.26843463243900e-03f;
    q = q * x2 + 4.89352518554385e-03f;
    float t = p / q;
    /* tiny x: tanh(x) = x to float precision (keeps -0 and the relative precision) */
    return (x < 0.0004f && x > -0.0004f) ? x : t;
}

/* e^x for sigmoid (Cephes' expf: x = n ln 2 + r, a polynomial of r, 2^n made in the exponent's
 * bits); x clamped to [-87, 88], where 2^n stays a normal float. */
static inline float exp_r(float x) {
    float c = x > 88.0f ? 88.0f : (x < -87.0f ? -87.0f : x);
    float n = __builtin_floorf(c * 1.44269504088896341f + 0.5f);
    float r = c - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* 1 / (1 + e^-x): relative precision where it is small (tanh's form loses it there). */
static inline float sigmoid_r(float x) { return 1.0f / (1.0f + exp_r(-x)); }

/* out[0 .. nb * BW) = bias + v M^T for one packed matrix (nb blocks of K rows each). The sums
 * of a block stay in registers from the biases on while k runs: with AVX-512 two blocks at once
 * in eight 16-float vectors, or one block's even and odd k in two sets of four (eight chains of
 * FMAs either way, what two FMA pipes of 4 cycles' latency need); without it one block in eight
 * 8-float vectors. Two blocks at once read two streams of weights: past PAIRED_K rows (blocks of
 * 24 KB) that was slower, from L2 (1 thread, thread CPU, a bidirectional LSTM of 100 steps,
 * hidden 128: 438 us paired, 316 a block at a time, 321 with AVX2's 8-float vectors; 80 steps,
 * input 64, hidden 32, K 96: 26.8 paired, 29.1 a block at a time, 41.8 AVX2's). */
#if defined(__AVX512F__)
#define PAIRED_K 96
typedef float v16u __attribute__((vector_size(64), aligned(4)));

static void product(const float *restrict packed, const float *restrict bias, int64_t nb,
                    int64_t K, const float *restrict v, float *restrict out) {
    int64_t jb = 0;
    for (; jb + 2 <= nb && K <= PAIRED_K; jb += 2) {
        const float *restrict q = packed + jb * K * BW, *restrict u = q + K * BW;
        const float *b = bias + jb * BW;
        v16u a0 = *(const v16u *)(b + 0), a1 = *(const v16u *)(b + 16),
             a2 = *(const v16u *)(b + 32), a3 = *(const v16u *)(b + 48),
             a4 = *(const v16u *)(b + 64), a5 = *(const v16u *)(b + 80),
             a6 = *(const v16u *)(b + 96), a7 = *(const v16u *)(b + 112);
        for (int64_t k = 0; k < K; ++k, q += BW, u += BW) {
            float s = v[k];
            a0 += s * *(const v16u *)(q + 0);
            a1 += s * *(const v16u *)(q + 16);
            a2 += s * *(const v16u *)(q + 32);
            a3 += s * *(const v16u *)(q + 48);
            a4 += s * *(const v16u *)(u + 0);
            a5 += s * *(const v16u *)(u + 16);
            a6 += s * *(const v16u *)(u + 32);
            a7 += s * *(const v16u *)(u + 48);
        }
        float *o = out + jb * BW;
        *(v16u *)(o + 0) = a0; *(v16u *)(o + 16) = a1; *(v16u *)(o + 32) = a2;
        *(v16u *)(o + 48) = a3; *(v16u *)(o + 64) = a4; *(v16u *)(o + 80) = a5;
        *(v16u *)(o + 96) = a6; *(v16u *)(o + 112) = a7;
    }
    for (; jb < nb; ++jb) {
        const float *restrict q = packed + jb * K * BW;
        const float *b = bias + jb * BW;
        v16u a0 = *(const v16u *)(b + 0), a1 = *(const v16u *)(b + 16),
             a2 = *(const v16u *)(b + 32), a3 = *(const v16u *)(b + 48), a4 = {0}, a5 = {0},
             a6 = {0}, a7 = {0};
        int64_t k = 0;
        for (; k + 2 <= K; k += 2, q += 2 * BW) {
            float s = v[k], t = v[k + 1];
            a0 += s * *(const v16u *)(q + 0);
            a1 += s * *(const v16u *)(q + 16);
            a2 += s * *(const v16u *)(q + 32);
            a3 += s * *(const v16u *)(q + 48);
            a4 += t * *(const v16u *)(q + BW + 0);
            a5 += t * *(const v16u *)(q + BW + 16);
            a6 += t * *(const v16u *)(q + BW + 32);
            a7 += t * *(const v16u *)(q + BW + 48);
        }
        if (k < K) {
            float s = v[k];
            a0 += s * *(const v16u *)(q + 0);
            a1 += s * *(const v16u *)(q + 16);
            a2 += s * *(const v16u *)(q + 32);
            a3 += s * *(const v16u *)(q + 48);
        }
        float *o = out + jb * BW;
        *(v16u *)(o + 0) = a0 + a4; *(v16u *)(o + 16) = a1 + a5;
        *(v16u *)(o + 32) = a2 + a6; *(v16u *)(o + 48) = a3 + a7;
    }
}
#else
static void product(const float *restrict packed, const float *restrict bias, int64_t nb,
                    int64_t K, const float *restrict v, float *restrict out) {
    for (int64_t jb = 0; jb < nb; ++jb) {
        const float *restrict q = packed + jb * K * BW;
        const float *b = bias + jb * BW;
        v8 a0 = *(const v8u *)(b + 0), a1 = *(const v8u *)(b + 8), a2 = *(const v8u *)(b + 16),
           a3 = *(const v8u *)(b + 24), a4 = *(const v8u *)(b + 32), a5 = *(const v8u *)(b + 40),
           a6 = *(const v8u *)(b + 48), a7 = *(const v8u *)(b + 56);
        for (int64_t k = 0; k < K; ++k, q += BW) {
            float s = v[k];
            v8 vk = {s, s, s, s, s, s, s, s};
            a0 += vk * *(const v8u *)(q + 0);
            a1 += vk * *(const v8u *)(q + 8);
            a2 += vk * *(const v8u *)(q + 16);
            a3 += vk * *(const v8u *)(q + 24);
            a4 += vk * *(const v8u *)(q + 32);
            a5 += vk * *(const v8u *)(q + 40);
            a6 += vk * *(const v8u *)(q + 48);
            a7 += vk * *(const v8u *)(q + 56);
        }
        float *o = out + jb * BW;
        *(v8u *)(o + 0) = a0; *(v8u *)(o + 8) = a1; *(v8u *)(o + 16) = a2;
        *(v8u *)(o + 24) = a3; *(v8u *)(o + 32) = a4; *(v8u *)(o + 40) = a5;
        *(v8u *)(o + 48) = a6; *(v8u *)(o + 56) = a7;
    }
}
#endif

static int64_t blocks(int64_t n) { return (n + BW - 1) / BW; }

/* The sizes and strides of a call (the caller keeps one per shape: Python's ctypes fills a
 * structure's fields slower than it passes pointers). x is (seq, batch, I) or (batch, seq, I) by
 * its strides xt, xb; Y's strides yt, yd, yb; the states' sd, sb. */
typedef struct {
    int64_t seq, dirs, batch, I, H, direction, xt, xb, sd, sb, yt, yd, yb, linear_before_reset;
    int64_t xd; /* projected: x holds the input projections x W^T + their biases (a GEMM made
                 * before the call, where [W, R] would not stay in the cache), xd a direction's
                 * offset in them; I is 0 and the products read h alone */
} Shape;

typedef struct {
    const Shape *s;
    const float *x, *packed, *bias, *h0, *c0;
    const int64_t *lens;
    float *y, *yh, *yc;
} Call;

/* A matrix of the packed weights: its blocks, rows (K) and where it and its bias start. */
typedef struct { int64_t nb, K, at, bias_at; } Part;

/* The matrices of one direction, in the order recurrent.py's prepared lays them: LSTM [x, h] ->
 * i, o, f, c; GRU with linear_before_reset [x, h] -> z, r, then x -> h's input part, then h -> its
 * recurrent part (no block of zeros: an infinite x never meets a zero weight); GRU without [x, h]
 * -> z, r, then [x, r * h] -> h. *size, *bias_size: one direction's floats. */
static void parts(const Shape *s, int gru, Part *p, int64_t *size, int64_t *bias_size) {
    const int64_t I = s->I, H = s->H;
    int n;
    int64_t nb[3] = {blocks(2 * H), blocks(H), blocks(H)}, K[3] = {I + H, I, H};
    /* (projected, I is 0: a GRU's h-gate input part is read from x, its product has no rows) */
    if (!gru) {
        nb[0] = blocks(4 * H); n = 1;
    } else if (s->linear_before_reset) {
        n = 3;
    } else {
        K[1] = I + H; n = 2;
    }
    int64_t at = 0, bias_at = 0;
    for (int i = 0; i < 3; ++i) {
        p[i].nb = i < n ? nb[i] : 0; p[i].K = K[i]; p[i].at = at; p[i].bias_at = bias_at;
        at += p[i].nb * K[i] * BW;
        bias_at += p[i].nb * BW;
    }
    *size = at;
    *bias_size = bias_at;
}

/* A row (direction d, batch b) between its steps: its work memory ([x, h], [x, r * h], c, the
 * products' outputs), its weights, its length and its way through time. */
typedef struct {
    const float *packed, *bias;
    float *v, *h, *v2, *rh, *c, *g, *g1, *g2;
    int64_t d, b, s0, len;
    int backward;
} Row;

/* A row's floats of work memory: [x, h], [x, r * h], c, the products' outputs (4H's blocks, or
 * 2H's and two of H's), each part rounded to 16 floats (64-byte lines from an aligned start). */
static int64_t row_floats(int64_t I, int64_t H) {
    return 2 * ((I + H + 15) / 16 * 16) + (H + 15) / 16 * 16 + (blocks(4 * H) + 3) * BW;
}

static void begin(const Call *a, const Part *p, int64_t size, int64_t bias_size, int64_t d,
                  int64_t b, float *restrict work, Row *w) {
    const Shape *s = a->s;
    const int64_t I = s->I, H = s->H, wide = (I + H + 15) / 16 * 16;
    w->packed = a->packed + d * size;
    w->bias = a->bias + d * bias_size;
    w->v = work; w->h = work + I; w->v2 = work + wide; w->rh = w->v2 + I;
    w->c = work + 2 * wide; w->g = w->c + (H + 15) / 16 * 16;
    w->g1 = w->g + p[0].nb * BW; w->g2 = w->g1 + p[1].nb * BW;
    w->d = d; w->b = b; w->s0 = d * s->sd + b * s->sb;
    for (int64_t j = 0; j < H; ++j) {
        w->h[j] = a->h0 ? a->h0[w->s0 + j] : 0.0f;
        w->c[j] = a->c0 ? a->c0[w->s0 + j] : 0.0f;
    }
    int64_t len = a->lens ? a->lens[b] : s->seq;
    w->len = len < 0 ? 0 : (len > s->seq ? s->seq : len);
    w->backward = s->direction == 1 || (s->direction == 2 && d == 1);
}

/* Row w's step ``step`` (of its own way through time). */
static void step_row(const Call *a, const Part *p, Row *w, int64_t step, int gru) {
    const Shape *s = a->s;
    const int64_t I = s->I, H = s->H, d = w->d, b = w->b;
    float *restrict v = w->v, *restrict h = w->h, *restrict c = w->c, *restrict g = w->g;
    float *restrict g1 = w->g1, *restrict g2 = w->g2;
    const float *packed = w->packed, *bias = w->bias;
    int64_t t = w->backward ? w->len - 1 - step : step;
    const float *xp = a->x + t * s->xt + b * s->xb + d * s->xd;
    memcpy(v, xp, I * sizeof(float));
    product(packed + p[0].at, bias + p[0].bias_at, p[0].nb, p[0].K, v, g);
    if (s->xd)
        for (int64_t j = 0; j < (gru ? 2 : 4) * H; ++j)
            g[j] += xp[j];
    if (!gru) { /* ONNX's gates i, o, f, c */
        for (int64_t j = 0; j < H; ++j) {
            float i = sigmoid_r(g[j]), o = sigmoid_r(g[H + j]);
            float f = sigmoid_r(g[2 * H + j]), n = tanh_r(g[3 * H + j]);
            float cj = f * c[j] + i * n;
            c[j] = cj;
            h[j] = o * tanh_r(cj);
        }
    } else if (s->linear_before_reset) { /* n = tanh(x Wh + Wb_h + r * (h Rh + Rb_h)) */
        if (s->xd)
            memcpy(g1, xp + 2 * H, H * sizeof(float));
        else
            product(packed + p[1].at, bias + p[1].bias_at, p[1].nb, p[1].K, v, g1);
        product(packed + p[2].at, bias + p[2].bias_at, p[2].nb, p[2].K, h, g2);
        for (int64_t j = 0; j < H; ++j) {
            float z = sigmoid_r(g[j]), r = sigmoid_r(g[H + j]);
            float n = tanh_r(g1[j] + r * g2[j]);
            h[j] = (1.0f - z) * n + z * h[j];
        }
    } else { /* n = tanh(x Wh + (r * h) Rh + Wb_h + Rb_h) */
        float *restrict v2 = w->v2, *restrict rh = w->rh;
        memcpy(v2, v, I * sizeof(float));
        for (int64_t j = 0; j < 2 * H; ++j)
            g[j] = sigmoid_r(g[j]);
        for (int64_t j = 0; j < H; ++j)
            rh[j] = g[H + j] * h[j];
        product(packed + p[1].at, bias + p[1].bias_at, p[1].nb, p[1].K, v2, g1);
        for (int64_t j = 0; j < H; ++j) {
            float n = tanh_r(g1[j] + (s->xd ? xp[2 * H + j] : 0.0f));
            h[j] = (1.0f - g[j]) * n + g[j] * h[j];
        }
    }
    if (a->y)
        memcpy(a->y + t * s->yt + d * s->yd + b * s->yb, h, H * sizeof(float));
}

static void finish(const Call *a, const Row *w, int gru) {
    const Shape *s = a->s;
    const int64_t H = s->H;
    if (a->y)
        for (int64_t t = w->len; t < s->seq; ++t)
            memset(a->y + t * s->yt + w->d * s->yd + w->b * s->yb, 0, H * sizeof(float));
    if (a->yh)
        memcpy(a->yh + w->s0, w->h, H * sizeof(float));
    if (a->yc && !gru)
        memcpy(a->yc + w->s0, w->c, H * sizeof(float));
}

/* Every row's steps, rows in lockstep: a step of each row in turn, so that one row's gates (a
 * chain of divisions and polynomials) overlap the next one's product in the CPU's window, and a
 * batch's rows read their direction's weights while they are in L1. All rows so where every
 * direction's weights fit in L1 together (``TOGETHER``); else one direction's rows at a time
 * (two directions' [W, R] taking turns at every step would stream them from L2: the small-tier
 * CRNN's layer, [W, R] 48 KB a direction, 28 -> 46 us). */
#define TOGETHER (32 << 10)
static int run(const Call *a, int gru) {
    const Shape *s = a->s;
    const int64_t rows = s->dirs * s->batch, each = row_floats(s->I, s->H);
    Part p[3];
    int64_t size, bias_size;
    parts(s, gru, p, &size, &bias_size);
    Row *w = malloc(sizeof(Row) * (size_t)rows + sizeof(float) * (size_t)(rows * each + 16));
    if (!w)
        return 1;
    float *work = (float *)(w + rows);
    work += (16 - ((uintptr_t)work / sizeof(float)) % 16) % 16;
    for (int64_t r = 0; r < rows; ++r)
        begin(a, p, size, bias_size, r / s->batch, r % s->batch, work + r * each, w + r);
    int64_t group = s->dirs * size * (int64_t)sizeof(float) <= TOGETHER ? rows : s->batch;
    for (int64_t first = 0; first < rows; first += group) {
        int64_t longest = 0;
        for (int64_t r = first; r < first + group; ++r)
            longest = w[r].len > longest ? w[r].len : longest;
        for (int64_t step = 0; step < longest; ++step)
            for (int64_t r = first; r < first + group; ++r)
                if (step < w[r].len)
                    step_row(a, p, w + r, step, gru);
    }
    for (int64_t r = 0; r < rows; ++r)
        finish(a, w + r, gru);
    free(w);
    return 0;
}

int backplane_lstm(const Shape *s, const float *x, const float *packed, const float *bias,
                   const float *h0, const float *c0, const int64_t *lens, float *y, float *yh,
                   float *yc) {
    Call a = {s, x, packed, bias, h0, c0, lens, y, yh, yc};
    return run(&a, 0);
}

int backplane_gru(const Shape *s, const float *x, const float *packed, const float *bias,
                  const float *h0, const int64_t *lens, float *y, float *yh) {
    Call a = {s, x, packed, bias, h0, NULL, lens, y, yh, NULL};
    return run(&a, 1);
}

/* One direction's packed floats (want_bias 0) or bias floats (1): what recurrent.py packs. */
int64_t backplane_packed_floats(int64_t I, int64_t H, int64_t gru, int64_t linear_before_reset,
                                int64_t want_bias) {
    Shape s = {0};
    s.I = I; s.H = H; s.linear_before_reset = linear_before_reset;
    Part p[3];
    int64_t size, bias_size;
    parts(&s, (int)gru, p, &size, &bias_size);
    return want_bias ? bias_size : size;
}

int backplane_recurrent_version(void) { return 3; }

#include "recurrent_net.h"
