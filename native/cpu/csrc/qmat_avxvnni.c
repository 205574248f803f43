/* The quantized-matrix kernels with AVX-VNNI (qmat_body.h): vpdpbusd on 256-bit registers,
 * VEX-encoded (Alder Lake and later, Zen 5). Compiled with -mavx2 -mfma -mf16c -mavxvnni. */
#include <immintrin.h>
#define QM_SUFFIX avxvnni
#define QM_DPBUSD(acc, u8, s8) _mm256_dpbusd_avx_epi32((acc), (u8), (s8))
#include "qmat_body.h"
