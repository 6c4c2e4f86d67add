/* attention.c's call as a torch op whose kernel is this C: backplane::native_attention_c(Tensor q,
 * Tensor k, Tensor v, Tensor mask, Tensor cond, int invert, int diagonal, float fill, float alpha)
 * -> Tensor, no mask or condition an empty tensor. Why: the op's kernel in Python (attention.py:
 * the plan looked up, the output made, the pointers written, ctypes) and torch's call into Python
 * cost ~6-8 us a call, about a tenth of the tagger's attention; a boxed kernel of torch's stable
 * C ABI (a function over a stack of 64-bit values: each tensor an owned handle, each int its
 * value, each float its double's bits) is called by torch's dispatcher without Python, as
 * dynquant.c's (which says more). The plan (attention.c's A_* values) is made here from the
 * operands' sizes and strides at each call, as attention.py's plan_of makes it: q (..., L, E),
 * k (..., S, E), v (..., S, Ev) of one batch shape, each last axis contiguous, the mask (float32)
 * or condition (bool) broadcast to (..., L, S), the batch's leading axes flattening as views; the
 * output in the merged-heads layout for a batch of one or two axes. Operands it does not take
 * (another type or device, a strided last axis, an empty size, more than MAX_DIMS axes) go on
 * to backplane::native_attention, the op in Python, with the same stack. */
typedef uint64_t StableIValue;
typedef void *Tensor; /* AtenTensorHandle: an owned at::Tensor */

static struct {
    int32_t (*data)(Tensor, void **);
    int32_t (*dim)(Tensor, int64_t *);
    int32_t (*numel)(Tensor, int64_t *);
    int32_t (*sizes)(Tensor, int64_t **);
    int32_t (*strides)(Tensor, int64_t **);
    int32_t (*dtype)(Tensor, int32_t *);
    int32_t (*device)(Tensor, int32_t *);
    int32_t (*empty)(int64_t, const int64_t *, const int64_t *, int32_t, int32_t, int32_t,
                     Tensor *);
    int32_t (*release)(Tensor);
    int32_t (*dispatch)(const char *, const char *, StableIValue *);
    void (*fail)(_Bool, const char *, const char *, uint32_t, const char *);
    const char *(*what)(void); /* the last error's message; NULL in a torch before 2.10 */
    int32_t float32, boolean, cpu;
} abi;

#define ABI_FUNCTIONS 12
#define MAX_DIMS 8

/* attention.py's addresses, in the struct's order (the 12 functions, then the float32 and bool
 * dtype codes and the CPU's device code). */
int backplane_attention_bind(const int64_t *calls) {
    void **slots = (void **)&abi;
    for (int i = 0; i < ABI_FUNCTIONS; i++)
        memcpy(&slots[i], &calls[i], sizeof(void *));
    abi.float32 = (int32_t)calls[ABI_FUNCTIONS];
    abi.boolean = (int32_t)calls[ABI_FUNCTIONS + 1];
    abi.cpu = (int32_t)calls[ABI_FUNCTIONS + 2];
    return 0;
}

typedef struct {
    int64_t dims, *sizes, *strides;
    void *data;
} View;

/* t's view; 0, or 1 where it is not of `type` on the CPU or has more than MAX_DIMS axes */
static int view_of(Tensor t, int32_t type, View *v) {
    int32_t own, device;
    if (abi.dtype(t, &own) || abi.device(t, &device) || abi.dim(t, &v->dims) ||
        abi.sizes(t, &v->sizes) || abi.strides(t, &v->strides) || abi.data(t, &v->data))
        return 1;
    return own != type || device != abi.cpu || v->dims > MAX_DIMS;
}

/* (B, H, row, column) strides of v broadcast to batch (nb axes) + (rows, columns), as
 * attention.py's _strides: the batch's leading axes flattened into B (they must flatten as a
 * view), its last axis H, 0 where v broadcasts. 0, or 1 where v does not broadcast so. */
static int strides_of(const View *v, const int64_t *batch, int64_t nb, int64_t rows,
                      int64_t columns, int64_t out[4]) {
    const int64_t rank = nb + 2;
    int64_t size[MAX_DIMS + 2], step[MAX_DIMS + 2];
    if (v->dims > rank)
        return 1;
    for (int64_t d = 0; d < rank; ++d) {
        const int64_t own = d - (rank - v->dims); /* v's axis, right-aligned */
        const int64_t want = d < nb ? batch[d] : (d == nb ? rows : columns);
        const int64_t n = own < 0 ? 1 : v->sizes[own];
        if (n != want && n != 1)
            return 1;
        size[d] = want;
        step[d] = own < 0 || n == 1 ? 0 : v->strides[own];
    }
    int64_t lead = 0, last = -1;
    for (int64_t d = 0; d + 1 < nb; ++d) {
        if (size[d] == 1)
            continue;
        if (last >= 0 && step[last] != step[d] * size[d])
            return 1;
        last = d;
    }
    lead = last >= 0 ? step[last] : 0;
    out[0] = lead, out[1] = step[nb - 1], out[2] = step[nb], out[3] = step[nb + 1];
    return 0;
}

/* The plan a (A_COUNT values) of the op's operands and its output made; 0, 1 where the C does
 * not take them, 2 where the output was not had */
static int planned(Tensor *t, int64_t invert, int64_t diagonal, int64_t *a, Tensor *out) {
    View q, k, v, m = {0}, c = {0};
    int64_t mn, cn;
    if (view_of(t[0], abi.float32, &q) || view_of(t[1], abi.float32, &k) ||
        view_of(t[2], abi.float32, &v) || abi.numel(t[3], &mn) || abi.numel(t[4], &cn) ||
        (mn && view_of(t[3], abi.float32, &m)) || (cn && view_of(t[4], abi.boolean, &c)))
        return 1;
    const int64_t nb = q.dims - 2;
    if (nb < 1 || k.dims != q.dims || v.dims != q.dims)
        return 1;
    const int64_t L = q.sizes[nb], E = q.sizes[nb + 1], S = v.sizes[nb], Ev = v.sizes[nb + 1];
    if (!L || !E || !S || !Ev || k.sizes[nb] != S || k.sizes[nb + 1] != E)
        return 1;
    for (int64_t d = 0; d < nb; ++d)
        if (k.sizes[d] != q.sizes[d] || v.sizes[d] != q.sizes[d])
            return 1;
    if ((E > 1 && q.strides[nb + 1] != 1) || (E > 1 && k.strides[nb + 1] != 1) ||
        (Ev > 1 && v.strides[nb + 1] != 1))
        return 1;
    int64_t qs[4], ks[4], vs[4], ms[4] = {0}, cs[4] = {0}, B = 1;
    const int64_t H = q.sizes[nb - 1];
    for (int64_t d = 0; d + 1 < nb; ++d)
        B *= q.sizes[d];
    if (strides_of(&q, q.sizes, nb, L, E, qs) || strides_of(&k, q.sizes, nb, S, E, ks) ||
        strides_of(&v, q.sizes, nb, S, Ev, vs) ||
        (mn && strides_of(&m, q.sizes, nb, L, S, ms)) ||
        (cn && strides_of(&c, q.sizes, nb, L, S, cs)))
        return 1;
    int64_t shape[MAX_DIMS], step[MAX_DIMS], os[4];
    for (int64_t d = 0; d < nb; ++d)
        shape[d] = q.sizes[d];
    shape[nb] = L, shape[nb + 1] = Ev;
    if (nb == 1) { /* (H, L, Ev) over (L, H, Ev) memory */
        step[0] = Ev, step[1] = H * Ev, step[2] = 1;
    } else if (nb == 2) { /* (B, H, L, Ev) over (B, L, H, Ev) memory */
        step[0] = L * H * Ev, step[1] = Ev, step[2] = H * Ev, step[3] = 1;
    } else {
        for (int64_t d = nb + 1, n = 1; d >= 0; n *= shape[d], --d)
            step[d] = n;
    }
    if (abi.empty(nb + 2, shape, step, abi.float32, abi.cpu, 0, out))
        return 2;
    View o;
    if (view_of(*out, abi.float32, &o) || strides_of(&o, q.sizes, nb, L, Ev, os)) {
        abi.release(*out);
        return 2;
    }
    const int64_t values[A_COUNT] = {
        (intptr_t)q.data, (intptr_t)k.data, (intptr_t)v.data, mn ? (intptr_t)m.data : 0,
        cn ? (intptr_t)c.data : 0, (intptr_t)o.data, B, H, L, S, E, Ev, qs[0], qs[1], qs[2],
        ks[0], ks[1], ks[2], vs[0], vs[1], vs[2], ms[0], ms[1], ms[2], ms[3], cs[0], cs[1],
        cs[2], cs[3], os[0], os[1], os[2], invert, diagonal};
    memcpy(a, values, sizeof values);
    return 0;
}

/* torch's boxed kernel of backplane::native_attention_c: the stack holds the nine arguments
 * (q, k, v, mask, cond: owned handles; invert, diagonal; fill, alpha: doubles), then the
 * result */
void backplane_attention_op(StableIValue *stack, uint64_t arguments, uint64_t results) {
    (void)arguments, (void)results;
    Tensor t[5], out = NULL;
    for (int i = 0; i < 5; ++i)
        t[i] = (Tensor)(uintptr_t)stack[i];
    double fill, alpha;
    memcpy(&fill, &stack[7], sizeof fill);
    memcpy(&alpha, &stack[8], sizeof alpha);
    int64_t a[A_COUNT];
    int code = planned(t, (int64_t)stack[5], (int64_t)stack[6], a, &out);
    if (code == 0) {
        const float f[2] = {(float)fill, (float)alpha};
        code = backplane_attention(a, f) ? 2 : 0;
        if (code)
            abi.release(out);
    }
    if (code == 0) {
        for (int i = 0; i < 5; ++i)
            abi.release(t[i]);
        stack[0] = (StableIValue)(uintptr_t)out; /* torch takes the handle over */
        return;
    }
    if (code == 2)
        abi.fail(0, "backplane_attention_op", __FILE__, __LINE__,
                 "native attention: its output or work memory was not had");
    else if (abi.dispatch("backplane::native_attention", "", stack)) /* raises a c10::Error */
        abi.fail(0, "backplane_attention_op", __FILE__, __LINE__,
                 abi.what ? abi.what() : "backplane::native_attention failed");
}
