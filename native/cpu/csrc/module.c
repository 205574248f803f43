/* CPython binding: llmlocal.native.cpu._kernels.
 *
 *   Matrix(codes, sz, n, k, group, sz_f16)     wraps the packed arrays (kept alive, no copy)
 *   Matrix.gemv(x, y, batch, x_stride, y_stride, threshold, dense, counts) -> n_kept
 *       x, y, counts: an int address (torch's data_ptr()) or a C-contiguous buffer (numpy; its
 *       format is checked);
 *       x: (batch, x_stride) float32, y: (batch, y_stride) float32, counts: (batch,) int32 or None
 *   Int8Matrix(w, scale)                       a row-major INT8 weight (N, K), values in [-127, 127],
 *                                              with one float32 scale per row (an output head);
 *                                              kept alive, no copy
 *   Int8Matrix.gemv(x, y, batch, x_stride, y_stride)   y = W x (x quantized per 32, see int8_gemv.c)
 *   Matrix.dequantize(out, row0, row1, out_stride)   rows of W as float32, transposed (prefill matmuls)
 *   QMatrix(type, codes, d, m, sc, mn, n, k)   a GGUF-typed weight in its own bytes (qlayout.py), with
 *                                              the same gemv and dequantize (int8 activations, qmat.h)
 *   DecodeStack(config, layers).step(...)    a decoder's layers for one decode token of 1-8 sequences
 *   set_isa(name) / isa() / best_isa(), set_num_threads(n) / num_threads(),
 *   set_spin_us(us) / spin_us(), set_min_part_bytes(b) / min_part_bytes(),
 *   tuning knobs: set_split_mode(m), set_pieces_per_thread(n), set_prefetch_ahead(bytes)
 *
 * Calls are serialised by one lock (the pool and the scratch buffers are shared); the GIL is
 * released while a call runs.
 */
#include "binding.h" /* Python.h first */

#include <stdatomic.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

pthread_mutex_t si4_call_lock = PTHREAD_MUTEX_INITIALIZER;
static int g_best_isa, g_isa;
static si4_kernel_fn g_kernel;
static si8_kernel_fn g_kernel8;
static si4_dequant_fn g_dequant;
static si4_prepare_fn g_prepare;
static size_t g_min_part_bytes = 32768; /* below this much weight data per thread, use fewer threads */
static int g_pieces_per_thread = 1; /* by rows: more bound the wait on a descheduled worker */
/* How a call is split between threads: 0 by rows, 1 by groups of columns, 2 (auto) by groups
 * when there are at least 32 per thread (K >= 2048 for 2 threads: long runs from memory, where
 * it measured 10-25% faster), else by rows (small matrices, often cache-resident). */
static int g_split_mode = 2;
#define QM_GROUP_SLOTS 16

int si4_current_isa(void) { return g_isa; }

/* ---------------------------------------------------------------- scratch (under the lock) */

static struct {
    int32_t *cols, *goff;
    float *xv, *xs, *ybuf, *dx;
    int8_t *qx;
    size_t cols_n, goff_n, xv_n, xs_n, ybuf_n, dx_n, qx_n;
} S;
static qm_kernel_fn g_qkernel;
static int g_qvnni = 1; /* the quantized kernels take a VNNI variant where the CPU has one */
static int g_qamx = 1;  /* ... and, in prefill, AMX tiles where the CPU has them */
static qm_dequant_fn g_qdequant;
/* Prompt rows (QMatrix.tiles) through AMX-BF16 tiles where the CPU has them (qmat_tiles.c) */
static int g_qtiles = 1;
static uint16_t *g_xb; /* their rows of x in bfloat16 (under the lock) */
static size_t g_xb_n;

static int tiles_on(void) {
#ifdef LLMLOCAL_AMX_BF16
    return g_qtiles && g_isa >= SI4_ISA_AVX512 && qm_tiles_usable();
#else
    return 0;
#endif
}

/* Which kernel takes a prompt chunk's attention (attn_tiles): 1 the AMX-BF16 tiles (with the
 * projections' tiles), 2 AVX512-BF16 (a CPU without AMX-BF16, the AVX-512 path), 3 float32 on
 * AVX2 and FMA (any other x86-64 CPU on the AVX2 or AVX-512 path), 0 none (the scalar path; a
 * CPU with the tiles switched off keeps torch's attention, as before there was a second kernel). */
static int attn_kernel(void) {
    if (tiles_on()) return 1;
#ifdef LLMLOCAL_AMX_BF16
    if (qm_tiles_usable()) return 0;
#endif
#ifdef LLMLOCAL_AVX512_BF16
    if (g_isa >= SI4_ISA_AVX512 && __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512dq")) return 2;
#endif
#ifdef LLMLOCAL_X86_VARIANTS
    if (g_isa >= SI4_ISA_AVX2) return 3;
#endif
    return 0;
}

static int grow(void **p, size_t *cap, size_t n, size_t elem) {
    if (n <= *cap) return 0;
    void *q = NULL;
    if (posix_memalign(&q, 64, n * elem)) return -1;
    free(*p);
    *p = q;
    *cap = n;
    return 0;
}

/* ---------------------------------------------------------------- the parallel part */

#define MAX_GROUP_PIECES 16

/* The work of one call, shared out in pieces (taken dynamically, see run_part) either
 *   by rows:   piece c computes 128-row units [U c / C, U (c + 1) / C) over every group, or
 *   by groups: piece c computes every row over the groups [gbound[c], gbound[c+1]) into its
 *              own partial y, and the caller sums the partials.
 * Splitting by groups keeps each column's whole run of rows in one thread: longer runs
 * stream better from memory (the pieces hold about equal numbers of kept columns). */
typedef struct {
    const si4_matrix *m; /* n, npad (and, without qm, the INT4 matrix) */
    const si4_acts *a;
    si4_kernel_fn kernel;
    const qm_matrix *qm; /* a QMatrix: its matrix, acts and kernel instead */
    const qm_acts *qa;
    qm_kernel_fn qkernel;
    int batch, n_groups;
    const int32_t *goff; /* the groups' offsets into the kept columns (or slots) */
    float *ybuf;       /* (pieces if by groups else 1, batch, npad) */
    float *y;
    size_t y_stride;
    int n_pieces;
    int by_groups;
    /* gated: W is [gate; up], f rows each, and y (batch, f) = act(gate x) * (up x), activation
     * glu - 1 (glu_body.h), made as each piece's rows of both halves are done */
    int glu, f;
    si4_glu_fn glu_fn;
    int gbound[MAX_GROUP_PIECES + 1];
    atomic_int next;   /* the next piece to take */
} job_t;

static void copy_out(const job_t *j, int r0, int r1) {
    const int rn = r1 < j->m->n ? r1 : j->m->n;
    for (int b = 0; b < j->batch && rn > r0; b++)
        memcpy(j->y + (size_t)b * j->y_stride + r0, j->ybuf + (size_t)b * j->m->npad + r0,
               sizeof(float) * (size_t)(rn - r0));
}

/* The rows pieces split: W's, or with glu its gate half's (each piece also makes the same rows of up). */
static int job_rows(const job_t *j) { return j->glu ? j->f : j->m->npad; }

/* y's rows [r0, r1) = act(gate) * up from the two halves' products in ybuf. */
static void glu_out(const job_t *j, int r0, int r1) {
    for (int b = 0; b < j->batch; b++) {
        const float *g = j->ybuf + (size_t)b * j->m->npad;
        j->glu_fn(g + r0, g + j->f + r0, j->y + (size_t)b * j->y_stride + r0, r1 - r0, j->glu - 1);
    }
}

static void run_kernel(const job_t *j, int r0, int r1, int g0, int g1, float *ybuf) {
    if (j->qm) j->qkernel(j->qm, j->qa, r0, r1, g0, g1, ybuf);
    else j->kernel(j->m, j->a, r0, r1, g0, g1, ybuf);
}

static void run_part(void *arg, int part, int n_parts) {
    (void)part, (void)n_parts;
    job_t *j = arg;
    const int npad = job_rows(j), units = (npad + SI4_UNIT_ROWS - 1) / SI4_UNIT_ROWS;
    for (int c; (c = atomic_fetch_add(&j->next, 1)) < j->n_pieces;) {
        if (j->by_groups) {
            run_kernel(j, 0, npad, j->gbound[c], j->gbound[c + 1], j->ybuf + (size_t)c * j->batch * npad);
            continue;
        }
        const int u0 = (int)((long)units * c / j->n_pieces), u1 = (int)((long)units * (c + 1) / j->n_pieces);
        const int r0 = u0 * SI4_UNIT_ROWS, r1 = u1 * SI4_UNIT_ROWS < npad ? u1 * SI4_UNIT_ROWS : npad;
        if (r0 >= r1) continue;
        run_kernel(j, r0, r1, 0, j->n_groups, j->ybuf);
        if (!j->glu) {
            copy_out(j, r0, r1);
            continue;
        }
        run_kernel(j, j->f + r0, j->f + r1, 0, j->n_groups, j->ybuf);
        glu_out(j, r0, r1);
    }
}

/* y = the sum of the pieces' partial products (by groups). */
static void sum_pieces(const job_t *j) {
    const size_t npad = (size_t)j->m->npad, slice = (size_t)j->batch * npad;
    for (int b = 0; b < j->batch; b++) {
        float *y = j->y + (size_t)b * j->y_stride;
        const float *p = j->ybuf + (size_t)b * npad;
        for (int n = 0; n < j->m->n; n++) {
            float v = p[n];
            for (int c = 1; c < j->n_pieces; c++) v += p[c * slice + n];
            y[n] = v;
        }
    }
}

/* Splits the job between `parts` threads (see job_t); ybuf must hold parts * batch * npad. */
static void plan_job(job_t *j, int parts) {
    const int units = (job_rows(j) + SI4_UNIT_ROWS - 1) / SI4_UNIT_ROWS;
    const int G = j->n_groups;
    /* the interleaved layout (and the column layout's prefill) sums a row over all of K at once:
     * always by rows */
    j->by_groups = !j->glu && parts > 1 && parts <= MAX_GROUP_PIECES && parts <= G &&
                   !(j->qm && (j->qm->interleaved || j->batch > SI4_MAX_BATCH)) &&
                   (g_split_mode == 1 || (g_split_mode == 2 && G >= 32 * parts));
    if (j->by_groups) {
        j->n_pieces = parts;
        const int32_t *goff = j->goff;
        /* pieces of whole super-blocks (their factors are applied once per super-block), of
         * equal work: a quantized matrix's group costs about QM_GROUP_SLOTS slots besides its
         * own (the factors, the running sums; measured on the 512-bit column kernel), which
         * balances the pieces when few columns are kept */
        const int per_sb = j->qm && j->qm->dgroup > j->qm->group ? j->qm->dgroup / j->qm->group : 1;
        const long fixed = j->qm ? QM_GROUP_SLOTS : 0, work = goff[G] + fixed * G;
        int g = 0;
        for (int c = 0; c <= parts; c++) { /* first super-block with at least work * c / parts before it */
            const long want = work * c / parts;
            while (g < G && goff[g] + fixed * g < want) g += per_sb;
            j->gbound[c] = c == parts || g > G ? G : g;
        }
    } else {
        j->n_pieces = parts == 1 ? 1 : (g_pieces_per_thread * parts < units ? g_pieces_per_thread * parts : units);
    }
    atomic_init(&j->next, 0);
}

/* ---------------------------------------------------------------- one GEMV (under the lock) */

/* The thread count for `bytes` of weight data, and the job split between them. */
static void share_out(job_t *job, size_t bytes) {
    int parts = (int)(bytes / (g_min_part_bytes ? g_min_part_bytes : 1));
    const int units = (job_rows(job) + SI4_UNIT_ROWS - 1) / SI4_UNIT_ROWS;
    if (parts > units) parts = units;
    if (parts < 1) parts = 1;
    if (parts > si4_pool_size()) parts = si4_pool_size();
    /* Pieces are taken dynamically, so the caller also takes those of a worker that has not
     * started (asleep, or its core busy). */
    plan_job(job, parts);
    si4_pool_run(run_part, job, parts);
    if (job->by_groups) sum_pieces(job);
}

/* y = W x' for a QMatrix: x quantized per 32 inputs (qmat.h). */
static int qm_gemv_locked(const MatrixObject *mo, const float *px, size_t x_stride, int batch, float *py,
                          size_t y_stride, float threshold, int dense, int32_t *pcnt, int glu) {
    const qm_matrix *q = &mo->q;
    const int G = q->k / q->group;
    const size_t slots = (size_t)q->k + 4 * (size_t)G, nq = (size_t)q->k / QM_QBLOCK;
    if (grow((void **)&S.cols, &S.cols_n, slots, 4) || grow((void **)&S.goff, &S.goff_n, G + 1, 4) ||
        grow((void **)&S.qx, &S.qx_n, slots * batch, 1) || grow((void **)&S.dx, &S.dx_n, nq * batch, 4) ||
        grow((void **)&S.xs, &S.xs_n, (size_t)G * batch, 4) ||
        grow((void **)&S.ybuf, &S.ybuf_n, (size_t)q->npad * batch * si4_pool_size(), 4))
        return -1;
    int n_slots;
    /* more rows than a decode step (prefill): nearly every column is some row's, so every column
     * gets its slot (zeroed values computed), which the prefill kernels want */
    const int all_columns = q->interleaved || batch > SI4_MAX_BATCH;
    const int n_kept = qm_prepare(px, x_stride, batch, q->k, q->group, threshold, dense, all_columns, S.cols, S.goff, S.qx, slots,
                                  S.dx, nq, S.xs, pcnt, &n_slots);
    qm_acts a = {.batch = batch, .n_groups = G, .n_slots = n_slots, .cols = S.cols, .goff = S.goff, .qx = S.qx,
                 .qx_stride = slots, .dx = S.dx, .dx_stride = nq, .xs = S.xs};
    job_t job = {.m = &mo->m, .qm = q, .qa = &a, .qkernel = g_qkernel, .batch = batch, .n_groups = G, .goff = S.goff,
                 .ybuf = S.ybuf, .y = py, .y_stride = y_stride, .glu = glu, .f = mo->m.n / 2};
    if (glu) job.glu_fn = si4_glu_for(g_isa);
    /* threads by one row's bytes: a row's sums are split, so rounded, the same in any batch;
     * the column layout's groups cost work however few of their columns are kept */
    const size_t work = (size_t)n_kept + (q->interleaved ? 0 : (size_t)QM_GROUP_SLOTS * (size_t)G);
    share_out(&job, work * q->colstride);
    return n_kept;
}

/* y = W x' for `batch` rows; returns the columns read (the union over the rows), -1 when out
 * of memory. The caller holds si4_call_lock. */
int si4_gemv_locked(const MatrixObject *mo, const float *px, size_t x_stride, int batch, float *py, size_t y_stride,
                    float threshold, int dense, int32_t *pcnt) {
    if (mo->quant) return qm_gemv_locked(mo, px, x_stride, batch, py, y_stride, threshold, dense, pcnt, 0);
    const si4_matrix *m = &mo->m;
    const int G = m->k / m->group;
    if (grow((void **)&S.cols, &S.cols_n, m->k, 4) || grow((void **)&S.goff, &S.goff_n, G + 1, 4) ||
        grow((void **)&S.xv, &S.xv_n, (size_t)m->k * batch, 4) || grow((void **)&S.xs, &S.xs_n, (size_t)G * batch, 4) ||
        grow((void **)&S.ybuf, &S.ybuf_n, (size_t)m->npad * batch * si4_pool_size(), 4))
        return -1;
    const int n_kept = g_prepare(px, x_stride, batch, m->k, m->group, threshold, dense, S.cols, S.goff, S.xv, S.xs, pcnt);
    si4_acts a = {.batch = batch, .n_groups = G, .n_kept = n_kept, .cols = S.cols, .goff = S.goff,
                  .xv = S.xv, .xv_stride = (size_t)m->k, .xs = S.xs};
    job_t job = {.m = m, .a = &a, .kernel = g_kernel, .batch = batch, .n_groups = G, .goff = S.goff, .ybuf = S.ybuf,
                 .y = py, .y_stride = y_stride};
    /* enough weight bytes per thread to pay for the hand-off */
    share_out(&job, (size_t)n_kept * m->colstride * batch);
    return n_kept;
}

/* ---------------------------------------------------------------- argument helpers */

/* An int address, or a C-contiguous buffer of at least `need` bytes whose struct format is
 * `fmt` ('f' float32, 'i' int32, 0: any); the buffer is released by the caller. */
static int get_ptr(PyObject *obj, Py_buffer *view, int writable, size_t need, char fmt, void **out, const char *what) {
    view->obj = NULL;
    if (PyLong_Check(obj)) {
        *out = PyLong_AsVoidPtr(obj);
        if (PyErr_Occurred()) return -1;
        if (!*out) {
            PyErr_Format(PyExc_ValueError, "%s is a null pointer", what);
            return -1;
        }
        return 0;
    }
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0)) < 0)
        return -1;
    const char *f = view->format ? view->format : "B";
    if (*f == '<' || *f == '=' || *f == '@') f++;
    if (fmt && (f[0] != fmt || f[1] != 0)) {
        PyErr_Format(PyExc_TypeError, "%s must hold %s, not format '%s'", what, fmt == 'f' ? "float32" : fmt == 'H' ? "uint16" : "int32",
                     view->format ? view->format : "B");
    } else if ((size_t)view->len < need) {
        PyErr_Format(PyExc_ValueError, "%s holds %zd bytes, the call needs %zu", what, view->len, need);
    } else {
        *out = view->buf;
        return 0;
    }
    PyBuffer_Release(view);
    view->obj = NULL;
    return -1;
}

static void release(Py_buffer *view) {
    if (view->obj) PyBuffer_Release(view);
}

/* A call's x (batch rows of k floats, x_stride apart, read) and y (batch rows of ny floats,
 * y_stride apart, written): both views, or -1 with an exception set and neither held. */
static int get_xy(PyObject *x, PyObject *y, long batch, size_t x_stride, int k, size_t y_stride, int ny, Py_buffer *vx,
                  Py_buffer *vy, void **px, void **py) {
    if (get_ptr(x, vx, 0, sizeof(float) * (x_stride * (size_t)(batch - 1) + (size_t)k), 'f', px, "x") < 0) return -1;
    if (get_ptr(y, vy, 1, sizeof(float) * (y_stride * (size_t)(batch - 1) + (size_t)ny), 'f', py, "y") < 0) {
        release(vx);
        return -1;
    }
    return 0;
}

/* ---------------------------------------------------------------- Matrix */

static void Matrix_dealloc(MatrixObject *self) {
    release(&self->codes);
    release(&self->sz);
    release(&self->qd);
    release(&self->qm);
    release(&self->qsc);
    release(&self->qmn);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Matrix_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"codes", "sz", "n", "k", "group", "sz_f16", NULL};
    PyObject *codes, *sz;
    int n, k, group, sz_f16;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOiiip", kwlist, &codes, &sz, &n, &k, &group, &sz_f16))
        return NULL;
    if (n < 1 || k < 1 || group < 1 || k % group) {
        PyErr_Format(PyExc_ValueError, "bad matrix shape: n=%d, k=%d, group=%d", n, k, group);
        return NULL;
    }
    MatrixObject *self = (MatrixObject *)type->tp_alloc(type, 0);
    if (!self) return NULL;
    self->codes.obj = self->sz.obj = self->qd.obj = self->qm.obj = self->qsc.obj = self->qmn.obj = NULL;
    const int npad = (n + SI4_CHUNK_ROWS - 1) / SI4_CHUNK_ROWS * SI4_CHUNK_ROWS;
    const size_t colstride = (size_t)npad / 2;
    const size_t sz_bytes = (size_t)(k / group) * 2 * npad * (sz_f16 ? 2 : 4);
    void *pc, *ps;
    if (get_ptr(codes, &self->codes, 0, (size_t)k * colstride, 0, &pc, "codes") < 0 ||
        get_ptr(sz, &self->sz, 0, sz_bytes, 0, &ps, "sz") < 0) {
        Py_DECREF(self);
        return NULL;
    }
    if (!self->codes.obj || !self->sz.obj) {
        PyErr_SetString(PyExc_TypeError, "codes and sz must be buffers (numpy arrays), which the Matrix keeps alive");
        Py_DECREF(self);
        return NULL;
    }
    self->m = (si4_matrix){.codes = pc, .sz = ps, .n = n, .npad = npad, .k = k, .group = group,
                           .sz_f16 = sz_f16, .colstride = colstride};
    return (PyObject *)self;
}

static PyObject *Matrix_gemv(MatrixObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError, "gemv(x, y, batch, x_stride, y_stride, threshold, dense, counts)");
        return NULL;
    }
    const si4_matrix *m = &self->m;
    const long batch = PyLong_AsLong(args[2]);
    /* m->n, m->k are the shape of either kind */
    const Py_ssize_t xs_ = PyLong_AsSsize_t(args[3]), ys_ = PyLong_AsSsize_t(args[4]);
    const double threshold = PyFloat_AsDouble(args[5]);
    const int dense = PyObject_IsTrue(args[6]);
    if (PyErr_Occurred() || dense < 0) return NULL;
    const int max_batch = self->quant ? QM_MAX_BATCH : SI4_MAX_BATCH;
    if (batch < 1 || batch > max_batch || xs_ < m->k || ys_ < m->n) {
        PyErr_Format(PyExc_ValueError, "gemv: batch %ld must be 1..%d, x_stride >= %d, y_stride >= %d",
                     batch, max_batch, m->k, m->n);
        return NULL;
    }
    const size_t x_stride = (size_t)xs_, y_stride = (size_t)ys_;
    Py_buffer vx, vy, vc;
    void *px, *py, *pcnt = NULL;
    vc.obj = NULL;
    if (get_xy(args[0], args[1], batch, x_stride, m->k, y_stride, m->n, &vx, &vy, &px, &py) < 0) return NULL;
    if (args[7] != Py_None && get_ptr(args[7], &vc, 1, sizeof(int32_t) * batch, 'i', &pcnt, "counts") < 0) {
        release(&vx);
        release(&vy);
        return NULL;
    }

    int n_kept;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&si4_call_lock);
    n_kept = si4_gemv_locked(self, px, x_stride, (int)batch, py, y_stride, (float)threshold, dense, pcnt);
    pthread_mutex_unlock(&si4_call_lock);
    Py_END_ALLOW_THREADS
    release(&vx);
    release(&vy);
    release(&vc);
    if (n_kept < 0) return PyErr_NoMemory();
    return PyLong_FromLong(n_kept);
}

/* gemv_glu(x, y, batch, x_stride, y_stride, activation): y (batch, f) = act(gate x) * (up x) for a
 * quantized matrix in the interleaved layout whose rows are [gate; up], f each (f a multiple of
 * 32): the gated MLP's activation made as the threads finish their rows of both halves, so the
 * (batch, 2 f) product is never written out. Every column, activation 0 silu, 1 gelu-tanh. */
static PyObject *Matrix_gemv_glu(MatrixObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "gemv_glu(x, y, batch, x_stride, y_stride, activation)");
        return NULL;
    }
    const si4_matrix *m = &self->m;
    const long batch = PyLong_AsLong(args[2]), activation = PyLong_AsLong(args[5]);
    const Py_ssize_t xs_ = PyLong_AsSsize_t(args[3]), ys_ = PyLong_AsSsize_t(args[4]);
    if (PyErr_Occurred()) return NULL;
    if (!self->quant || !self->q.interleaved || m->n % 64) {
        PyErr_SetString(PyExc_ValueError, "gemv_glu needs a quantized matrix in the interleaved layout of 2 f rows, f a multiple of 32");
        return NULL;
    }
    const int f = m->n / 2;
    if (batch < 1 || batch > QM_MAX_BATCH || xs_ < m->k || ys_ < f || (activation != 0 && activation != 1)) {
        PyErr_Format(PyExc_ValueError, "gemv_glu: batch %ld must be 1..%d, x_stride >= %d, y_stride >= %d, activation 0 or 1",
                     batch, QM_MAX_BATCH, m->k, f);
        return NULL;
    }
    const size_t x_stride = (size_t)xs_, y_stride = (size_t)ys_;
    Py_buffer vx, vy;
    void *px, *py;
    if (get_xy(args[0], args[1], batch, x_stride, m->k, y_stride, f, &vx, &vy, &px, &py) < 0) return NULL;
    int n_kept;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&si4_call_lock);
    n_kept = qm_gemv_locked(self, px, x_stride, (int)batch, py, y_stride, 0.0f, 1, NULL, 1 + (int)activation);
    pthread_mutex_unlock(&si4_call_lock);
    Py_END_ALLOW_THREADS
    release(&vx);
    release(&vy);
    if (n_kept < 0) return PyErr_NoMemory();
    return PyLong_FromLong(n_kept);
}

#define DEQUANT_PIECE 16 /* columns */

typedef struct {
    const si4_matrix *m;
    si4_dequant_fn fn;
    const qm_matrix *qm; /* a QMatrix: qm_dequant instead */
    float *out;
    size_t stride;
    int row0, row1;
    atomic_int next;
} dequant_job;

static void run_dequant(void *arg, int part, int n_parts) {
    (void)part, (void)n_parts;
    dequant_job *j = arg;
    const int pieces = (j->m->k + DEQUANT_PIECE - 1) / DEQUANT_PIECE;
    for (int c; (c = atomic_fetch_add(&j->next, 1)) < pieces;) {
        const int j0 = c * DEQUANT_PIECE, j1 = j0 + DEQUANT_PIECE < j->m->k ? j0 + DEQUANT_PIECE : j->m->k;
        if (j->qm) g_qdequant(j->qm, j0, j1, j->row0, j->row1, j->out + (size_t)j0 * j->stride, j->stride);
        else j->fn(j->m, j0, j1, j->row0, j->row1, j->out + (size_t)j0 * j->stride, j->stride);
    }
}

/* dequantize(out, row0, row1, out_stride): rows [row0, row1) (multiples of 32, row1 <= npad) of
 * the dequantized weight, transposed: out (k, out_stride) float32, out[j, n - row0] = W[n, j]. */
static PyObject *Matrix_dequantize(MatrixObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "dequantize(out, row0, row1, out_stride)");
        return NULL;
    }
    const si4_matrix *m = &self->m;
    const long row0 = PyLong_AsLong(args[1]), row1 = PyLong_AsLong(args[2]);
    const Py_ssize_t stride = PyLong_AsSsize_t(args[3]);
    if (PyErr_Occurred()) return NULL;
    if (row0 < 0 || row0 >= row1 || row1 > m->npad || row0 % SI4_CHUNK_ROWS || row1 % SI4_CHUNK_ROWS ||
        stride < row1 - row0) {
        PyErr_Format(PyExc_ValueError, "dequantize: rows [%ld, %ld) must be multiples of %d within %d, out_stride %zd >= %ld",
                     row0, row1, SI4_CHUNK_ROWS, m->npad, stride, row1 - row0);
        return NULL;
    }
    Py_buffer vo;
    void *po;
    if (get_ptr(args[0], &vo, 1, sizeof(float) * ((size_t)stride * (m->k - 1) + (size_t)(row1 - row0)), 'f', &po, "out") < 0)
        return NULL;
    dequant_job job = {.m = m, .fn = g_dequant, .qm = self->quant ? &self->q : NULL, .out = po, .stride = (size_t)stride, .row0 = (int)row0, .row1 = (int)row1};
    atomic_init(&job.next, 0);
    const size_t bytes = (size_t)m->k * (size_t)(row1 - row0) * 4; /* written */
    size_t parts = bytes / (g_min_part_bytes ? g_min_part_bytes : 1);
    parts = parts < 1 ? 1 : parts > 256 ? 256 : parts;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&si4_call_lock);
    si4_pool_run(run_dequant, &job, (int)parts);
    pthread_mutex_unlock(&si4_call_lock);
    Py_END_ALLOW_THREADS
    release(&vo);
    Py_RETURN_NONE;
}

#ifdef LLMLOCAL_AMX_BF16
/* tiles(x, y, batch, x_stride, y_stride, threshold, dense) -> inputs kept: a QMatrix's y = W x'
 * for any number of rows of x through AMX-BF16 tiles (qmat_tiles.c); prompt rows. */
static PyObject *Matrix_tiles(MatrixObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "tiles(x, y, batch, x_stride, y_stride, threshold, dense)");
        return NULL;
    }
    if (!self->quant || !tiles_on()) {
        PyErr_SetString(PyExc_RuntimeError, "tiles: a QMatrix on a CPU with AMX-BF16 tiles, switched on (qmat_tiles())");
        return NULL;
    }
    const qm_matrix *q = &self->q;
    const long batch = PyLong_AsLong(args[2]);
    const Py_ssize_t xs_ = PyLong_AsSsize_t(args[3]), ys_ = PyLong_AsSsize_t(args[4]);
    const double threshold = PyFloat_AsDouble(args[5]);
    const int dense = PyObject_IsTrue(args[6]);
    if (PyErr_Occurred() || dense < 0) return NULL;
    if (batch < 1 || batch > (1 << 20) || xs_ < q->k || ys_ < q->n) {
        PyErr_Format(PyExc_ValueError, "tiles: batch %ld must be 1..%d, x_stride >= %d, y_stride >= %d", batch, 1 << 20,
                     q->k, q->n);
        return NULL;
    }
    const size_t x_stride = (size_t)xs_, y_stride = (size_t)ys_;
    Py_buffer vx, vy;
    void *px, *py;
    if (get_xy(args[0], args[1], batch, x_stride, q->k, y_stride, q->n, &vx, &vy, &px, &py) < 0) return NULL;
    long kept;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&si4_call_lock);
    kept = grow((void **)&g_xb, &g_xb_n, (size_t)(batch + 15) / 16 * 16 * (size_t)q->k, 2)
               ? -1
               : qm_tiles_gemm(q, px, x_stride, (int)batch, (float)threshold, dense, py, y_stride, g_xb);
    pthread_mutex_unlock(&si4_call_lock);
    Py_END_ALLOW_THREADS
    release(&vx);
    release(&vy);
    if (kept < 0) return PyErr_NoMemory();
    return PyLong_FromLong(kept);
}
#endif

static PyObject *Matrix_get_shape(MatrixObject *self, void *closure) {
    (void)closure;
    return Py_BuildValue("(ii)", self->m.n, self->m.k);
}

static PyMethodDef Matrix_methods[] = {
    {"gemv", (PyCFunction)(void (*)(void))Matrix_gemv, METH_FASTCALL,
     "gemv(x, y, batch, x_stride, y_stride, threshold, dense, counts) -> columns kept"},
    {"gemv_glu", (PyCFunction)(void (*)(void))Matrix_gemv_glu, METH_FASTCALL,
     "gemv_glu(x, y, batch, x_stride, y_stride, activation): y = act(gate x) * (up x) for W = [gate; up]"},
    {"dequantize", (PyCFunction)(void (*)(void))Matrix_dequantize, METH_FASTCALL,
     "dequantize(out, row0, row1, out_stride): rows [row0, row1) of W, transposed, into out (k, out_stride)"},
#ifdef LLMLOCAL_AMX_BF16
    {"tiles", (PyCFunction)(void (*)(void))Matrix_tiles, METH_FASTCALL,
     "tiles(x, y, batch, x_stride, y_stride, threshold, dense) -> inputs kept: y = W x' through AMX-BF16 tiles"},
#endif
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Matrix_getset[] = {
    {"shape", (getter)Matrix_get_shape, NULL, "(n, k)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyTypeObject si4_matrix_type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "llmlocal.native.cpu._kernels.Matrix",
    .tp_basicsize = sizeof(MatrixObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Packed INT4 weight (see layout.py) bound to the GEMV kernels.",
    .tp_new = Matrix_new,
    .tp_dealloc = (destructor)Matrix_dealloc,
    .tp_methods = Matrix_methods,
    .tp_getset = Matrix_getset,
};

/* ---------------------------------------------------------------- QMatrix */

/* The format of each GGUF type (qmat.h): bits, group, d per, off, and which factor arrays it has. */
typedef struct {
    int type, bits, group, dgroup, off, has_m, has_sc, sc_signed, has_mn;
    const char *name;
} qm_format;

static const qm_format QM_FORMATS[] = {
    {QM_Q4_0, 4, 32, 32, 8, 0, 0, 0, 0, "Q4_0"},    {QM_Q4_1, 4, 32, 32, 0, 1, 0, 0, 0, "Q4_1"},
    {QM_Q5_0, 5, 32, 32, 16, 0, 0, 0, 0, "Q5_0"},   {QM_Q5_1, 5, 32, 32, 0, 1, 0, 0, 0, "Q5_1"},
    {QM_Q8_0, 8, 32, 32, 0, 0, 0, 0, 0, "Q8_0"},    {QM_Q4_K, 4, 32, 256, 0, 1, 1, 0, 1, "Q4_K"},
    {QM_Q5_K, 5, 32, 256, 0, 1, 1, 0, 1, "Q5_K"},   {QM_Q6_K, 6, 16, 256, 32, 0, 1, 1, 0, "Q6_K"},
};

/* QMatrix(type, codes, d, m, sc, mn, n, k, interleaved=False): the arrays of qlayout.py (kept
 * alive, no copy); m, sc, mn None where the type has none. */
static PyObject *QMatrix_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"type", "codes", "d", "m", "sc", "mn", "n", "k", "interleaved", NULL};
    PyObject *codes, *d, *m, *sc, *mn;
    int qtype, n, k, il = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "iOOOOOii|p", kwlist, &qtype, &codes, &d, &m, &sc, &mn, &n, &k, &il))
        return NULL;
    const qm_format *f = NULL;
    for (size_t i = 0; i < sizeof QM_FORMATS / sizeof QM_FORMATS[0]; i++)
        if (QM_FORMATS[i].type == qtype) f = &QM_FORMATS[i];
    if (!f) return PyErr_Format(PyExc_ValueError, "QMatrix: ggml type %d has no native kernel", qtype);
    if (n < 1 || k < 1 || k % f->dgroup)
        return PyErr_Format(PyExc_ValueError, "QMatrix: %s needs k a multiple of %d, not n=%d, k=%d", f->name, f->dgroup, n, k);
    if ((m != Py_None) != f->has_m || (sc != Py_None) != f->has_sc || (mn != Py_None) != f->has_mn)
        return PyErr_Format(PyExc_ValueError, "QMatrix: %s takes m %s, sc %s, mn %s", f->name, f->has_m ? "yes" : "None",
                            f->has_sc ? "yes" : "None", f->has_mn ? "yes" : "None");
    MatrixObject *self = (MatrixObject *)type->tp_alloc(type, 0);
    if (!self) return NULL;
    self->codes.obj = self->sz.obj = self->qd.obj = self->qm.obj = self->qsc.obj = self->qmn.obj = NULL;
    const int npad = (n + SI4_CHUNK_ROWS - 1) / SI4_CHUNK_ROWS * SI4_CHUNK_ROWS;
    const size_t colstride = (size_t)npad * f->bits / 8, nd = (size_t)(k / f->dgroup) * npad, ng = (size_t)(k / f->group) * npad;
    void *pc, *pd, *pm = NULL, *psc = NULL, *pmn = NULL;
    if (get_ptr(codes, &self->codes, 0, (size_t)k * colstride, 0, &pc, "codes") < 0 ||
        get_ptr(d, &self->qd, 0, nd * 2, 'H', &pd, "d") < 0 ||
        (f->has_m && get_ptr(m, &self->qm, 0, nd * 2, 'H', &pm, "m") < 0) ||
        (f->has_sc && get_ptr(sc, &self->qsc, 0, ng, 0, &psc, "sc") < 0) ||
        (f->has_mn && get_ptr(mn, &self->qmn, 0, nd * 4, 0, &pmn, "mn") < 0)) {
        Py_DECREF(self);
        return NULL;
    }
    if (!self->codes.obj || !self->qd.obj || (f->has_m && !self->qm.obj) || (f->has_sc && !self->qsc.obj) ||
        (f->has_mn && !self->qmn.obj)) {
        PyErr_SetString(PyExc_TypeError, "QMatrix: the arrays must be buffers (numpy arrays), which it keeps alive");
        Py_DECREF(self);
        return NULL;
    }
    self->quant = 1;
    self->q = (qm_matrix){.codes = pc, .d = pd, .m = pm, .sc = psc, .mn = pmn, .type = qtype, .bits = f->bits,
                          .group = f->group, .dgroup = f->dgroup, .off = f->off, .sc_signed = f->sc_signed,
                          .interleaved = il, .n = n,
                          .npad = npad, .k = k, .colstride = colstride};
    self->m = (si4_matrix){.n = n, .npad = npad, .k = k, .group = f->group, .colstride = colstride};
    return (PyObject *)self;
}

PyTypeObject si4_qmatrix_type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "llmlocal.native.cpu._kernels.QMatrix",
    .tp_basicsize = sizeof(MatrixObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A GGUF-typed weight in its own bytes (see qlayout.py), bound to the int8-activation kernels.",
    .tp_new = QMatrix_new,
    .tp_dealloc = (destructor)Matrix_dealloc,
    .tp_methods = Matrix_methods,
    .tp_getset = Matrix_getset,
};

/* ---------------------------------------------------------------- Int8Matrix */

typedef struct {
    PyObject_HEAD const int8_t *w;
    const float *scale;
    int n, k;
    Py_buffer wbuf, sbuf;
} Int8MatrixObject;

static void Int8Matrix_dealloc(Int8MatrixObject *self) {
    release(&self->wbuf);
    release(&self->sbuf);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Int8Matrix_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"w", "scale", NULL};
    PyObject *w, *scale;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO", kwlist, &w, &scale)) return NULL;
    Int8MatrixObject *self = (Int8MatrixObject *)type->tp_alloc(type, 0);
    if (!self) return NULL;
    self->wbuf.obj = self->sbuf.obj = NULL;
    if (PyObject_GetBuffer(w, &self->wbuf, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | PyBUF_ND) < 0) {
        Py_DECREF(self);
        return NULL;
    }
    const char *f = self->wbuf.format ? self->wbuf.format : "B";
    if (self->wbuf.ndim != 2 || strcmp(f, "b") || self->wbuf.shape[0] < 1 || self->wbuf.shape[1] < 1 ||
        self->wbuf.shape[0] > INT32_MAX || self->wbuf.shape[1] > INT32_MAX) {
        PyErr_Format(PyExc_TypeError, "w must be a non-empty 2-D C-contiguous int8 array, not %d-D format '%s'",
                     self->wbuf.ndim, f);
        Py_DECREF(self);
        return NULL;
    }
    self->n = (int)self->wbuf.shape[0], self->k = (int)self->wbuf.shape[1];
    const int8_t *wp = self->wbuf.buf;
    for (size_t i = 0; i < (size_t)self->n * self->k; i++)
        if (wp[i] == INT8_MIN) { /* the kernels negate weights: -128 has no int8 negation */
            PyErr_SetString(PyExc_ValueError, "w holds -128: INT8 weights must lie in [-127, 127]");
            Py_DECREF(self);
            return NULL;
        }
    void *ps;
    if (get_ptr(scale, &self->sbuf, 0, sizeof(float) * (size_t)self->n, 'f', &ps, "scale") < 0) {
        Py_DECREF(self);
        return NULL;
    }
    if (!self->sbuf.obj) {
        PyErr_SetString(PyExc_TypeError, "scale must be a buffer (a numpy array), which the Int8Matrix keeps alive");
        Py_DECREF(self);
        return NULL;
    }
    self->w = self->wbuf.buf, self->scale = ps;
    return (PyObject *)self;
}

static PyObject *Int8Matrix_gemv(Int8MatrixObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "gemv(x, y, batch, x_stride, y_stride)");
        return NULL;
    }
    const long batch = PyLong_AsLong(args[2]);
    const Py_ssize_t xs_ = PyLong_AsSsize_t(args[3]), ys_ = PyLong_AsSsize_t(args[4]);
    if (PyErr_Occurred()) return NULL;
    if (batch < 1 || xs_ < self->k || ys_ < self->n) {
        PyErr_Format(PyExc_ValueError, "gemv: batch %ld must be >= 1, x_stride >= %d, y_stride >= %d", batch,
                     self->k, self->n);
        return NULL;
    }
    const size_t x_stride = (size_t)xs_, y_stride = (size_t)ys_;
    Py_buffer vx, vy;
    void *px, *py;
    if (get_xy(args[0], args[1], batch, x_stride, self->k, y_stride, self->n, &vx, &vy, &px, &py) < 0) return NULL;
    /* enough weight bytes per thread to pay for the hand-off */
    const size_t bytes = (size_t)self->n * self->k;
    const size_t parts = bytes / (g_min_part_bytes ? g_min_part_bytes : 1);
    int r;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&si4_call_lock);
    r = si8_gemv(g_kernel8, parts > 256 ? 256 : (int)parts, self->w, self->scale, self->n, self->k, px, x_stride,
                 (int)batch, py, y_stride);
    pthread_mutex_unlock(&si4_call_lock);
    Py_END_ALLOW_THREADS
    release(&vx);
    release(&vy);
    if (r < 0) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyObject *Int8Matrix_get_shape(Int8MatrixObject *self, void *closure) {
    (void)closure;
    return Py_BuildValue("(ii)", self->n, self->k);
}

static PyMethodDef Int8Matrix_methods[] = {
    {"gemv", (PyCFunction)(void (*)(void))Int8Matrix_gemv, METH_FASTCALL, "gemv(x, y, batch, x_stride, y_stride)"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Int8Matrix_getset[] = {
    {"shape", (getter)Int8Matrix_get_shape, NULL, "(n, k)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject si8_matrix_type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "llmlocal.native.cpu._kernels.Int8Matrix",
    .tp_basicsize = sizeof(Int8MatrixObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Row-major INT8 weight with one scale per row, bound to the INT8 GEMV.",
    .tp_new = Int8Matrix_new,
    .tp_dealloc = (destructor)Int8Matrix_dealloc,
    .tp_methods = Int8Matrix_methods,
    .tp_getset = Int8Matrix_getset,
};

/* ---------------------------------------------------------------- module functions */

static int isa_from_name(const char *s) {
    if (!strcmp(s, "scalar")) return SI4_ISA_SCALAR;
    if (!strcmp(s, "avx2")) return SI4_ISA_AVX2;
    if (!strcmp(s, "avx512")) return SI4_ISA_AVX512;
    return -1;
}

static PyObject *py_set_isa(PyObject *mod, PyObject *arg) {
    (void)mod;
    const char *s = PyUnicode_AsUTF8(arg);
    if (!s) return NULL;
    const int isa = isa_from_name(s);
    if (isa < 0) return PyErr_Format(PyExc_ValueError, "unknown ISA %R: scalar, avx2 or avx512", arg);
    if (isa > g_best_isa)
        return PyErr_Format(PyExc_ValueError, "this CPU or build supports up to %s, not %s", si4_isa_name(g_best_isa), s);
    pthread_mutex_lock(&si4_call_lock);
    g_isa = isa;
    g_kernel = si4_kernel_for(isa);
    g_kernel8 = si8_kernel_for(isa);
    g_dequant = si4_dequant_for(isa);
    g_prepare = si4_prepare_for(isa);
    g_qkernel = qm_kernel_for(isa, g_qvnni, g_qamx);
    g_sparse_prepare = qm_sparse_prepare_for(g_qkernel);
    g_qdequant = qm_dequant_for(isa);
    g_dense_prepare = qm_dense_prepare_for(isa);
    g_zeroing_prepare = qm_zeroing_prepare_for(isa);
    pthread_mutex_unlock(&si4_call_lock);
    Py_RETURN_NONE;
}

/* Sets one of the quantized kernels' switches (g_qvnni, g_qamx) from a Python truth value and
 * picks the kernel again. */
static PyObject *set_qmat_switch(PyObject *arg, int *flag) {
    const int on = PyObject_IsTrue(arg);
    if (on < 0) return NULL;
    pthread_mutex_lock(&si4_call_lock);
    *flag = on;
    g_qkernel = qm_kernel_for(g_isa, g_qvnni, g_qamx);
    g_sparse_prepare = qm_sparse_prepare_for(g_qkernel);
    pthread_mutex_unlock(&si4_call_lock);
    Py_RETURN_NONE;
}

static PyObject *py_set_qmat_vnni(PyObject *mod, PyObject *arg) {
    (void)mod;
    return set_qmat_switch(arg, &g_qvnni);
}

static PyObject *py_set_qmat_amx(PyObject *mod, PyObject *arg) {
    (void)mod;
    return set_qmat_switch(arg, &g_qamx);
}

static PyObject *py_qmat_tiles(PyObject *mod, PyObject *unused) {
    (void)mod, (void)unused;
    pthread_mutex_lock(&si4_call_lock);
    const int on = tiles_on();
    pthread_mutex_unlock(&si4_call_lock);
    return PyBool_FromLong(on);
}

static PyObject *py_attn_kernel(PyObject *mod, PyObject *noargs) {
    (void)mod, (void)noargs;
    pthread_mutex_lock(&si4_call_lock);
    const int kind = attn_kernel();
    pthread_mutex_unlock(&si4_call_lock);
    return PyUnicode_FromString(kind == 1 ? "tiles" : kind == 2 ? "bf16" : kind == 3 ? "fma" : "");
}

#ifdef LLMLOCAL_X86_VARIANTS
/* attn_tiles(q, k, v, out, T, H, L, Hkv, D, start, window, scale): a prompt chunk's causal
 * attention through AMX-BF16 tiles (attn_tiles.c), AVX512-BF16 (attn_bf16.c) or in float32 on
 * AVX2 (attn_fma.c): attn_kernel;
 * q, out (T, H, D), k, v (L, Hkv, D), float32, contiguous (buffers or addresses). */
static PyObject *py_attn_tiles(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    (void)mod;
    if (nargs != 12) {
        PyErr_SetString(PyExc_TypeError, "attn_tiles(q, k, v, out, T, H, L, Hkv, D, start, window, scale)");
        return NULL;
    }
    long n[7];
    for (int i = 0; i < 7; i++) n[i] = PyLong_AsLong(args[4 + i]);
    const double scale = PyFloat_AsDouble(args[11]);
    if (PyErr_Occurred()) return NULL;
    const long T = n[0], H = n[1], L = n[2], Hkv = n[3], D = n[4], start = n[5], window = n[6];
    const int kind = attn_kernel();
    if (!kind) {
        PyErr_SetString(PyExc_RuntimeError, "attn_tiles: an x86-64 CPU with AVX2 and FMA, the tiles switched on where it has AMX-BF16");
        return NULL;
    }
    if (T < 1 || H < 1 || Hkv < 1 || H % Hkv || D < 32 || D % 32 || D > 256 || start < 0 || L != start + T || window < 0 || T > (1 << 20)) {
        PyErr_Format(PyExc_ValueError, "attn_tiles: T %ld, H %ld (a multiple of Hkv %ld), D %ld (32..256, a multiple of 32), L %ld = start %ld + T",
                     T, H, Hkv, D, L, start);
        return NULL;
    }
    Py_buffer vq, vk, vv, vo;
    void *pq, *pk, *pv, *po;
    const size_t qn = (size_t)T * H * D * 4, kn = (size_t)L * Hkv * D * 4;
    if (get_ptr(args[0], &vq, 0, qn, 'f', &pq, "q") < 0) return NULL;
    if (get_ptr(args[1], &vk, 0, kn, 'f', &pk, "k") < 0) {
        release(&vq);
        return NULL;
    }
    if (get_ptr(args[2], &vv, 0, kn, 'f', &pv, "v") < 0) {
        release(&vq), release(&vk);
        return NULL;
    }
    if (get_ptr(args[3], &vo, 1, qn, 'f', &po, "out") < 0) {
        release(&vq), release(&vk), release(&vv);
        return NULL;
    }
    long rc;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&si4_call_lock);
    long (*run)(const float *, size_t, size_t, int, int, const float *, const float *, size_t, size_t, int, int, int,
                int, int, float, float *, size_t, size_t) = qm_attn_fma;
#ifdef LLMLOCAL_AMX_BF16
    if (kind == 1) run = qm_attn_tiles;
#endif
#ifdef LLMLOCAL_AVX512_BF16
    if (kind == 2) run = qm_attn_bf16;
#endif
    rc = run(pq, (size_t)(H * D), (size_t)D, (int)T, (int)H, pk, pv, (size_t)(Hkv * D), (size_t)D, (int)L, (int)Hkv, (int)D,
             (int)start, (int)window, (float)scale, po, (size_t)(H * D), (size_t)D);
    pthread_mutex_unlock(&si4_call_lock);
    Py_END_ALLOW_THREADS
    release(&vq), release(&vk), release(&vv), release(&vo);
    if (rc == -1) return PyErr_NoMemory();
    Py_RETURN_NONE;
}
#endif

/* glu(gate_up, out, n, ffn, activation): out (n, ffn) = act(gate) * up for the rows of gate_up
 * (n, 2 ffn: gate, then up), float32, contiguous (buffers or addresses); activation 0 silu, 1
 * gelu-tanh (glu_body.h). One pass over the rows on the pool, in pieces of whole vectors, so
 * a value's result does not depend on the split. */
typedef struct {
    const float *gu;
    float *out;
    long n, ffn, piece, pieces;
    int activation;
    si4_glu_fn fn;
    atomic_long next;
} glu_job;

/* pieces handed out in turn (the pool skips a part whose thread has not started) */
static void run_glu(void *arg, int part, int n_parts) {
    (void)part, (void)n_parts;
    glu_job *j = arg;
    const long per_row = (j->ffn + j->piece - 1) / j->piece;
    for (long p; (p = atomic_fetch_add(&j->next, 1)) < j->pieces;) {
        const long r = p / per_row, c0 = p % per_row * j->piece, c1 = c0 + j->piece < j->ffn ? c0 + j->piece : j->ffn;
        const float *g = j->gu + (size_t)r * 2 * j->ffn;
        j->fn(g + c0, g + j->ffn + c0, j->out + (size_t)r * j->ffn + c0, (int)(c1 - c0), j->activation);
    }
}

static PyObject *py_glu(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    (void)mod;
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "glu(gate_up, out, n, ffn, activation)");
        return NULL;
    }
    const long n = PyLong_AsLong(args[2]), ffn = PyLong_AsLong(args[3]), activation = PyLong_AsLong(args[4]);
    if (PyErr_Occurred()) return NULL;
    if (n < 1 || ffn < 1 || ffn > (1L << 24) || n > (1L << 24) || (activation != 0 && activation != 1)) {
        PyErr_Format(PyExc_ValueError, "glu: n %ld and ffn %ld (1 .. 2^24), activation %ld (0 silu, 1 gelu-tanh)", n, ffn, activation);
        return NULL;
    }
    Py_buffer vg, vo;
    void *pg, *po;
    if (get_ptr(args[0], &vg, 0, (size_t)n * (size_t)ffn * 8, 'f', &pg, "gate_up") < 0) return NULL;
    if (get_ptr(args[1], &vo, 1, (size_t)n * (size_t)ffn * 4, 'f', &po, "out") < 0) {
        release(&vg);
        return NULL;
    }
    glu_job job = {.gu = pg, .out = po, .n = n, .ffn = ffn, .piece = 2048, .activation = (int)activation};
    job.pieces = n * ((ffn + job.piece - 1) / job.piece);
    atomic_init(&job.next, 0);
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&si4_call_lock);
    job.fn = si4_glu_for(g_isa);
    const int parts = job.pieces < si4_pool_size() ? (int)job.pieces : si4_pool_size();
    si4_pool_run(run_glu, &job, parts);
    pthread_mutex_unlock(&si4_call_lock);
    Py_END_ALLOW_THREADS
    release(&vg), release(&vo);
    Py_RETURN_NONE;
}

static PyObject *py_set_qmat_tiles(PyObject *mod, PyObject *arg) {
    (void)mod;
    const int on = PyObject_IsTrue(arg);
    if (on < 0) return NULL;
    pthread_mutex_lock(&si4_call_lock);
    g_qtiles = on;
    pthread_mutex_unlock(&si4_call_lock);
    Py_RETURN_NONE;
}

static PyObject *py_mac_peak(PyObject *mod, PyObject *args) {
    (void)mod;
    const char *kernel;
    long long iters;
    int passes = 0;
    if (!PyArg_ParseTuple(args, "sL|p", &kernel, &iters, &passes)) return NULL;
    long long macs;
    Py_BEGIN_ALLOW_THREADS
    macs = passes ? qm_pass_peak(kernel, iters) : qm_mac_peak(kernel, iters);
    Py_END_ALLOW_THREADS
    if (macs < 0) {
        PyErr_Format(PyExc_ValueError, "no %s for the kernel '%s' on this CPU",
                     passes ? "multi-row pass alone" : "multiply-add sequence", kernel);
        return NULL;
    }
    return PyLong_FromLongLong(macs);
}

static PyObject *py_qmat_kernel(PyObject *mod, PyObject *unused) {
    (void)mod, (void)unused;
    return PyUnicode_FromString(qm_kernel_name(g_qkernel));
}

static PyObject *py_isa(PyObject *mod, PyObject *unused) {
    (void)mod, (void)unused;
    return PyUnicode_FromString(si4_isa_name(g_isa));
}

static PyObject *py_best_isa(PyObject *mod, PyObject *unused) {
    (void)mod, (void)unused;
    return PyUnicode_FromString(si4_isa_name(g_best_isa));
}

static PyObject *py_set_num_threads(PyObject *mod, PyObject *arg) {
    (void)mod;
    const long n = PyLong_AsLong(arg);
    if (n == -1 && PyErr_Occurred()) return NULL;
    if (n < 1 || n > 256) return PyErr_Format(PyExc_ValueError, "thread count %ld must be 1..256", n);
    int err;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&si4_call_lock);
    err = si4_pool_resize((int)n);
    pthread_mutex_unlock(&si4_call_lock);
    Py_END_ALLOW_THREADS
    if (err) return PyErr_Format(PyExc_OSError, "could not start %ld threads (error %d)", n, err);
    Py_RETURN_NONE;
}

static PyObject *py_num_threads(PyObject *mod, PyObject *unused) {
    (void)mod, (void)unused;
    return PyLong_FromLong(si4_pool_size());
}

static PyObject *py_set_spin_us(PyObject *mod, PyObject *arg) {
    (void)mod;
    const long us = PyLong_AsLong(arg);
    if (us == -1 && PyErr_Occurred()) return NULL;
    if (us < 0 || us > 1000000) return PyErr_Format(PyExc_ValueError, "spin time %ld us must be 0..1000000", us);
    si4_pool_set_spin_us((int)us);
    Py_RETURN_NONE;
}

static PyObject *py_spin_us(PyObject *mod, PyObject *unused) {
    (void)mod, (void)unused;
    return PyLong_FromLong(si4_pool_spin_us());
}

static PyObject *py_set_min_part_bytes(PyObject *mod, PyObject *arg) {
    (void)mod;
    const long long b = PyLong_AsLongLong(arg);
    if (b == -1 && PyErr_Occurred()) return NULL;
    if (b < 0) return PyErr_Format(PyExc_ValueError, "min_part_bytes %lld must be >= 0", b);
    g_min_part_bytes = (size_t)b;
    Py_RETURN_NONE;
}

static PyObject *py_min_part_bytes(PyObject *mod, PyObject *unused) {
    (void)mod, (void)unused;
    return PyLong_FromSize_t(g_min_part_bytes);
}

static PyObject *py_set_prefetch_ahead(PyObject *mod, PyObject *arg) {
    (void)mod;
    const long n = PyLong_AsLong(arg);
    if (n == -1 && PyErr_Occurred()) return NULL;
    if (n < 0 || n > 65536 || n % 64)
        return PyErr_Format(PyExc_ValueError, "prefetch distance %ld must be a multiple of 64 in 0..65536", n);
    si4_prefetch_ahead = (int)n;
    Py_RETURN_NONE;
}

static PyObject *py_set_pieces_per_thread(PyObject *mod, PyObject *arg) {
    (void)mod;
    const long n = PyLong_AsLong(arg);
    if (n == -1 && PyErr_Occurred()) return NULL;
    if (n < 1 || n > 64) return PyErr_Format(PyExc_ValueError, "pieces per thread %ld must be 1..64", n);
    g_pieces_per_thread = (int)n;
    Py_RETURN_NONE;
}

static PyObject *py_set_split_mode(PyObject *mod, PyObject *arg) {
    (void)mod;
    const long v = PyLong_AsLong(arg);
    if (v == -1 && PyErr_Occurred()) return NULL;
    if (v < 0 || v > 2) return PyErr_Format(PyExc_ValueError, "split mode %ld must be 0 (rows), 1 (groups), 2 (auto)", v);
    g_split_mode = (int)v;
    Py_RETURN_NONE;
}

/* to_f16(x, out): out (uint16 buffer) = x (float32 buffer) as fp16 bits, with the current ISA's
 * conversion (the KV write of an fp16 cache in DecodeStack; tested against numpy). */
static PyObject *py_to_f16(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    (void)mod;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "to_f16(x, out)");
        return NULL;
    }
    Py_buffer vx, vo;
    void *px, *po;
    if (get_ptr(args[0], &vx, 0, 0, 'f', &px, "x") < 0) return NULL;
    const Py_ssize_t n = vx.obj ? vx.len / 4 : 0;
    if (!vx.obj || get_ptr(args[1], &vo, 1, (size_t)n * 2, 'H', &po, "out") < 0) {
        if (!vx.obj) PyErr_SetString(PyExc_TypeError, "x must be a float32 buffer");
        release(&vx);
        return NULL;
    }
    si4_f16_store_for(g_isa)((uint16_t *)po, (const float *)px, (int)n);
    release(&vx);
    release(&vo);
    Py_RETURN_NONE;
}

/* token_flags(fn, vocab, n): n bytes, fn(vocab, id) != 0 for each token id, where fn is the
 * address of a C predicate bool(const void *, int32_t) such as llama.cpp's llama_vocab_is_eog.
 * One call without the GIL instead of n foreign calls from Python, each of which would wait
 * for the GIL again while the loader's main thread imports torch. */
static PyObject *py_token_flags(PyObject *mod, PyObject *args) {
    (void)mod;
    unsigned long long fn_addr, vocab_addr;
    int n;
    if (!PyArg_ParseTuple(args, "KKi", &fn_addr, &vocab_addr, &n)) return NULL;
    if (!fn_addr || !vocab_addr || n < 0) return PyErr_Format(PyExc_ValueError, "token_flags needs a function, a vocabulary and n >= 0");
    PyObject *out = PyBytes_FromStringAndSize(NULL, n);
    if (!out) return NULL;
    char *flags = PyBytes_AS_STRING(out);
    bool (*pred)(const void *, int32_t) = (bool (*)(const void *, int32_t))(uintptr_t)fn_addr;
    const void *vocab = (const void *)(uintptr_t)vocab_addr;
    Py_BEGIN_ALLOW_THREADS
    for (int i = 0; i < n; i++) flags[i] = pred(vocab, (int32_t)i) ? 1 : 0;
    Py_END_ALLOW_THREADS
    return out;
}

static PyObject *py_pack_interleaved(PyObject *mod, PyObject *args) {
    (void)mod;
    PyObject *ocodes, *oout;
    int n, k, bits, group;
    if (!PyArg_ParseTuple(args, "OiiiiO", &ocodes, &n, &k, &bits, &group, &oout)) return NULL;
    if (n < 1 || k < 1 || (bits != 4 && bits != 5 && bits != 6 && bits != 8) || group < 4 || group % 4 || k % group)
        return PyErr_Format(PyExc_ValueError, "pack_interleaved: bad shape (n %d, k %d, bits %d, group %d)", n, k, bits, group);
    Py_buffer vc, vo;
    void *pc, *po;
    if (get_ptr(ocodes, &vc, 0, (size_t)n * k, 0, &pc, "codes") < 0) return NULL;
    if (get_ptr(oout, &vo, 1, (size_t)k / 4 * ((n + 31) / 32) * 16 * bits, 0, &po, "out") < 0) {
        release(&vc);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    qm_pack_interleaved(pc, n, k, bits, group, po);
    Py_END_ALLOW_THREADS
    release(&vc);
    release(&vo);
    Py_RETURN_NONE;
}

static PyObject *py_decode_codes(PyObject *mod, PyObject *args) {
    (void)mod;
    PyObject *oraw, *oout;
    Py_ssize_t n, nb;
    int type;
    if (!PyArg_ParseTuple(args, "OnniO", &oraw, &n, &nb, &type, &oout)) return NULL;
    size_t bb, values;
    if (!qm_block_shape(type, &bb, &values) || n < 1 || nb < 1)
        return PyErr_Format(PyExc_ValueError, "decode_codes: bad type %d or shape (%zd, %zd)", type, n, nb);
    Py_buffer vr, vo;
    void *pr, *po;
    if (get_ptr(oraw, &vr, 0, (size_t)n * nb * bb, 0, &pr, "raw") < 0) return NULL;
    if (get_ptr(oout, &vo, 1, (size_t)n * nb * values, 0, &po, "out") < 0) {
        release(&vr);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    qm_decode_codes(pr, (size_t)n, (size_t)nb, type, po);
    Py_END_ALLOW_THREADS
    release(&vr);
    release(&vo);
    Py_RETURN_NONE;
}

/* pack_rows(type, rows, n, k, codes, d, m, sc, mn): the interleaved QMatrix arrays of n rows of a
 * GGUF tensor straight from the file's bytes (qm_pack_rows); rows: n uint64 addresses of each
 * row's blocks, which the caller keeps alive; m, sc, mn None where the type has none. */
static PyObject *py_pack_rows(PyObject *mod, PyObject *args) {
    (void)mod;
    PyObject *orows, *oc, *od, *om, *osc, *omn;
    int qtype, n, k;
    if (!PyArg_ParseTuple(args, "iOiiOOOOO", &qtype, &orows, &n, &k, &oc, &od, &om, &osc, &omn)) return NULL;
    const qm_format *f = NULL;
    for (size_t i = 0; i < sizeof QM_FORMATS / sizeof QM_FORMATS[0]; i++)
        if (QM_FORMATS[i].type == qtype) f = &QM_FORMATS[i];
    if (!f || n < 1 || k < 1 || k % f->dgroup)
        return PyErr_Format(PyExc_ValueError, "pack_rows: bad type %d or shape (n %d, k %d)", qtype, n, k);
    if ((om != Py_None) != f->has_m || (osc != Py_None) != f->has_sc || (omn != Py_None) != f->has_mn)
        return PyErr_Format(PyExc_ValueError, "pack_rows: %s takes m %s, sc %s, mn %s", f->name, f->has_m ? "yes" : "None",
                            f->has_sc ? "yes" : "None", f->has_mn ? "yes" : "None");
    const size_t npad = (size_t)(n + 31) / 32 * 32, nd = (size_t)(k / f->dgroup) * npad, ng = (size_t)(k / f->group) * npad;
    Py_buffer v[6];
    void *p[6] = {NULL};
    PyObject *objs[6] = {orows, oc, od, om, osc, omn};
    const size_t need[6] = {(size_t)n * 8, (size_t)k * npad * f->bits / 8, nd * 2, nd * 2, ng, (size_t)(k / 256) * npad * 4};
    const char fmt[6] = {0, 0, 'H', 'H', 0, 0};
    int ok = 1, i = 0;
    for (; i < 6 && ok; i++) {
        v[i].obj = NULL;
        if (objs[i] != Py_None) ok = get_ptr(objs[i], &v[i], i > 0, need[i], fmt[i], &p[i], i == 0 ? "rows" : "an output") == 0;
    }
    int rc = 0;
    if (ok) {
        Py_BEGIN_ALLOW_THREADS
        rc = qm_pack_rows(qtype, (const uint8_t *const *)p[0], n, k, f->bits, f->group, f->dgroup, p[1], p[2], p[3], p[4], p[5]);
        Py_END_ALLOW_THREADS
    }
    for (int j = 0; j < i; j++) release(&v[j]);
    if (!ok) return NULL;
    if (rc == -2) return PyErr_NoMemory();
    if (rc) return PyErr_Format(PyExc_ValueError, "pack_rows: type %d is not read", qtype);
    Py_RETURN_NONE;
}

/* requant_q4_0(type, rows, n, k, out): n rows of a GGUF tensor (rows: their uint64 addresses)
 * as Q4_0 blocks into out (n, k / 32 * 18) uint8 (qm_requant_q4_0). */
static PyObject *py_requant_q4_0(PyObject *mod, PyObject *args) {
    (void)mod;
    PyObject *orows, *oout;
    int qtype, n, k;
    if (!PyArg_ParseTuple(args, "iOiiO", &qtype, &orows, &n, &k, &oout)) return NULL;
    if (n < 1 || k < 32 || k % 32) return PyErr_Format(PyExc_ValueError, "requant_q4_0: bad shape (n %d, k %d)", n, k);
    Py_buffer vr, vo;
    void *pr, *po;
    if (get_ptr(orows, &vr, 0, (size_t)n * 8, 0, &pr, "rows") < 0) return NULL;
    if (get_ptr(oout, &vo, 1, (size_t)n * (size_t)(k / 32) * 18, 0, &po, "out") < 0) {
        release(&vr);
        return NULL;
    }
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = qm_requant_q4_0(qtype, (const uint8_t *const *)pr, n, k, po);
    Py_END_ALLOW_THREADS
    release(&vr);
    release(&vo);
    if (rc) return PyErr_Format(PyExc_ValueError, "requant_q4_0: type %d with rows of %d values is not read", qtype, k);
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"decode_codes", py_decode_codes, METH_VARARGS,
     "decode_codes(raw, n, nb, type, out): Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q4_K / Q5_K / Q6_K block bytes into "
     "(n, nb values per block) uint8 codes."},
    {"pack_rows", py_pack_rows, METH_VARARGS,
     "pack_rows(type, rows, n, k, codes, d, m, sc, mn): n rows of a GGUF tensor (rows: their uint64 addresses) "
     "into the interleaved QMatrix arrays."},
    {"requant_q4_0", py_requant_q4_0, METH_VARARGS,
     "requant_q4_0(type, rows, n, k, out): n rows of a GGUF tensor (rows: their uint64 addresses) as Q4_0 blocks "
     "into out (n, k / 32 * 18) uint8."},
    {"pack_interleaved", py_pack_interleaved, METH_VARARGS,
     "pack_interleaved(codes, n, k, bits, group, out): codes (n, k) uint8 into the interleaved QMatrix layout."},
    {"to_f16", (PyCFunction)(void (*)(void))py_to_f16, METH_FASTCALL, "to_f16(x, out): float32 -> fp16 bits."},
    {"token_flags", py_token_flags, METH_VARARGS,
     "token_flags(fn, vocab, n): bytes, fn(vocab, id) != 0 for ids 0..n-1 (fn: the address of a C bool(const void *, int32_t))."},
    {"mac_peak", py_mac_peak, METH_VARARGS,
     "mac_peak(kernel, iters, passes=False): multiply-adds done by iters rounds of the kernel's inner instructions, "
     "or (passes) by iters groups of its multi-row passes alone (avx2; bench_kernels)."},
    {"set_isa", py_set_isa, METH_O, "Use the kernels of this ISA (scalar, avx2, avx512); at most best_isa()."},
    {"isa", py_isa, METH_NOARGS, "The ISA whose kernels run."},
    {"qmat_kernel", py_qmat_kernel, METH_NOARGS, "The quantized-matrix kernel variant that runs: scalar, avx2, avxvnni, avx512vnni or avx512vnni-amx."},
    {"set_qmat_vnni", py_set_qmat_vnni, METH_O, "set_qmat_vnni(on): let the quantized-matrix kernels use VNNI where the CPU has it (default on)."},
    {"set_qmat_amx", py_set_qmat_amx, METH_O, "set_qmat_amx(on): let the quantized-matrix kernels' prefill use AMX tiles where the CPU has them (default on)."},
    {"qmat_tiles", py_qmat_tiles, METH_NOARGS, "Whether QMatrix.tiles runs: AMX-BF16 tiles on this CPU, switched on, the AVX-512 ISA."},
    {"attn_kernel", py_attn_kernel, METH_NOARGS,
     "What takes attn_tiles: 'tiles' (AMX-BF16), 'bf16' (AVX512-BF16), 'fma' (float32 on AVX2) or '' (none here)."},
#ifdef LLMLOCAL_X86_VARIANTS
    {"attn_tiles", (PyCFunction)(void (*)(void))py_attn_tiles, METH_FASTCALL,
     "attn_tiles(q, k, v, out, T, H, L, Hkv, D, start, window, scale): a prompt chunk's causal attention (attn_kernel)"},
#endif
    {"glu", (PyCFunction)(void (*)(void))py_glu, METH_FASTCALL,
     "glu(gate_up, out, n, ffn, activation): out (n, ffn) = act(gate) * up, activation 0 silu, 1 gelu-tanh"},
    {"set_qmat_tiles", py_set_qmat_tiles, METH_O, "set_qmat_tiles(on): let prompt rows run through AMX-BF16 tiles where the CPU has them (default on)."},
    {"best_isa", py_best_isa, METH_NOARGS, "The best ISA this CPU and build support."},
    {"set_num_threads", py_set_num_threads, METH_O, "Threads per GEMV, the caller included."},
    {"num_threads", py_num_threads, METH_NOARGS, "Threads per GEMV, the caller included."},
    {"set_spin_us", py_set_spin_us, METH_O, "How long an idle worker spins before it sleeps (microseconds)."},
    {"spin_us", py_spin_us, METH_NOARGS, "How long an idle worker spins before it sleeps (microseconds)."},
    {"set_min_part_bytes", py_set_min_part_bytes, METH_O, "Weight bytes a thread must have to take part."},
    {"min_part_bytes", py_min_part_bytes, METH_NOARGS, "Weight bytes a thread must have to take part."},
    {"set_pieces_per_thread", py_set_pieces_per_thread, METH_O, "Row pieces per thread, taken dynamically."},
    {"set_split_mode", py_set_split_mode, METH_O, "Split calls between threads: 0 by rows, 1 by groups, 2 auto."},
    {"set_prefetch_ahead", py_set_prefetch_ahead, METH_O, "Bytes ahead in a column's run to prefetch."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_kernels", "Sparse INT4 GEMV kernels (see llmlocal.native.cpu).", -1,
    module_methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__kernels(void) {
    g_best_isa = g_isa = si4_best_isa();
    g_kernel = si4_kernel_for(g_isa);
    g_kernel8 = si8_kernel_for(g_isa);
    g_dequant = si4_dequant_for(g_isa);
    g_prepare = si4_prepare_for(g_isa);
    g_qkernel = qm_kernel_for(g_isa, g_qvnni, g_qamx);
    g_sparse_prepare = qm_sparse_prepare_for(g_qkernel);
    g_qdequant = qm_dequant_for(g_isa);
    g_dense_prepare = qm_dense_prepare_for(g_isa);
    g_zeroing_prepare = qm_zeroing_prepare_for(g_isa);
    if (PyType_Ready(&si4_matrix_type) < 0 || PyType_Ready(&si4_qmatrix_type) < 0 || PyType_Ready(&si4_stack_type) < 0 || PyType_Ready(&si8_matrix_type) < 0)
        return NULL;
    PyObject *mod = PyModule_Create(&module_def);
    if (!mod) return NULL;
    Py_INCREF(&si4_matrix_type);
    Py_INCREF(&si4_qmatrix_type);
    Py_INCREF(&si4_stack_type);
    Py_INCREF(&si8_matrix_type);
    if (PyModule_AddObject(mod, "Matrix", (PyObject *)&si4_matrix_type) < 0 ||
        PyModule_AddObject(mod, "QMatrix", (PyObject *)&si4_qmatrix_type) < 0 ||
        PyModule_AddObject(mod, "Int8Matrix", (PyObject *)&si8_matrix_type) < 0 ||
        PyModule_AddObject(mod, "DecodeStack", (PyObject *)&si4_stack_type) < 0 ||
        PyModule_AddIntConstant(mod, "MAX_BATCH", SI4_MAX_BATCH) < 0 ||
        PyModule_AddIntConstant(mod, "QM_MAX_BATCH", QM_MAX_BATCH) < 0 ||
        PyModule_AddIntConstant(mod, "CHUNK_ROWS", SI4_CHUNK_ROWS) < 0) {
        Py_DECREF(&si4_matrix_type);
        Py_DECREF(&si4_stack_type);
        Py_DECREF(&si8_matrix_type);
        Py_DECREF(mod);
        return NULL;
    }
    return mod;
}
