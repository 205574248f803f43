/* The quantized-matrix kernels with AVX512-VNNI on 256-bit registers (qmat_body.h): vpdpbusd,
 * EVEX-encoded (Cascade Lake, Ice Lake, Sapphire Rapids, Zen 4), and 32 vector registers.
 * Compiled with -mavx512f -mavx512bw -mavx512vl -mavx512vnni -mavx2 -mfma -mf16c. */
#include <immintrin.h>
#define QM_SUFFIX avx512vnni
#define QM_DPBUSD(acc, u8, s8) _mm256_dpbusd_epi32((acc), (u8), (s8))
#define QM_ZMM 1
#include "qmat_body.h"
