/* Portable variant: plain C, compiled for the architecture's baseline (any x86-64, ARM, ...).
 * A "vector" is one float; the compiler may still vectorise with the baseline instructions. */
#include <math.h>
#include <string.h>

#include "sparse_int4.h"

typedef float vf;
#define VW 1
#define CV 32
#define B1_NC 1
#define PASS_MAX 8
#define MAX_ACC (8 * 32)

/* IEEE binary16 -> binary32, exact for every input (subnormals, inf, nan included). */
static inline float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, bits;
    if (exp == 0x1fu) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112u) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else { /* subnormal: normalise */
        exp = 113u;
        while (!(man & 0x400u)) { man <<= 1; exp--; }
        bits = sign | (exp << 23) | ((man & 0x3ffu) << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

#define V_ZERO() 0.0f
#define V_SET1(f) (f)
#define V_FMA(a, b, c) ((a) * (b) + (c))
#define V_LOAD(p) (*(p))
#define V_STORE(p, v) (*(p) = (v))
#define V_LOAD_F16(p) half_to_float(*(p))
#define UNPACK(p, q)                                   \
    do {                                               \
        for (int b_ = 0; b_ < 16; b_++) {              \
            (q)[b_] = (float)((p)[b_] & 15);           \
            (q)[16 + b_] = (float)((p)[b_] >> 4);      \
        }                                              \
    } while (0)
#define DEQUANT_NAME si4_dequant_scalar
#define KERNEL_NAME si4_kernel_scalar

#include "kernel_body.h"

#define V_HSUM(v) (v)
#define V_SUMS(a) ((a)[0])
#define V_ADD(a, b) ((a) + (b))
#define V_SUB(a, b) ((a) - (b))
#define V_MUL(a, b) ((a) * (b))
#define V_MAX(a, b) fmaxf((a), (b))
#define V_HMAX(v) (v)
/* binary32 -> binary16, rounding to nearest even; overflow gives inf, NaN stays NaN. */
static inline uint16_t float_to_half(float f) {
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    const uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    x &= 0x7fffffffu;
    if (x >= 0x47800000u) /* |f| >= 65536, inf or NaN (65520 .. 65535 round up below) */
        return sign | (x > 0x7f800000u ? 0x7e00u : 0x7c00u);
    if (x < 0x38800000u) { /* below 2^-14: a subnormal half or zero. Adding 0.5 puts the half's */
        float g;           /* bits at the bottom of the mantissa, rounded by the float add itself */
        memcpy(&g, &x, sizeof g);
        g += 0.5f;
        uint32_t y;
        memcpy(&y, &g, sizeof y);
        return sign | (uint16_t)(y - 0x3f000000u);
    }
    /* normal: rebias the exponent (127 -> 15) and round the 13 dropped bits, ties to even */
    x += 0xc8000fffu + ((x >> 13) & 1u); /* (15 - 127) << 23, plus just under half an ulp */
    return sign | (uint16_t)(x >> 13);
}
#define S_F16(h) half_to_float(h)
#define S_TO_F16(f) float_to_half(f)
#define ATTN_NAME si4_attend_scalar
#define F16_STORE_NAME si4_f16_store_scalar
#define Q8_STORE_NAME si4_q8_store_scalar
#define V_LOAD_I8(p) ((float)*(p))
#include "attn_body.h"

#define PREPARE_NAME si4_prepare_scalar
#include "prep_body.h"

#define I8_NAME si8_kernel_scalar
#include "int8_body.h"

#define V_ABS(x) fabsf(x)
#define V_DIV(a, b) ((a) / (b))
#define V_SELECT_NEG(a, x, y) ((a) < 0 ? (x) : (y))
#define GLU_NAME si4_glu_scalar
#include "glu_body.h"
