/* ONNX NonMaxSuppression in one call (backplane.native.nms): every batch item and class of
 * float32 boxes and scores, selected as CpuRef's kernel selects them (reference/kernels/nms.py),
 * the executable specification: each class's candidates (score above the threshold where one is
 * given) best score first, equal scores in box order, NaN last; a candidate is kept unless its
 * IoU with a box kept before it is not at or under the IoU limit (a NaN limit: every kept box
 * suppresses); at most `limit` kept a class.
 *
 * The IoU in float32, each operation rounded on its own in CpuRef's order (-std=c11: no
 * contraction into FMA): height = min(y_max) - max(y_min), width likewise; 0 where either is not
 * positive; else inter = height * width, union = area_a + area_b - inter, IoU = inter / union
 * where union > 0, else 0. A NaN coordinate makes the union NaN: IoU 0, as CpuRef's.
 *
 * No N x N matrix: a candidate is compared with the boxes kept so far only (the greedy walk reads
 * nothing else), so a class costs candidates x kept IoUs and a sort of its candidates.
 *
 * backplane_nms_packed is the same call with its arguments in two arrays (ctypes converts each
 * argument of a call: twelve of them cost about 3 us, the selection itself 1-2 on a detector's
 * 64 boxes), and up to SMALL boxes its buffers on the stack and its sort by insertion (no malloc,
 * no qsort's call per comparison). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

int64_t backplane_nms_version(void) { return 2; }

static _Thread_local const float *tl_scores; /* the class being sorted: C11's qsort takes no
                                                 context, so a thread's own */

/* best first; equal (or both NaN): lower box first; NaN after every number */
static int by_score(const void *pa, const void *pb) {
    int64_t a = *(const int64_t *)pa, b = *(const int64_t *)pb;
    float sa = tl_scores[a], sb = tl_scores[b];
    int na = sa != sa, nb = sb != sb;
    if (na != nb) return na ? 1 : -1;
    if (!na) {
        if (sa > sb) return -1;
        if (sa < sb) return 1;
    }
    return (a > b) - (a < b);
}

/* y_min, x_min, y_max, x_max: the two opposite corners ordered (NaN kept: np.minimum's), or from
 * (x_center, y_center, width, height) */
static void corners(const float *box, int64_t center, float *out) {
    if (center) {
        float x = box[0], y = box[1], hw = box[2] / 2.0f, hh = box[3] / 2.0f;
        out[0] = y - hh; out[1] = x - hw; out[2] = y + hh; out[3] = x + hw;
        return;
    }
    for (int k = 0; k < 2; ++k) {
        float a = box[k], b = box[k + 2];
        if (a != a || b != b) {
            float nan = a != a ? a : b;
            out[k] = nan; out[k + 2] = nan;
        } else {
            out[k] = a < b ? a : b;
            out[k + 2] = a < b ? b : a;
        }
    }
}

static float iou(const float *a, const float *b) {
    float height = (a[2] < b[2] ? a[2] : b[2]) - (a[0] > b[0] ? a[0] : b[0]);
    float width = (a[3] < b[3] ? a[3] : b[3]) - (a[1] > b[1] ? a[1] : b[1]);
    if (height <= 0.0f || width <= 0.0f) return 0.0f;
    float inter = height * width;
    float area_a = (a[2] - a[0]) * (a[3] - a[1]);
    float area_b = (b[2] - b[0]) * (b[3] - b[1]);
    float uni = area_a + area_b - inter;
    return uni > 0.0f ? inter / uni : 0.0f;
}

/* a before b in a class's order (by_score's): better score, or equal and a lower box */
static int before(float sa, int64_t a, float sb, int64_t b) {
    int na = sa != sa, nb = sb != sb;
    if (na != nb) return nb;
    if (!na && sa != sb) return sa > sb;
    return a < b;
}

/* order[0..count) sorted as by_score sorts it: by insertion (count at most SMALL), each
 * candidate moved ahead past those it comes before */
static void insertion_sort(int64_t *order, int64_t count, const float *s) {
    for (int64_t k = 1; k < count; ++k) {
        int64_t i = order[k];
        float si = s[i];
        int64_t j = k;
        while (j > 0 && before(si, i, s[order[j - 1]], order[j - 1])) {
            order[j] = order[j - 1];
            --j;
        }
        order[j] = i;
    }
}

/* boxes (B, N, 4) and scores (B, C, N), C-contiguous float32. Writes [batch, class, box] rows
 * into `out` (room for `capacity` rows: B * C * min(limit, N) is always enough) and returns their
 * count; -1 where memory could not be had. `has_threshold`: whether `threshold` is given. */
#define SMALL 256

int64_t backplane_nms(const float *boxes, const float *scores, int64_t B, int64_t C, int64_t N,
                      int64_t center, double iou_limit, int64_t has_threshold, double threshold,
                      int64_t limit, int64_t *out, int64_t capacity) {
    if (limit <= 0 || N <= 0) return 0;
    float corner_small[4 * SMALL];
    int64_t order_small[SMALL], kept_small[SMALL];
    int small = N <= SMALL;
    float *corner = small ? corner_small : malloc(sizeof(float) * 4 * (size_t)N);
    int64_t *order = small ? order_small : malloc(sizeof(int64_t) * (size_t)N);
    int64_t *kept = small ? kept_small : malloc(sizeof(int64_t) * (size_t)N);
    if (!corner || !order || !kept) {
        if (!small) { free(corner); free(order); free(kept); }
        return -1;
    }
    int nan_limit = iou_limit != iou_limit;
    int64_t rows = 0;
    for (int64_t b = 0; b < B && rows >= 0; ++b) {
        const float *box = boxes + b * N * 4;
        for (int64_t i = 0; i < N; ++i) corners(box + 4 * i, center, corner + 4 * i);
        for (int64_t c = 0; c < C; ++c) {
            const float *s = scores + (b * C + c) * N;
            int64_t count = 0;
            for (int64_t i = 0; i < N; ++i)
                if (!has_threshold || (double)s[i] > threshold) order[count++] = i;
            if (small) {
                insertion_sort(order, count, s);
            } else {
                tl_scores = s;
                qsort(order, (size_t)count, sizeof(int64_t), by_score);
            }
            int64_t n_kept = 0;
            for (int64_t k = 0; k < count && n_kept < limit; ++k) {
                int64_t i = order[k];
                int keep = 1;
                for (int64_t j = 0; j < n_kept; ++j) {
                    if (nan_limit || !((double)iou(corner + 4 * i, corner + 4 * kept[j])
                                       <= iou_limit)) {
                        keep = 0;
                        break;
                    }
                }
                if (keep) kept[n_kept++] = i;
            }
            if (rows + n_kept > capacity) { rows = -1; break; }
            for (int64_t k = 0; k < n_kept; ++k) {
                out[3 * rows] = b; out[3 * rows + 1] = c; out[3 * rows + 2] = kept[k];
                ++rows;
            }
        }
    }
    if (!small) { free(corner); free(order); free(kept); }
    return rows;
}

/* backplane_nms with ints = {boxes, scores, B, C, N, center, has_threshold, limit, out, capacity}
 * (the three pointers as integers) and reals = {iou_limit, threshold} */
int64_t backplane_nms_packed(const int64_t *ints, const double *reals) {
    return backplane_nms((const float *)(intptr_t)ints[0], (const float *)(intptr_t)ints[1],
                         ints[2], ints[3], ints[4], ints[5], reals[0], ints[6], reals[1], ints[7],
                         (int64_t *)(intptr_t)ints[8], ints[9]);
}
