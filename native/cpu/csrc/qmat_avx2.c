/* The quantized-matrix kernels for AVX2 (qmat_body.h): vpmaddubsw into int16, vpmaddwd into
 * int32. Compiled with -mavx2 -mfma -mf16c (setup.py). */
#define QM_SUFFIX avx2
#include "qmat_body.h"
