/* DecodeStack: a decoder's layers for one decode token of up to 8 sequences, in one call (bound in module.c
 * as llmlocal.native.cpu._kernels.DecodeStack).
 *
 * A Llama-family decoder's layers for one decode token per sequence (fp32): what costs
 * hundreds of small torch calls per step in Python. Per layer, for each sequence:
 *
 *   x = rms_norm(h) * attn_norm;  qkv = W_qkv x' [+ qkv_bias]   (x' thresholded, see gemv)
 *   [q_h = rms_norm(q_h) * q_norm, k_h = rms_norm(k_h) * k_norm per head]          (Qwen3, Gemma 3)
 *   q, k rotated by RoPE (interleaved pairs (2j, 2j + 1), factors `cis` of the position, or
 *   `cis_local` in a `local` layer: Gemma 3's sliding layers have a RoPE base of their own)
 *   k, v written to slot `slot_new` of the layer's cache (slots, Hkv, D), float, fp16 or q8_0
 *   (per KV head: D int8 values and an fp16 scale per 32, D + D / 16 bytes; see attn_body.h)
 *   a_h = softmax(scale q_h . K_g) V_g over the context slots (the last `window` of them when
 *   the layer has one: Mistral, Gemma 3), g = h / (H / Hkv)
 *   h += W_o a'   [rms_norm(W_o a') * post_attn_norm: Gemma 3's sandwich norms]
 *   x = rms_norm(h) * ffn_norm;  [gate, up] = W_gu x'
 *   h += W_down (act(gate) * up)'   [rms_norm(...) * post_ffn_norm], act silu or gelu-tanh (Gemma)
 *
 * The same arithmetic as engine/model/llama.py, in float32 (an fp16 cache rounds k and v to
 * nearest even, as torch's conversion does; a q8_0 cache quantizes them as kv_quant.py), with the projections through
 * si4_gemv_locked. Weights are Matrix or QMatrix objects, or tuples of them whose outputs stack (held); norms and caches are addresses of tensors
 * the caller keeps alive and in place. */

#include "binding.h" /* Python.h first */

#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

enum { P_QKV, P_O, P_GU, P_DOWN, N_PROJ };
#define MAX_SEGMENTS 4 /* matrices per projection, their outputs stacked (e.g. q, k of one type, v of another) */

/* How a step's attention is shared out, for one window (see attend_part): row b attends
 * len[b] slots from slots[b * slot_stride + start[b]], in chunks[b] chunks, its units
 * [first[b], first[b + 1]). */
typedef struct {
    int64_t start[SI4_MAX_BATCH], len[SI4_MAX_BATCH];
    int chunks[SI4_MAX_BATCH], first[SI4_MAX_BATCH + 1];
    int n_units;
} attn_plan;

typedef struct {
    int n_seg;
    MatrixObject *seg[MAX_SEGMENTS]; /* referenced */
    int row0[MAX_SEGMENTS];          /* first output row of each */
} proj_t;

typedef struct {
    PyObject_HEAD int n_layers, d, n_heads, n_kv, head_dim, d_ffn;
    float eps, scale;
    proj_t *proj;                  /* n_layers * N_PROJ */
    const float **attn_norm, **ffn_norm;
    void **k_cache, **v_cache; /* float, fp16 values or q8_0 rows, by kv_type */
    const float **qkv_bias;    /* per layer, or NULL: added to q, k, v before RoPE (Qwen2) */
    const float **q_norm, **k_norm;               /* per layer, or NULL (head_dim floats each) */
    const float **post_attn_norm, **post_ffn_norm; /* per layer, or NULL (d floats each) */
    int *plan_of;   /* per layer: its attention plan, 0 the whole context, p > 0 windows[p] */
    int *windows;   /* the distinct windows (windows[0] = 0: none), n_plans of them */
    attn_plan *plans; /* n_plans, remade every step */
    unsigned char *local; /* per layer: RoPE by cis_local */
    int kv_type, activation, n_plans, any_local; /* kv_type: SI4_KV_* */
    float *x, *qkv, *att, *gu, *act, *out, *scores;
    float *part_o, *part_m, *part_l; /* chunked attention's partial results, per unit */
    size_t scores_n, part_units;
} StackObject;

static void Stack_dealloc(StackObject *self) {
    if (self->proj)
        for (int i = 0; i < self->n_layers * N_PROJ; i++)
            for (int j = 0; j < self->proj[i].n_seg; j++) Py_XDECREF(self->proj[i].seg[j]);
    free(self->proj);
    free(self->attn_norm);
    free(self->ffn_norm);
    free(self->k_cache);
    free(self->qkv_bias);
    free(self->q_norm);
    free(self->k_norm);
    free(self->post_attn_norm);
    free(self->post_ffn_norm);
    free(self->plan_of);
    free(self->windows);
    free(self->plans);
    free(self->local);
    free(self->v_cache);
    free(self->x);
    free(self->qkv);
    free(self->att);
    free(self->gu);
    free(self->act);
    free(self->out);
    free(self->scores);
    free(self->part_o);
    free(self->part_m);
    free(self->part_l);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static void *addr(PyObject *o) { return PyLong_AsVoidPtr(o); }

/* DecodeStack((d, n_heads, n_kv, head_dim, d_ffn, eps, scale, kv_type[, activation]),
 *             [(attn_norm, qkv, o, gate_up, down, ffn_norm, k_cache, v_cache[, qkv_bias[, q_norm[, k_norm
 *               [, post_attn_norm[, post_ffn_norm[, window[, local]]]]]]]), ...])
 * (a projection: a Matrix / QMatrix or a tuple of them; qkv_bias and the norms: addresses of
 * float32 vectors or None; kv_type 0 float, 1 fp16 (True), 2 q8_0; activation 0 silu-gated, 1 gelu-tanh-gated; window: attend the last
 * `window` slots, 0 (or None) all; local: RoPE by step's cis_local). Every option is off by
 * default: a short tuple is a Llama layer. */
static PyObject *Stack_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    (void)kwds;
    int d, nh, nkv, hd, ffn, kv_type, act = 0;
    double eps, scale;
    PyObject *cfg, *layers;
    if (!PyArg_ParseTuple(args, "OO!", &cfg, &PyList_Type, &layers)) return NULL;
    /* the config as a tuple of its own: a nested "(...)" format cannot have optional items */
    PyObject *ct = PySequence_Tuple(cfg);
    const int ok = ct && PyArg_ParseTuple(ct, "iiiiiddi|i:DecodeStack config", &d, &nh, &nkv, &hd, &ffn, &eps, &scale,
                                          &kv_type, &act);
    Py_XDECREF(ct);
    if (!ok) return NULL;
    const Py_ssize_t L = PyList_GET_SIZE(layers);
    if (L < 1 || d < 1 || nh < 1 || nkv < 1 || nh % nkv || nh > SI4_MAX_HEADS || hd < 2 || hd % 2 || ffn < 1 ||
        act < 0 || act > 1 || kv_type < SI4_KV_F32 || kv_type > SI4_KV_Q8 || (kv_type == SI4_KV_Q8 && hd % 32)) {
        PyErr_SetString(PyExc_ValueError, "DecodeStack: bad shape, an activation other than 0 (silu) or 1 (gelu-tanh), "
                                          "or a KV type other than 0 (float), 1 (fp16) or 2 (q8_0, head_dim a multiple of 32)");
        return NULL;
    }
    StackObject *self = (StackObject *)type->tp_alloc(type, 0);
    if (!self) return NULL;
    self->n_layers = (int)L, self->d = d, self->n_heads = nh, self->n_kv = nkv, self->head_dim = hd, self->d_ffn = ffn;
    self->eps = (float)eps, self->scale = (float)scale;
    self->proj = calloc((size_t)L * N_PROJ, sizeof(proj_t));
    self->attn_norm = calloc((size_t)L, sizeof(float *));
    self->ffn_norm = calloc((size_t)L, sizeof(float *));
    self->kv_type = kv_type;
    self->k_cache = calloc((size_t)L, sizeof(void *));
    self->qkv_bias = calloc((size_t)L, sizeof(float *));
    self->v_cache = calloc((size_t)L, sizeof(void *));
    self->activation = act;
    self->q_norm = calloc((size_t)L, sizeof(float *));
    self->k_norm = calloc((size_t)L, sizeof(float *));
    self->post_attn_norm = calloc((size_t)L, sizeof(float *));
    self->post_ffn_norm = calloc((size_t)L, sizeof(float *));
    self->plan_of = calloc((size_t)L, sizeof(int));
    self->windows = calloc((size_t)L + 1, sizeof(int)); /* windows[0] = 0 */
    self->local = calloc((size_t)L, 1);
    self->n_plans = 1;
    const size_t nqkv = (size_t)(nh + 2 * nkv) * hd;
    const size_t B = SI4_MAX_BATCH; /* scratch rows */
    self->x = calloc(B * (size_t)d, sizeof(float));
    self->qkv = calloc(B * nqkv, sizeof(float));
    self->att = calloc(B * (size_t)nh * hd, sizeof(float));
    self->gu = calloc(B * 2 * (size_t)ffn, sizeof(float));
    self->act = calloc(B * (size_t)ffn, sizeof(float));
    self->out = calloc(B * (size_t)d, sizeof(float));
    if (!self->proj || !self->attn_norm || !self->ffn_norm || !self->k_cache || !self->v_cache || !self->x ||
        !self->qkv || !self->att || !self->gu || !self->act || !self->out || !self->qkv_bias || !self->q_norm ||
        !self->k_norm || !self->post_attn_norm || !self->post_ffn_norm || !self->plan_of || !self->windows ||
        !self->local) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    /* the shapes each projection must have: (n out, k in) */
    const int want[N_PROJ][2] = {{(int)nqkv, d}, {d, nh * hd}, {2 * ffn, d}, {d, ffn}};
    for (Py_ssize_t i = 0; i < L; i++) {
        PyObject *t = PyList_GET_ITEM(layers, i);
        PyObject *an, *fn, *kc, *vc, *m[N_PROJ], *opt[5] = {NULL}, *win = NULL, *loc = NULL; /* opt: qkv_bias .. post_ffn_norm */
        if (!PyArg_ParseTuple(t, "OOOOOOOO|OOOOOOO", &an, &m[P_QKV], &m[P_O], &m[P_GU], &m[P_DOWN], &fn, &kc, &vc,
                              &opt[0], &opt[1], &opt[2], &opt[3], &opt[4], &win, &loc)) {
            Py_DECREF(self);
            return NULL;
        }
        for (int p = 0; p < N_PROJ; p++) {
            /* a Matrix / QMatrix, or a tuple of them whose outputs stack */
            PyObject *segs = PyTuple_Check(m[p]) ? m[p] : NULL;
            const Py_ssize_t ns = segs ? PyTuple_GET_SIZE(segs) : 1;
            proj_t *pr = &self->proj[i * N_PROJ + p];
            if (ns < 1 || ns > MAX_SEGMENTS) {
                PyErr_Format(PyExc_ValueError, "DecodeStack: layer %zd projection %d has %zd matrices (1..%d)", i, p, ns,
                             MAX_SEGMENTS);
                Py_DECREF(self);
                return NULL;
            }
            int rows = 0;
            for (Py_ssize_t j = 0; j < ns; j++) {
                PyObject *o = segs ? PyTuple_GET_ITEM(segs, j) : m[p];
                if (!PyObject_TypeCheck(o, &si4_matrix_type) && !PyObject_TypeCheck(o, &si4_qmatrix_type)) {
                    PyErr_Format(PyExc_TypeError, "DecodeStack: layer %zd projection %d is not a Matrix or QMatrix", i, p);
                    Py_DECREF(self);
                    return NULL;
                }
                const si4_matrix *mm = &((MatrixObject *)o)->m;
                if (mm->k != want[p][1]) {
                    PyErr_Format(PyExc_ValueError, "DecodeStack: layer %zd projection %d takes %d inputs, not %d", i, p,
                                 mm->k, want[p][1]);
                    Py_DECREF(self);
                    return NULL;
                }
                Py_INCREF(o);
                pr->seg[j] = (MatrixObject *)o;
                pr->row0[j] = rows;
                pr->n_seg = (int)j + 1;
                rows += mm->n;
            }
            if (rows != want[p][0]) {
                PyErr_Format(PyExc_ValueError, "DecodeStack: layer %zd projection %d has %d outputs, not %d", i, p, rows,
                             want[p][0]);
                Py_DECREF(self);
                return NULL;
            }
        }
        self->attn_norm[i] = addr(an), self->ffn_norm[i] = addr(fn);
        self->k_cache[i] = addr(kc), self->v_cache[i] = addr(vc);
        const float **opt_at[5] = {self->qkv_bias, self->q_norm, self->k_norm, self->post_attn_norm, self->post_ffn_norm};
        for (int o = 0; o < 5; o++) opt_at[o][i] = opt[o] && opt[o] != Py_None ? addr(opt[o]) : NULL;
        const long w = win && win != Py_None ? PyLong_AsLong(win) : 0;
        const int lc = loc ? PyObject_IsTrue(loc) : 0;
        if (PyErr_Occurred() || !self->attn_norm[i] || !self->ffn_norm[i] || !self->k_cache[i] || !self->v_cache[i] ||
            w < 0 || w > INT32_MAX || lc < 0) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "DecodeStack: a null address or a negative window");
            Py_DECREF(self);
            return NULL;
        }
        /* layers of one window share its plan (models have one or two windows) */
        int p = 0;
        while (p < self->n_plans && self->windows[p] != (int)w) p++;
        if (p == self->n_plans) self->windows[self->n_plans++] = (int)w;
        self->plan_of[i] = p;
        self->local[i] = (unsigned char)lc;
        self->any_local |= lc;
    }
    self->plans = calloc((size_t)self->n_plans, sizeof(attn_plan));
    if (!self->plans) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    return (PyObject *)self;
}

static void rms_norm(const float *h, const float *w, float *x, int d, float eps) {
    double ss = 0.0;
    for (int i = 0; i < d; i++) ss += (double)h[i] * h[i];
    const float r = 1.0f / sqrtf((float)(ss / d) + eps);
    for (int i = 0; i < d; i++) x[i] = h[i] * r * w[i];
}

/* Attention of one step, shared out in units of (sequence, chunk of its context): a unit
 * reads each of its positions' cache rows (every KV head) once for all query heads (GQA;
 * attn_body.h), and the pool's threads take units as they come. A context is cut into chunks
 * of at most ATTN_CHUNK positions, as many as a whole number of rounds of the threads (so
 * that they finish together), of 16 positions or more; the chunks' partial softmax sums are
 * merged afterwards (attn_merge). A unit's first rows wait on memory before its prefetches
 * run ahead, so long chunks pay that less often: on a Zen 5, two threads, the 1.5B's shapes
 * (bench_attention), 512 positions were 1.09-1.11x faster than 128 at 3,000 and 1.08x at 1,000;
 * 1,024 were 0.76x of 512 at 3,000 (three chunks for two threads). */
#define ATTN_CHUNK 512

typedef struct {
    StackObject *s;
    si4_attend_fn attend;
    const void *kc, *vc;
    const int64_t *slots;
    size_t slot_stride, scores_per_part;
    int batch;
    const attn_plan *plan; /* the layer's window's */
    atomic_int next, part_ids;
} attn_job;

static int n_chunks(int64_t len, int want) {
    int nc = (int)((len + ATTN_CHUNK - 1) / ATTN_CHUNK);
    if (want > 1) nc = (nc + want - 1) / want * want;
    if (nc > len / 16) nc = (int)(len / 16);
    return nc < 1 ? 1 : nc;
}

static void attend_part(void *arg, int part, int n_parts) {
    (void)part, (void)n_parts;
    attn_job *j = arg;
    const StackObject *s = j->s;
    const int nh = s->n_heads, nkv = s->n_kv, hd = s->head_dim;
    const size_t nqkv = (size_t)(nh + 2 * nkv) * hd;
    /* a scores area of its own: (n_heads, ATTN_CHUNK) */
    float *scores = s->scores + (size_t)atomic_fetch_add(&j->part_ids, 1) * j->scores_per_part;
    const attn_plan *pl = j->plan;
    for (int u; (u = atomic_fetch_add(&j->next, 1)) < pl->n_units;) {
        int b = 0;
        while (u >= pl->first[b + 1]) b++;
        const int nc = pl->chunks[b], c = u - pl->first[b];
        const int64_t len = pl->len[b];
        const int i0 = (int)(len * c / nc), i1 = (int)(len * (c + 1) / nc);
        si4_attn_unit unit = {
            .q = s->qkv + (size_t)b * nqkv, .kc = j->kc, .vc = j->vc, .kv_type = s->kv_type,
            .slots = j->slots + (size_t)b * j->slot_stride + pl->start[b] + i0,
            .n_ctx = i1 - i0, .n_kv = nkv, .group = nh / nkv, .hd = hd, .scale = s->scale,
            .scores = scores, .out = s->att + (size_t)b * nh * hd,
        };
        if (nc > 1) { /* a chunk: unnormalised, into the partials of unit u */
            unit.out = s->part_o + (size_t)u * nh * hd;
            unit.m = s->part_m + (size_t)u * nh;
            unit.l = s->part_l + (size_t)u * nh;
        }
        j->attend(&unit);
    }
}

/* The output of every row whose context came in chunks: per head, with M = max_c m_c and
 * w_c = e^(m_c - M), out = sum_c w_c o_c / sum_c w_c l_c. */
static void attn_merge(const attn_job *j) {
    const StackObject *s = j->s;
    const int nh = s->n_heads, hd = s->head_dim;
    for (int b = 0; b < j->batch; b++) {
        const int nc = j->plan->chunks[b], u0 = j->plan->first[b];
        if (nc == 1) continue;
        for (int h = 0; h < nh; h++) {
            float mx = -INFINITY, den = 0.0f;
            for (int c = 0; c < nc; c++) mx = fmaxf(mx, s->part_m[(size_t)(u0 + c) * nh + h]);
            float *o = s->att + ((size_t)b * nh + h) * hd;
            memset(o, 0, sizeof(float) * (size_t)hd);
            for (int c = 0; c < nc; c++) {
                const size_t at = (size_t)(u0 + c) * nh + h;
                const float w = expf(s->part_m[at] - mx);
                den += w * s->part_l[at];
                const float *p = s->part_o + at * hd;
                for (int e = 0; e < hd; e++) o[e] += w * p[e];
            }
            const float inv = 1.0f / den;
            for (int e = 0; e < hd; e++) o[e] *= inv;
        }
    }
}

/* Row b's attention over the last min(lens[b], window) of its slots (window 0: all of them),
 * cut into chunks for every thread to have one, whatever the batch: a row's attention sums in
 * the same order alone or batched (a verified draft token gets the numbers of decoding it). */
static void plan_attention(attn_plan *p, int window, int batch, const int64_t *lens, int want) {
    p->first[0] = 0;
    for (int b = 0; b < batch; b++) {
        p->len[b] = window > 0 && lens[b] > window ? window : lens[b];
        p->start[b] = lens[b] - p->len[b];
        p->chunks[b] = n_chunks(p->len[b], want);
        p->first[b + 1] = p->first[b] + p->chunks[b];
    }
    p->n_units = p->first[batch];
}

/* x's n values rms-normalised and scaled by w, in place, added to h (a sandwich norm) */
static void add_normed(float *h, float *x, const float *w, int n, float eps) {
    rms_norm(x, w, x, n, eps);
    for (int i = 0; i < n; i++) h[i] += x[i];
}

/* One token of each of `batch` (1..SI4_MAX_BATCH) sequences through every layer; h (batch, d)
 * is updated in place. Row b attends to its lens[b] slots slots[b * slot_stride ..] (its own
 * new slot last), or a windowed layer to the last of them. cis_local: RoPE of local layers.
 * Returns 0, or -1 out of memory. */
static int stack_step(StackObject *s, int batch, float *h, const float *cis, const float *cis_local,
                      const int64_t *slots, size_t slot_stride, const int64_t *lens, const int64_t *slot_new,
                      const float *thresholds, int64_t *kept) {
    const int d = s->d, nh = s->n_heads, nkv = s->n_kv, hd = s->head_dim, ffn = s->d_ffn, half = hd / 2;
    const size_t nqkv = (size_t)(nh + 2 * nkv) * hd, row = (size_t)nkv * hd;
    /* the attention's units, one plan per window (the same for every layer of it), and scratch */
    int max_units = 0;
    for (int p = 0; p < s->n_plans; p++) {
        plan_attention(&s->plans[p], s->windows[p], batch, lens, si4_pool_size());
        if (s->plans[p].n_units > max_units) max_units = s->plans[p].n_units;
    }
    const size_t need = (size_t)si4_pool_size() * (size_t)nh * ATTN_CHUNK;
    if (need > s->scores_n) {
        float *p = realloc(s->scores, sizeof(float) * need);
        if (!p) return -1;
        s->scores = p, s->scores_n = need;
    }
    if ((size_t)max_units > s->part_units) {
        float *o = realloc(s->part_o, sizeof(float) * (size_t)max_units * nh * hd);
        if (o) s->part_o = o;
        float *pm = realloc(s->part_m, sizeof(float) * (size_t)max_units * nh);
        if (pm) s->part_m = pm;
        float *pl = realloc(s->part_l, sizeof(float) * (size_t)max_units * nh);
        if (pl) s->part_l = pl;
        if (!o || !pm || !pl) return -1;
        s->part_units = (size_t)max_units;
    }
    int32_t counts[SI4_MAX_BATCH];
    const si4_attend_fn attend = si4_attend_for(si4_current_isa());
    const si4_f16_store_fn store_f16 = si4_f16_store_for(si4_current_isa());
    const si4_q8_store_fn store_q8 = si4_q8_store_for(si4_current_isa());
    const si4_glu_fn glu = si4_glu_for(si4_current_isa());
    for (int l = 0; l < s->n_layers; l++) {
        const proj_t *m = s->proj + (size_t)l * N_PROJ;
        const float *t = thresholds + (size_t)l * N_PROJ;
        int64_t *kl = kept + (size_t)l * N_PROJ;
        void *kc = s->k_cache[l], *vc = s->v_cache[l];
        const float *qn = s->q_norm[l], *kn = s->k_norm[l], *pan = s->post_attn_norm[l], *pfn = s->post_ffn_norm[l];
        const float *rope = s->local[l] ? cis_local : cis;
        /* kept[P] gains every row's own count of inputs read (the columns skipped per row) */
#define GEMV(P, X, Y, NOUT)                                                                                   \
    do {                                                                                                      \
        const int dense = !(t[P] > 0);                                                                        \
        for (int sg = 0; sg < m[P].n_seg; sg++)                                                               \
            if (si4_gemv_locked(m[P].seg[sg], (X), (size_t)m[P].seg[sg]->m.k, batch, (Y) + m[P].row0[sg],     \
                                (size_t)(NOUT), dense ? 0.0f : t[P], dense, counts) < 0)                      \
                return -1;                                                                                    \
        for (int b = 0; b < batch; b++) kl[P] += dense ? m[P].seg[0]->m.k : counts[b];                       \
    } while (0)

        for (int b = 0; b < batch; b++) rms_norm(h + (size_t)b * d, s->attn_norm[l], s->x + (size_t)b * d, d, s->eps);
        GEMV(P_QKV, s->x, s->qkv, nqkv);
        if (s->qkv_bias[l])
            for (int b = 0; b < batch; b++)
                for (size_t i = 0; i < nqkv; i++) s->qkv[(size_t)b * nqkv + i] += s->qkv_bias[l][i];
        for (int b = 0; b < batch; b++) {
            float *qkv = s->qkv + (size_t)b * nqkv;
            const float *rot = rope + (size_t)b * hd;
            for (int head = 0; head < nh + nkv; head++) { /* q and k heads: (a + ib)(c + is) */
                float *v = qkv + (size_t)head * hd;
                const float *w = head < nh ? qn : kn;
                if (w) rms_norm(v, w, v, hd, s->eps); /* QK-norm, before RoPE */
                for (int j = 0; j < half; j++) {
                    const float a = v[2 * j], bb = v[2 * j + 1], c = rot[2 * j], sn = rot[2 * j + 1];
                    v[2 * j] = a * c - bb * sn;
                    v[2 * j + 1] = a * sn + bb * c;
                }
            }
            const float *k = qkv + (size_t)nh * hd, *v = qkv + (size_t)(nh + nkv) * hd;
            if (s->kv_type == SI4_KV_Q8) {
                const size_t q8_row = (size_t)nkv * ((size_t)hd + (size_t)hd / 16); /* bytes */
                store_q8((int8_t *)kc + (size_t)slot_new[b] * q8_row, k, nkv, hd);
                store_q8((int8_t *)vc + (size_t)slot_new[b] * q8_row, v, nkv, hd);
            } else if (s->kv_type == SI4_KV_F16) {
                store_f16((uint16_t *)kc + (size_t)slot_new[b] * row, k, (int)row);
                store_f16((uint16_t *)vc + (size_t)slot_new[b] * row, v, (int)row);
            } else {
                memcpy((float *)kc + (size_t)slot_new[b] * row, k, sizeof(float) * row);
                memcpy((float *)vc + (size_t)slot_new[b] * row, v, sizeof(float) * row);
            }
        }
        attn_job job = {.s = s, .attend = attend, .kc = kc, .vc = vc, .slots = slots, .slot_stride = slot_stride,
                        .batch = batch, .plan = &s->plans[s->plan_of[l]],
                        .scores_per_part = (size_t)nh * ATTN_CHUNK};
        atomic_init(&job.next, 0);
        atomic_init(&job.part_ids, 0);
        const int n_units = job.plan->n_units, parts = si4_pool_size() < n_units ? si4_pool_size() : n_units;
        si4_pool_run(attend_part, &job, parts);
        attn_merge(&job);
        GEMV(P_O, s->att, s->out, d);
        if (pan)
            for (int b = 0; b < batch; b++) add_normed(h + (size_t)b * d, s->out + (size_t)b * d, pan, d, s->eps);
        else
            for (size_t i = 0; i < (size_t)batch * d; i++) h[i] += s->out[i];
        for (int b = 0; b < batch; b++) rms_norm(h + (size_t)b * d, s->ffn_norm[l], s->x + (size_t)b * d, d, s->eps);
        GEMV(P_GU, s->x, s->gu, 2 * ffn);
        for (int b = 0; b < batch; b++) {
            const float *gu = s->gu + (size_t)b * 2 * ffn;
            float *act = s->act + (size_t)b * ffn;
            glu(gu, gu + ffn, act, ffn, s->activation); /* as prompt rows compute it (kernels().glu) */
        }
        GEMV(P_DOWN, s->act, s->out, d);
        if (pfn)
            for (int b = 0; b < batch; b++) add_normed(h + (size_t)b * d, s->out + (size_t)b * d, pfn, d, s->eps);
        else
            for (size_t i = 0; i < (size_t)batch * d; i++) h[i] += s->out[i];
#undef GEMV
    }
    return 0;
}

/* step(h, cis, cis_local, slots, slot_stride, lens, slot_new, batch, thresholds, kept):
 * addresses of h (batch, d) float32, cis (batch, head_dim) float32 [cos, sin] pairs of each
 * row's position, cis_local the same for the local layers' RoPE (0 when there are none),
 * slots (batch, slot_stride) int64 (row b's context, its new token's slot last, lens[b] of
 * them), lens (batch,) int64, slot_new (batch,) int64, thresholds (n_layers * 4,) float32
 * (<= 0: dense), kept (n_layers * 4,) int64 (each projection's inputs read, summed over rows,
 * are added). */
static PyObject *Stack_step(StackObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 10) {
        PyErr_SetString(PyExc_TypeError,
                        "step(h, cis, cis_local, slots, slot_stride, lens, slot_new, batch, thresholds, kept)");
        return NULL;
    }
    float *h = addr(args[0]);
    const float *cis = addr(args[1]), *cis_local = args[2] == Py_None ? NULL : addr(args[2]);
    const int64_t *slots = addr(args[3]);
    const Py_ssize_t stride = PyLong_AsSsize_t(args[4]);
    const int64_t *lens = addr(args[5]), *slot_new = addr(args[6]);
    const long batch = PyLong_AsLong(args[7]);
    const float *t = addr(args[8]);
    int64_t *kept = addr(args[9]);
    if (PyErr_Occurred()) return NULL;
    if (!h || !cis || !slots || !lens || !slot_new || !t || !kept || stride < 1 || batch < 1 || batch > SI4_MAX_BATCH) {
        PyErr_Format(PyExc_ValueError, "step: a null address, or batch %ld outside 1..%d", batch, SI4_MAX_BATCH);
        return NULL;
    }
    if (self->any_local && !cis_local) {
        PyErr_SetString(PyExc_ValueError, "step: a local layer needs cis_local");
        return NULL;
    }
    for (long b = 0; b < batch; b++)
        if (lens[b] < 1 || lens[b] > stride || slot_new[b] < 0) {
            PyErr_SetString(PyExc_ValueError, "step: a row's context is empty or longer than slot_stride");
            return NULL;
        }
    int r;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&si4_call_lock);
    r = stack_step(self, (int)batch, h, cis, cis_local, slots, (size_t)stride, lens, slot_new, t, kept);
    pthread_mutex_unlock(&si4_call_lock);
    Py_END_ALLOW_THREADS
    if (r < 0) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyMethodDef Stack_methods[] = {
    {"step", (PyCFunction)(void (*)(void))Stack_step, METH_FASTCALL, "One decode token of each of 1..8 sequences through every layer."},
    {NULL, NULL, 0, NULL},
};

PyTypeObject si4_stack_type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "llmlocal.native.cpu._kernels.DecodeStack",
    .tp_basicsize = sizeof(StackObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A decoder's layers for batch-1 decode in one call (see module.c).",
    .tp_new = Stack_new,
    .tp_dealloc = (destructor)Stack_dealloc,
    .tp_methods = Stack_methods,
};

