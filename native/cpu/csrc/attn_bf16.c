/* A prompt chunk's causal attention on AVX512-BF16 without AMX (Zen 4 and 5, Cooper Lake):
 * attn_tiles.c's algorithm, layouts and numbers per row, its tile operations done by vdpbf16ps.
 * On a Zen 5 torch's float32 attention of a 512-token chunk after 512 cached tokens took 17 ms
 * a layer (its GEMMs run AVX2 code on AMD), a sixth of a 1,000-token prefill of the 1.5B.
 *
 * Compiled with -mavx512bf16 -mavx512f -mavx512bw -mavx512dq -mavx512vl (setup.py,
 * LLMLOCAL_AVX512_BF16); called only where the CPU has them (module.c). */
#define ATTN_ENTRY qm_attn_bf16
#include "attn_tiles.c"
