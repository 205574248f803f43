/* Runtime choice of the kernel variant. The AVX2 and AVX-512 variants are separate translation
 * units compiled with their own -m flags (setup.py), so this file and everything else stays at
 * the baseline ISA and the library loads on any x86-64; the variants run only when
 * __builtin_cpu_supports (which also checks that the OS saves the wide registers) says so. */
#include "sparse_int4.h"

int si4_prefetch_ahead = 192;

int si4_best_isa(void) {
#ifdef LLMLOCAL_X86_VARIANTS
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("fma") &&
        __builtin_cpu_supports("f16c") && __builtin_cpu_supports("popcnt"))
        return SI4_ISA_AVX512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c") &&
        __builtin_cpu_supports("popcnt"))
        return SI4_ISA_AVX2;
#endif
    return SI4_ISA_SCALAR;
}

si4_kernel_fn si4_kernel_for(int isa) {
#ifdef LLMLOCAL_X86_VARIANTS
    if (isa == SI4_ISA_AVX512) return si4_kernel_avx512;
    if (isa == SI4_ISA_AVX2) return si4_kernel_avx2;
#endif
    (void)isa;
    return si4_kernel_scalar;
}

si4_prepare_fn si4_prepare_for(int isa) {
#ifdef LLMLOCAL_X86_VARIANTS
    if (isa == SI4_ISA_AVX512) return si4_prepare_avx512;
    if (isa == SI4_ISA_AVX2) return si4_prepare_avx2;
#endif
    (void)isa;
    return si4_prepare_scalar;
}

si8_kernel_fn si8_kernel_for(int isa) {
#ifdef LLMLOCAL_X86_VARIANTS
    if (isa == SI4_ISA_AVX512)
        return __builtin_cpu_supports("avx512vnni") ? si8_kernel_avx512vnni : si8_kernel_avx2;
    if (isa == SI4_ISA_AVX2) return si8_kernel_avx2;
#endif
    (void)isa;
    return si8_kernel_scalar;
}

si4_attend_fn si4_attend_for(int isa) {
#ifdef LLMLOCAL_X86_VARIANTS
    if (isa == SI4_ISA_AVX512) return si4_attend_avx512;
    if (isa == SI4_ISA_AVX2) return si4_attend_avx2;
#endif
    (void)isa;
    return si4_attend_scalar;
}

si4_dequant_fn si4_dequant_for(int isa) {
#ifdef LLMLOCAL_X86_VARIANTS
    if (isa == SI4_ISA_AVX512) return si4_dequant_avx512;
    if (isa == SI4_ISA_AVX2) return si4_dequant_avx2;
#endif
    (void)isa;
    return si4_dequant_scalar;
}

si4_f16_store_fn si4_f16_store_for(int isa) {
#ifdef LLMLOCAL_X86_VARIANTS
    if (isa == SI4_ISA_AVX512) return si4_f16_store_avx512;
    if (isa == SI4_ISA_AVX2) return si4_f16_store_avx2;
#endif
    (void)isa;
    return si4_f16_store_scalar;
}

si4_q8_store_fn si4_q8_store_for(int isa) {
#ifdef LLMLOCAL_X86_VARIANTS
    if (isa == SI4_ISA_AVX512) return si4_q8_store_avx512;
    if (isa == SI4_ISA_AVX2) return si4_q8_store_avx2;
#endif
    (void)isa;
    return si4_q8_store_scalar;
}

si4_glu_fn si4_glu_for(int isa) {
#ifdef LLMLOCAL_X86_VARIANTS
    if (isa == SI4_ISA_AVX512) return si4_glu_avx512;
    if (isa == SI4_ISA_AVX2) return si4_glu_avx2;
#endif
    (void)isa;
    return si4_glu_scalar;
}

const char *si4_isa_name(int isa) {
    switch (isa) {
    case SI4_ISA_AVX512: return "avx512";
    case SI4_ISA_AVX2: return "avx2";
    default: return "scalar";
    }
}
