/* ONNX's LSTM and GRU over every step of every direction in one call (the default activations,
 * no clip, no peepholes). The input projection of all steps (X W^T + the biases outside the
 * recurrence) is one GEMM made before the call; here, per step, the recurrent product h R^T and
 * the gates. Why native: stepped in torch ops a step costs 6-14 us (5-7 ops of 1-4 us, MKL's
 * one-row product on its generic kernel on AMD), where this loop costs what its arithmetic does.
 *
 * The recurrent weights are packed once (recurrent.py's pack): per direction, columns of R^T in
 * blocks of BW = 64 outputs, each block's rows k = 0..H-1 contiguous (BW floats each), the last
 * block padded with zeros. A block's 64 sums stay in eight 8-float vectors while k runs, so the
 * product streams the weights once a step and the sums never go through memory.
 *
 * Strides are in floats, for the projections xw and for Y (time, direction, batch) and the states
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

/* out[0 .. nb * BW) = h R^T for one direction's packed blocks (H rows each). */
static void product(const float *restrict packed, int64_t nb, int64_t H, const float *restrict h,
                    float *restrict out) {
    for (int64_t jb = 0; jb < nb; ++jb) {
        const float *restrict q = packed + jb * H * BW;
        v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, a4 = {0}, a5 = {0}, a6 = {0}, a7 = {0};
        for (int64_t k = 0; k < H; ++k, q += BW) {
            float s = h[k];
            v8 hk = {s, s, s, s, s, s, s, s};
            a0 += hk * *(const v8u *)(q + 0);
            a1 += hk * *(const v8u *)(q + 8);
            a2 += hk * *(const v8u *)(q + 16);
            a3 += hk * *(const v8u *)(q + 24);
            a4 += hk * *(const v8u *)(q + 32);
            a5 += hk * *(const v8u *)(q + 40);
            a6 += hk * *(const v8u *)(q + 48);
            a7 += hk * *(const v8u *)(q + 56);
        }
        float *o = out + jb * BW;
        *(v8u *)(o + 0) = a0; *(v8u *)(o + 8) = a1; *(v8u *)(o + 16) = a2;
        *(v8u *)(o + 24) = a3; *(v8u *)(o + 32) = a4; *(v8u *)(o + 40) = a5;
        *(v8u *)(o + 48) = a6; *(v8u *)(o + 56) = a7;
    }
}

static int64_t blocks(int64_t n) { return (n + BW - 1) / BW; }

/* One LSTM step's gates (ONNX's order i, o, f, c), h and c updated in place. */
static void lstm_gates(int64_t H, const float *restrict x, const float *restrict g,
                       float *restrict h, float *restrict c) {
    for (int64_t j = 0; j < H; ++j) {
        float i = sigmoid_r(x[j] + g[j]);
        float o = sigmoid_r(x[H + j] + g[H + j]);
        float f = sigmoid_r(x[2 * H + j] + g[2 * H + j]);
        float n = tanh_r(x[3 * H + j] + g[3 * H + j]);
        float cj = f * c[j] + i * n;
        c[j] = cj;
        h[j] = o * tanh_r(cj);
    }
}

/* GRU's gates (z, r, h) with linear_before_reset: n = tanh(x_h + r * (h Rh^T + Rb_h)). */
static void gru_gates_after(int64_t H, const float *restrict x, const float *restrict g,
                            const float *restrict rbh, float *restrict h) {
    for (int64_t j = 0; j < H; ++j) {
        float z = sigmoid_r(x[j] + g[j]);
        float r = sigmoid_r(x[H + j] + g[H + j]);
        float n = tanh_r(x[2 * H + j] + r * (g[2 * H + j] + rbh[j]));
        h[j] = (1.0f - z) * n + z * h[j];
    }
}

typedef struct {
    int64_t seq, dirs, batch, H, direction; /* direction: 0 forward, 1 reverse, 2 bidirectional */
    const float *xw; int64_t xt, xd, xb;     /* projections and their strides */
    const float *packed;                     /* every direction's packed R^T, one after another */
    const float *h0, *c0; int64_t sd, sb;    /* initial states (NULL: zeros) and their strides */
    const int64_t *lens;                     /* sequence_lens (NULL: all seq) */
    float *y; int64_t yt, yd, yb;            /* Y (NULL: not wanted) */
    float *yh, *yc;                          /* final states, strides sd, sb (NULL: not wanted) */
    const float *rbh;                        /* GRU: Rb_h per direction (H each) */
    int64_t linear_before_reset;
} Recurrent;

/* The steps of row (d, b): 0 for LSTM, 1 for GRU. */
static void row(const Recurrent *a, int64_t d, int64_t b, int gru, float *restrict work) {
    const int64_t H = a->H, G = gru ? 3 : 4;
    const int64_t nb = gru && !a->linear_before_reset ? blocks(2 * H) + blocks(H) : blocks(G * H);
    const float *packed = a->packed + d * nb * H * BW;
    float *h = work, *c = work + H, *g = work + 2 * H, *rh = g + (nb + 1) * BW;
    int64_t s0 = d * a->sd + b * a->sb;
    for (int64_t j = 0; j < H; ++j) {
        h[j] = a->h0 ? a->h0[s0 + j] : 0.0f;
        c[j] = a->c0 ? a->c0[s0 + j] : 0.0f;
    }
    int64_t len = a->lens ? a->lens[b] : a->seq;
    len = len < 0 ? 0 : (len > a->seq ? a->seq : len);
    int backward = a->direction == 1 || (a->direction == 2 && d == 1);
    for (int64_t s = 0; s < len; ++s) {
        int64_t t = backward ? len - 1 - s : s;
        const float *x = a->xw + t * a->xt + d * a->xd + b * a->xb;
        if (!gru) {
            product(packed, nb, H, h, g);
            lstm_gates(H, x, g, h, c);
        } else if (a->linear_before_reset) {
            product(packed, nb, H, h, g);
            gru_gates_after(H, x, g, a->rbh + d * H, h);
        } else { /* n = tanh(x_h + (r * h) Rh^T + Rb_h): z and r first, then h's product */
            int64_t nzr = blocks(2 * H);
            const float *rbh = a->rbh + d * H;
            product(packed, nzr, H, h, g);
            for (int64_t j = 0; j < 2 * H; ++j)
                g[j] = sigmoid_r(x[j] + g[j]);
            for (int64_t j = 0; j < H; ++j)
                rh[j] = g[H + j] * h[j];
            float *gh = g + nzr * BW;
            product(packed + nzr * H * BW, blocks(H), H, rh, gh);
            for (int64_t j = 0; j < H; ++j) {
                float n = tanh_r(x[2 * H + j] + gh[j] + rbh[j]);
                h[j] = (1.0f - g[j]) * n + g[j] * h[j];
            }
        }
        if (a->y)
            memcpy(a->y + t * a->yt + d * a->yd + b * a->yb, h, H * sizeof(float));
    }
    if (a->y)
        for (int64_t t = len; t < a->seq; ++t)
            memset(a->y + t * a->yt + d * a->yd + b * a->yb, 0, H * sizeof(float));
    if (a->yh)
        memcpy(a->yh + s0, h, H * sizeof(float));
    if (a->yc && !gru)
        memcpy(a->yc + s0, c, H * sizeof(float));
}

static int run(const Recurrent *a, int gru) {
    const int64_t H = a->H;
    /* h, c, the products' outputs (blocks of 3H or 4H, one spare), r * h */
    float *work = malloc(sizeof(float) * (size_t)(3 * H + (blocks(4 * H) + 3) * BW));
    if (!work)
        return 1;
    for (int64_t d = 0; d < a->dirs; ++d)
        for (int64_t b = 0; b < a->batch; ++b)
            row(a, d, b, gru, work);
    free(work);
    return 0;
}

/* The sizes and strides of a call (the caller keeps one per shape: Python's ctypes fills a
 * structure's fields slower than it passes pointers). */
typedef struct {
    int64_t seq, dirs, batch, H, direction, xt, xd, xb, sd, sb, yt, yd, yb, linear_before_reset;
} Shape;

static Recurrent shaped(const Shape *s) {
    Recurrent a = {0};
    a.seq = s->seq; a.dirs = s->dirs; a.batch = s->batch; a.H = s->H;
    a.direction = s->direction; a.xt = s->xt; a.xd = s->xd; a.xb = s->xb;
    a.sd = s->sd; a.sb = s->sb; a.yt = s->yt; a.yd = s->yd; a.yb = s->yb;
    a.linear_before_reset = s->linear_before_reset;
    return a;
}

int backplane_lstm(const Shape *s, const float *xw, const float *packed, const float *h0,
                   const float *c0, const int64_t *lens, float *y, float *yh, float *yc) {
    Recurrent a = shaped(s);
    a.xw = xw; a.packed = packed; a.h0 = h0; a.c0 = c0; a.lens = lens;
    a.y = y; a.yh = yh; a.yc = yc;
    return run(&a, 0);
}

int backplane_gru(const Shape *s, const float *xw, const float *packed, const float *h0,
                  const float *rbh, const int64_t *lens, float *y, float *yh) {
    Recurrent a = shaped(s);
    a.xw = xw; a.packed = packed; a.h0 = h0; a.rbh = rbh; a.lens = lens; a.y = y; a.yh = yh;
    return run(&a, 1);
}

/* The packed layout's size in floats, one direction (what recurrent.py's pack makes). */
int64_t backplane_packed_floats(int64_t gates, int64_t H, int64_t split) {
    int64_t nb = split ? blocks(2 * H) + blocks(H) : blocks(gates * H);
    return nb * H * BW;
}

int backplane_recurrent_version(void) { return 1; }
