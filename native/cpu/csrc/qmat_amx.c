/* The AVX512-VNNI kernels (qmat_avx512vnni.c) with prefill's group sums made by AMX tile
 * multiplies (qmat_body.h, QM_AMX): Sapphire Rapids and later, where the OS lets the process
 * use the tiles (qm_kernel_for asks). Decode steps run the VNNI code as it is.
 * Compiled with -mamx-tile -mamx-int8 -mavx512dq and the AVX512-VNNI flags. */
#include <immintrin.h>
#define QM_SUFFIX amx
#define QM_DPBUSD(acc, u8, s8) _mm256_dpbusd_epi32((acc), (u8), (s8))
#define QM_ZMM 1
#define QM_AMX 1
#include "qmat_body.h"
