/* What the CPython binding's files share: the Matrix object, the lock that serialises calls
 * (the thread pool and the scratch buffers are shared), and one GEMV under that lock. */
#ifndef LLMLOCAL_SPARSE_INT4_BINDING_H
#define LLMLOCAL_SPARSE_INT4_BINDING_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>

#include "qmat.h"
#include "sparse_int4.h"

/* A Matrix (INT4 layout, fp32 activations) or a QMatrix (a GGUF type in its own bytes, int8
 * activations: `quant` set, `q` the matrix; `m` then carries only n, npad and k). */
typedef struct {
    PyObject_HEAD si4_matrix m;
    Py_buffer codes, sz;
    int quant;
    qm_matrix q;
    Py_buffer qd, qm, qsc, qmn;
} MatrixObject;

extern PyTypeObject si4_matrix_type;  /* Matrix (module.c) */
extern PyTypeObject si4_qmatrix_type; /* QMatrix (module.c) */
extern PyTypeObject si4_stack_type;  /* DecodeStack (decode_stack.c) */
extern pthread_mutex_t si4_call_lock;

/* The ISA whose kernels run (set_isa), read under si4_call_lock. */
int si4_current_isa(void);

/* y = W x' for `batch` rows under si4_call_lock; the columns read (the union over the rows),
 * or -1 when out of memory. */
int si4_gemv_locked(const MatrixObject *mo, const float *px, size_t x_stride, int batch, float *py, size_t y_stride,
                    float threshold, int dense, int32_t *pcnt);

#endif
