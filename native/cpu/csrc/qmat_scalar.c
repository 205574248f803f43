/* Quantized matrices (qmat.h): the portable kernel, the activation quantizer every ISA shares,
 * and the dequantization for prefill matmuls. */
#define _GNU_SOURCE /* syscall() */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#ifdef LLMLOCAL_AMX
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "qmat.h"
#include "sparse_int4.h"

/* Where row r of a 32-row chunk lives (the map qlayout.py packs with):
 *   low nibble plane, bytes 0..15:  byte 8 (r / 16) + r % 8, nibble (r % 16) / 8
 *   5-bit high plane, bytes 16..19: byte r % 4, bit 2 (r / 8) + (r % 8) / 4
 *   6-bit high plane, bytes 16..23: byte r % 8, bits 2 (r / 8) .. + 1
 *   8-bit, bytes 0..31:             byte 4 (r / 8) + r % 4 + 16 ((r % 8) / 4)  */
int qm_code(const qm_matrix *m, int j, int n) {
    const int bits = m->bits, cb = 4 * bits, r = n % 32;
    /* il: the chunk of column j's quad in tile (chunk, group); byte c of column t's chunk is at
     * 4 c + t there */
    const int il = m->interleaved, t = il ? j % 4 : 0, mul = il ? 4 : 1;
    const uint8_t *chunk = il ? qm_tile(m, n / 32, j / m->group) + (size_t)((j % m->group) / 4) * (4 * cb)
                              : m->codes + (size_t)j * m->colstride + (size_t)(n / 32) * cb;
    if (bits == 8) return (int8_t)chunk[il ? 4 * r + t : 4 * (r / 8) + r % 4 + 16 * ((r % 8) / 4)];
    if (bits == 6 && il) { /* rows 0..15 whole; 16..31 a nibble and the top bits of row r - 16's byte */
        const int e = 4 * (r % 8) + t, whole = 32 * ((r / 8) % 2) + e;
        if (r < 16) return chunk[whole] & 63;
        return ((chunk[64 + e] >> (4 * ((r / 8) % 2))) & 15) | (chunk[whole] >> 6) << 4;
    }
    int q = (chunk[mul * (8 * (r / 16) + r % 8) + t] >> (4 * ((r % 16) / 8))) & 15;
    if (bits == 5) q |= ((chunk[16 * mul + mul * (r % 4) + t] >> (2 * (r / 8) + (r % 8) / 4)) & 1) << 4;
    if (bits == 6) q |= ((chunk[16 * mul + mul * (r % 8) + t] >> (2 * (r / 8))) & 3) << 4;
    return q;
}

void qm_kernel_scalar(const qm_matrix *m, const qm_acts *a, int row0, int row1, int g0, int g1, float *ybuf) {
    const int B = a->batch;
    for (int b = 0; b < B; b++) memset(ybuf + (size_t)b * m->npad + row0, 0, sizeof(float) * (size_t)(row1 - row0));
    for (int g = g0; g < g1; g++) {
        const int s0 = a->goff[g], s1 = a->goff[g + 1];
        if (s0 == s1) continue;
        const int qb = g * m->group / QM_QBLOCK;
        for (int n = row0; n < row1; n++) {
            float D, M;
            qm_factors(m, g, n, &D, &M);
            for (int b = 0; b < B; b++) {
                const int8_t *qx = a->qx + (size_t)b * a->qx_stride;
                int32_t acc = 0;
                for (int i = s0; i < s1; i++)
                    acc += qm_code(m, a->cols[i], n) * qx[i];
                float *y = ybuf + (size_t)b * m->npad + n;
                const float t = fmaf(M, a->xs[(size_t)g * B + b], *y);
                *y = fmaf(D * a->dx[(size_t)b * a->dx_stride + qb], (float)acc, t);
            }
        }
    }
}

/* ---------------------------------------------------------------- activations */

qm_dense_prepare_fn g_dense_prepare; /* set with the ISA (module.c); NULL: the loop below */
qm_sparse_prepare_fn g_sparse_prepare; /* set with the kernel (module.c); NULL: the loop below */
qm_zeroing_prepare_fn g_zeroing_prepare; /* set with the ISA (module.c); NULL: the loop below */

/* The dense case of qm_prepare for one ISA-independent definition: per row and block of 32,
 * dx = max |x| / 127, qx = lrint(x * (1 / dx)), xs = dx * sum of the group's qx. */
void qm_dense_prepare_scalar(const float *x, size_t x_stride, int batch, int k, int group, int8_t *qx,
                             size_t qx_stride, float *dx, size_t dx_stride, float *xs) {
    const int n_groups = k / group;
    for (int b = 0; b < batch; b++) {
        const float *xb = x + (size_t)b * x_stride;
        for (int q = 0; q < k / QM_QBLOCK; q++) {
            float amax = 0.0f;
            for (int j = q * QM_QBLOCK; j < (q + 1) * QM_QBLOCK; j++) amax = fabsf(xb[j]) > amax ? fabsf(xb[j]) : amax;
            const float d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
            dx[(size_t)b * dx_stride + q] = d;
            for (int j = q * QM_QBLOCK; j < (q + 1) * QM_QBLOCK; j++) qx[(size_t)b * qx_stride + j] = (int8_t)lrintf(xb[j] * id);
        }
        for (int g = 0; g < n_groups; g++) {
            int32_t isum = 0;
            for (int j = g * group; j < (g + 1) * group; j++) isum += qx[(size_t)b * qx_stride + j];
            xs[(size_t)g * batch + b] = (float)isum * dx[(size_t)b * dx_stride + g * group / QM_QBLOCK];
        }
    }
}

int qm_prepare(const float *x, size_t x_stride, int batch, int k, int group, float threshold, int dense,
               int all_columns, int32_t *cols,
               int32_t *goff, int8_t *qx, size_t qx_stride, float *dx, size_t dx_stride, float *xs, int32_t *row_counts,
               int *n_slots) {
    const int n_groups = k / group, nq = k / QM_QBLOCK;
    if (dense && g_dense_prepare) { /* every column in order: the ISA's vector path makes dx too */
        g_dense_prepare(x, x_stride, batch, k, group, qx, qx_stride, dx, dx_stride, xs);
        for (int j = 0; j < k; j++) cols[j] = j;
        for (int g = 0; g <= n_groups; g++) goff[g] = g * group;
        if (row_counts)
            for (int b = 0; b < batch; b++) row_counts[b] = k;
        *n_slots = k;
        return k;
    }
    if (!dense && all_columns && g_zeroing_prepare) {
        const int kept = g_zeroing_prepare(x, x_stride, batch, k, group, threshold, qx, qx_stride, dx, dx_stride, xs,
                                           row_counts);
        if (kept >= 0) {
            for (int j = 0; j < k; j++) cols[j] = j;
            for (int g = 0; g <= n_groups; g++) goff[g] = g * group;
            *n_slots = k;
            return kept;
        }
    }
    if (!dense && !all_columns && g_sparse_prepare && batch <= SI4_MAX_BATCH)
        return g_sparse_prepare(x, x_stride, batch, k, group, threshold, cols, goff, qx, qx_stride, dx, dx_stride, xs,
                                row_counts, n_slots);
    /* per row: the scale of each block of 32 inputs over the values it keeps */
    for (int b = 0; b < batch; b++) {
        const float *xb = x + (size_t)b * x_stride;
        int32_t cnt = 0;
        for (int q = 0; q < nq; q++) {
            float amax = 0.0f;
            for (int j = q * QM_QBLOCK; j < (q + 1) * QM_QBLOCK; j++) {
                const float v = fabsf(xb[j]);
                const int keep = dense | (v > threshold);
                cnt += keep;
                amax = keep && v > amax ? v : amax;
            }
            dx[(size_t)b * dx_stride + q] = amax / 127.0f;
        }
        if (row_counts) row_counts[b] = cnt;
    }
    int n = 0, kept = 0;
    int32_t isum[QM_MAX_BATCH];
    for (int g = 0; g < n_groups; g++) {
        goff[g] = n;
        for (int b = 0; b < batch; b++) isum[b] = 0;
        for (int j = g * group; j < (g + 1) * group; j++) {
            int any = 0;
            for (int b = 0; b < batch; b++) any |= dense | all_columns | (fabsf(x[(size_t)b * x_stride + j]) > threshold);
            if (!any) continue;
            cols[n] = j;
            for (int b = 0; b < batch; b++) {
                const float v = x[(size_t)b * x_stride + j];
                const int keep = dense | (fabsf(v) > threshold);
                const float d = dx[(size_t)b * dx_stride + j / QM_QBLOCK];
                const float id = d > 0.0f ? 1.0f / d : 0.0f;
                const int8_t q = keep ? (int8_t)lrintf(v * id) : 0;
                qx[(size_t)b * qx_stride + n] = q;
                isum[b] += q;
            }
            n++;
        }
        /* the sum of the quantized values: then the error of sum_j (D q_j + M) x_j is
         * sum_j w_j (x^_j - x_j), not D sum_j q_j (x^_j - x_j) (q is unsigned, w centred) */
        for (int b = 0; b < batch; b++)
            xs[(size_t)g * batch + b] = (float)isum[b] * dx[(size_t)b * dx_stride + g * group / QM_QBLOCK];
        if (all_columns && !dense) { /* every column has a slot: count those a row keeps */
            for (int i = goff[g]; i < n; i++) {
                int any = 0;
                for (int b = 0; b < batch; b++) any |= fabsf(x[(size_t)b * x_stride + cols[i]]) > threshold;
                kept += any;
            }
        } else {
            kept += n - goff[g];
        }
        n = qm_pad_slots(cols, qx, qx_stride, batch, goff[g], n);
    }
    goff[n_groups] = n;
    *n_slots = n;
    return kept;
}

/* ---------------------------------------------------------------- dequantization */

void qm_dequant(const qm_matrix *m, int j0, int j1, int row0, int row1, float *out, size_t out_stride) {
    float D[32], M[32];
    for (int ja = j0; ja < j1;) { /* the columns of one group at a time: its factors once per chunk */
        const int g = ja / m->group, jb = (g + 1) * m->group < j1 ? (g + 1) * m->group : j1;
        for (int row = row0; row < row1; row += 32) {
            for (int r = 0; r < 32; r++) qm_factors(m, g, row + r, &D[r], &M[r]);
            for (int j = ja; j < jb; j++) {
                float *o = out + (size_t)(j - j0) * out_stride + (row - row0);
                for (int r = 0; r < 32; r++) o[r] = fmaf(D[r], (float)qm_code(m, j, row + r), M[r]);
            }
        }
        ja = jb;
    }
}

#ifdef LLMLOCAL_AMX
/* Whether this process may use AMX tiles: the CPU has AMX-INT8 and Linux grants the tile
 * state (it is off until asked for; the permission is the whole process's). Asked once. */
static int amx_usable(void) {
    static int usable = -1;
    if (usable < 0) {
        unsigned a, b, c, d;
        usable = 0;
        if (__get_cpuid_count(7, 0, &a, &b, &c, &d) && (d & (1u << 25)) && (d & (1u << 24))) /* AMX-INT8, AMX-TILE */
            usable = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
    }
    return usable;
}
#endif

qm_kernel_fn qm_kernel_for(int isa, int vnni, int amx) {
#ifdef LLMLOCAL_X86_VARIANTS
    __builtin_cpu_init();
#ifdef LLMLOCAL_AMX
    if (vnni && amx && isa >= SI4_ISA_AVX512 && __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512dq") &&
        amx_usable()) return qm_kernel_amx;
#endif
    (void)amx;
    if (vnni && isa >= SI4_ISA_AVX512 && __builtin_cpu_supports("avx512vnni")) return qm_kernel_avx512vnni;
    if (vnni && isa >= SI4_ISA_AVX2 && __builtin_cpu_supports("avxvnni")) return qm_kernel_avxvnni;
    if (isa >= SI4_ISA_AVX2) return qm_kernel_avx2;
#endif
    (void)isa, (void)vnni, (void)amx;
    return qm_kernel_scalar;
}

const char *qm_kernel_name(qm_kernel_fn f) {
#ifdef LLMLOCAL_X86_VARIANTS
#ifdef LLMLOCAL_AMX
    if (f == qm_kernel_amx) return "avx512vnni-amx";
#endif
    if (f == qm_kernel_avx512vnni) return "avx512vnni";
    if (f == qm_kernel_avxvnni) return "avxvnni";
    if (f == qm_kernel_avx2) return "avx2";
#endif
    (void)f;
    return "scalar";
}

long long qm_pass_peak(const char *kernel, long long iters) {
#ifdef LLMLOCAL_X86_VARIANTS
    __builtin_cpu_init();
    if (!strcmp(kernel, "avx2") && __builtin_cpu_supports("avx2")) return qm_pass_peak_avx2(iters);
    if (!strcmp(kernel, "avx512vnni") && __builtin_cpu_supports("avx512vnni")) return qm_pass_peak_avx512vnni(iters);
#endif
    (void)kernel, (void)iters;
    return -1;
}

long long qm_mac_peak(const char *kernel, long long iters) {
#ifdef LLMLOCAL_X86_VARIANTS
    __builtin_cpu_init();
    if (!strcmp(kernel, "avx2") && __builtin_cpu_supports("avx2")) return qm_mac_peak_avx2(iters);
    if (!strcmp(kernel, "avxvnni") && __builtin_cpu_supports("avxvnni")) return qm_mac_peak_avxvnni(iters);
    if ((!strcmp(kernel, "avx512vnni") || !strcmp(kernel, "avx512vnni-amx")) && __builtin_cpu_supports("avx512vnni"))
        return qm_mac_peak_avx512vnni(iters);
#endif
    (void)kernel, (void)iters;
    return -1;
}

qm_dequant_fn qm_dequant_for(int isa) {
#ifdef LLMLOCAL_X86_VARIANTS
    if (isa >= SI4_ISA_AVX2) return qm_dequant_avx2;
#endif
    (void)isa;
    return qm_dequant;
}

qm_zeroing_prepare_fn qm_zeroing_prepare_for(int isa) {
#ifdef LLMLOCAL_X86_VARIANTS
    if (isa >= SI4_ISA_AVX2) return qm_zeroing_prepare_avx2;
#endif
    (void)isa;
    return NULL;
}

qm_dense_prepare_fn qm_dense_prepare_for(int isa) {
#ifdef LLMLOCAL_X86_VARIANTS
    if (isa >= SI4_ISA_AVX2) return qm_dense_prepare_avx2;
#endif
    (void)isa;
    return qm_dense_prepare_scalar;
}

/* The interleaved layout of qlayout.pack (interleaved=True), from codes (n, k) uint8 in row-major
 * order: tiles (group, 32-row chunk) of the group's quads of columns, each quad's chunk in the
 * bytes load_quad_il reads (byte b of column t's chunk run at 4 b + t; 8-bit codes row r of
 * column t at 4 r + t); rows past n are zero. The four columns of a quad are four adjacent bytes
 * of a row, and land in four adjacent bytes of the tile: each row's quad is moved as one 32-bit
 * word (byte t = column t), its nibbles and high bits masked per byte. Chunk-outer, so the 32
 * rows read stay in cache. */
/* A quad's words from its rows' words R (4 codes each, byte t = column t): the formulas above,
 * written once for any word type W with the C operators (a uint32_t, or four quads' words in
 * an SSE2 register). Writes qb / 4 words of o. */
#define PACK_QUAD_WORDS(W, R, o, bits, AND, OR, SHL, SHR, C)                                              \
    do {                                                                                             \
        if ((bits) == 8) {                                                                           \
            for (int r_ = 0; r_ < 32; r_++) o[r_] = R[r_];                                           \
            break;                                                                                   \
        }                                                                                            \
        if ((bits) == 6) { /* rows 0..15 whole with the top bits of rows 16..31, their nibbles */   \
            for (int e_ = 0; e_ < 8; e_++) {                                                         \
                o[e_] = OR(AND(R[e_], C(0x3F3F3F3Fu)), SHL(AND(SHR(R[16 + e_], 4), C(0x03030303u)), 6)); \
                o[8 + e_] = OR(AND(R[8 + e_], C(0x3F3F3F3Fu)), SHL(AND(SHR(R[24 + e_], 4), C(0x03030303u)), 6)); \
                o[16 + e_] = OR(AND(R[16 + e_], C(0x0F0F0F0Fu)), SHL(AND(R[24 + e_], C(0x0F0F0F0Fu)), 4)); \
            }                                                                                        \
            break;                                                                                   \
        }                                                                                            \
        /* low nibbles: row 16 h + 8 s + p in byte 8 h + p, nibble s */                              \
        for (int b_ = 0; b_ < 16; b_++) {                                                            \
            const int lo_ = (b_ / 8) * 16 + b_ % 8;                                                  \
            o[b_] = OR(AND(R[lo_], C(0x0F0F0F0Fu)), SHL(AND(R[lo_ + 8], C(0x0F0F0F0Fu)), 4));        \
        }                                                                                            \
        if ((bits) == 5) /* row 8 v + 4 w + p: bit 2 v + w of byte 16 + p */                         \
            for (int p_ = 0; p_ < 4; p_++) {                                                         \
                W v_ = C(0);                                                                         \
                for (int r_ = p_; r_ < 32; r_ += 4)                                                  \
                    v_ = OR(v_, SHL(AND(SHR(R[r_], 4), C(0x01010101u)), 2 * (r_ / 8) + (r_ % 8) / 4)); \
                o[16 + p_] = v_;                                                                     \
            }                                                                                        \
    } while (0)

#define S_AND(a, b) ((a) & (b))
#define S_OR(a, b) ((a) | (b))
#define S_SHL(a, n) ((a) << (n))
#define S_SHR(a, n) ((a) >> (n))
#define S_C(x) ((uint32_t)(x))

/* One quad at a time: rows r < nrows at codes + r * stride, the others zero. */
static void pack_chunk_scalar(const uint8_t *codes, size_t stride, int nrows, int k, int bits, int group, uint8_t *out) {
    const int qpg = group / 4, qb = 16 * bits, G = k / group;
    uint32_t R[32], o[32];
    for (int g = 0; g < G; g++)
        for (int qi = 0; qi < qpg; qi++) {
            const size_t j = (size_t)g * group + 4 * qi;
            for (int r = 0; r < 32; r++) {
                R[r] = 0;
                if (r < nrows) memcpy(&R[r], codes + (size_t)r * stride + j, 4);
            }
            PACK_QUAD_WORDS(uint32_t, R, o, bits, S_AND, S_OR, S_SHL, S_SHR, S_C);
            memcpy(out + ((size_t)g * qpg + qi) * qb, o, (size_t)qb);
        }
}

#if defined(__SSE2__)
#include <emmintrin.h>
#define V_AND(a, b) _mm_and_si128(a, b)
#define V_OR(a, b) _mm_or_si128(a, b)
#define V_SHL(a, n) _mm_slli_epi32(a, n)
#define V_SHR(a, n) _mm_srli_epi32(a, n)
#define V_C(x) _mm_set1_epi32((int)(x))

/* A full chunk, four quads at a time (group a multiple of 16): lane i of each register is
 * quad i's word, and 4 x 4 transposes give each quad its run of words. About 3x fewer
 * instructions than a quad at a time (every load of a model runs this). */
static void pack_chunk_sse2(const uint8_t *codes, size_t stride, int k, int bits, int group, uint8_t *out) {
    const int qpg = group / 4, qb = 16 * bits, G = k / group, words = qb / 4;
    __m128i R[32], o[32];
    for (int g = 0; g < G; g++)
        for (int q0 = 0; q0 < qpg; q0 += 4) {
            const size_t j = (size_t)g * group + 4 * q0;
            for (int r = 0; r < 32; r++) R[r] = _mm_loadu_si128((const __m128i *)(codes + (size_t)r * stride + j));
            PACK_QUAD_WORDS(__m128i, R, o, bits, V_AND, V_OR, V_SHL, V_SHR, V_C);
            uint8_t *dst = out + ((size_t)g * qpg + q0) * qb;
            for (int w = 0; w < words; w += 4) { /* words w..w+3 of quads q0..q0+3 */
                const __m128i a = _mm_unpacklo_epi32(o[w], o[w + 1]), b = _mm_unpackhi_epi32(o[w], o[w + 1]);
                const __m128i c = _mm_unpacklo_epi32(o[w + 2], o[w + 3]), d = _mm_unpackhi_epi32(o[w + 2], o[w + 3]);
                _mm_storeu_si128((__m128i *)(dst + 4 * w), _mm_unpacklo_epi64(a, c));
                _mm_storeu_si128((__m128i *)(dst + qb + 4 * w), _mm_unpackhi_epi64(a, c));
                _mm_storeu_si128((__m128i *)(dst + 2 * qb + 4 * w), _mm_unpacklo_epi64(b, d));
                _mm_storeu_si128((__m128i *)(dst + 3 * qb + 4 * w), _mm_unpackhi_epi64(b, d));
            }
        }
}
#endif

/* Chunk c's tiles (one run: tiles are chunk-major) from rows r < nrows at codes + r * stride. */
static void pack_chunk(const uint8_t *codes, size_t stride, int nrows, int k, int bits, int group, uint8_t *out) {
#if defined(__SSE2__)
    if (nrows == 32 && group % 16 == 0) {
        pack_chunk_sse2(codes, stride, k, bits, group, out);
        return;
    }
#endif
    pack_chunk_scalar(codes, stride, nrows, k, bits, group, out);
}

void qm_pack_interleaved(const uint8_t *codes, int n, int k, int bits, int group, uint8_t *out) {
    const int nch = (n + 31) / 32;
    const size_t chunk_bytes = (size_t)k * 4 * (size_t)bits;
    for (int c = 0; c < nch; c++) {
        const int nrows = n - 32 * c < 32 ? n - 32 * c : 32;
        pack_chunk(codes + (size_t)c * 32 * k, (size_t)k, nrows, k, bits, group, out + (size_t)c * chunk_bytes);
    }
}

/* Bytes and values of one block of a type qm_decode_codes reads; 0 for another type. */
int qm_block_shape(int type, size_t *bytes, size_t *values) {
    *values = 32;
    switch (type) {
    case QM_Q4_0: *bytes = 18; return 1;
    case QM_Q4_1: *bytes = 20; return 1;
    case QM_Q5_0: *bytes = 22; return 1;
    case QM_Q5_1: *bytes = 24; return 1;
    default: break;
    }
    *values = 256;
    switch (type) {
    case QM_Q4_K: *bytes = 144; return 1;
    case QM_Q5_K: *bytes = 176; return 1;
    case QM_Q6_K: *bytes = 210; return 1;
    default: return 0;
    }
}

/* The codes of n rows of nb blocks (GGUF's block bytes, qlayout.decode's map) into out
 * (n, values nb) uint8, one pass. Q4_0 / Q4_1 / Q5_0 / Q5_1 keep 16 bytes of nibbles at the end
 * of a block (value l low, 16 + l high) and Q5_0 / Q5_1 a u32 after d (and m) whose bit i is
 * bit 4 of value i. Q4_K and Q5_K keep 4 chunks of 32 bytes at the end of a block (chunk c:
 * sub-block 2 c in the low nibbles, 2 c + 1 in the high), Q5_K bit s of qh[l] (bytes 16..47)
 * as bit 4 of sub-block s's value l; Q6_K low nibbles in ql (bytes 0..127: half h, +32 in two
 * runs of 32) and 2-bit tops in qh (bytes 128..191). */
int qm_decode_codes(const uint8_t *raw, size_t n, size_t nb, int type, uint8_t *out) {
    size_t bb, values;
    if (!qm_block_shape(type, &bb, &values)) return -1;
    for (size_t i = 0; i < n * nb; i++) {
        const uint8_t *b = raw + i * bb;
        uint8_t *q = out + i * values;
        if (values == 32) {
            const uint8_t *qs = b + bb - 16;
            for (int l = 0; l < 16; l++) {
                q[l] = qs[l] & 15;
                q[16 + l] = qs[l] >> 4;
            }
            if (type == QM_Q5_0 || type == QM_Q5_1) {
                uint32_t qh;
                memcpy(&qh, b + (type == QM_Q5_0 ? 2 : 4), 4);
                for (int l = 0; l < 32; l++) q[l] |= (uint8_t)(((qh >> l) & 1) << 4);
            }
            continue;
        }
        if (type == QM_Q6_K) {
            for (int h = 0; h < 2; h++) {
                const uint8_t *ql = b + 64 * h, *qh = b + 128 + 32 * h;
                uint8_t *o = q + 128 * h;
                for (int l = 0; l < 32; l++) {
                    o[l] = (uint8_t)((ql[l] & 15) | ((qh[l] & 3) << 4));
                    o[32 + l] = (uint8_t)((ql[32 + l] & 15) | (((qh[l] >> 2) & 3) << 4));
                    o[64 + l] = (uint8_t)((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4));
                    o[96 + l] = (uint8_t)((ql[32 + l] >> 4) | (((qh[l] >> 6) & 3) << 4));
                }
            }
            continue;
        }
        const uint8_t *qs = b + bb - 128;
        for (int c = 0; c < 4; c++)
            for (int l = 0; l < 32; l++) {
                q[64 * c + l] = qs[32 * c + l] & 15;
                q[64 * c + 32 + l] = qs[32 * c + l] >> 4;
            }
        if (type == QM_Q5_K)
            for (int sb = 0; sb < 8; sb++)
                for (int l = 0; l < 32; l++) q[32 * sb + l] |= (uint8_t)(((b[16 + l] >> sb) & 1) << 4);
    }
    return 0;
}

/* The 6-bit scales and mins of the 8 sub-blocks of a Q4_K / Q5_K super-block, from its 12
 * packed bytes s: sub-blocks 0..3 keep theirs in the low 6 bits of s[j] (scale) and s[4 + j]
 * (min); 4..7 their low 4 bits in s[8 + i] (scale low, min high nibble) and their top 2 bits in
 * the top bits of s[i] and s[4 + i]. */
static void k_scales(const uint8_t *s, uint8_t sc[8], uint8_t mn[8]) {
    for (int j = 0; j < 4; j++) {
        sc[j] = s[j] & 63;
        mn[j] = s[4 + j] & 63;
        sc[4 + j] = (uint8_t)((s[8 + j] & 15) | ((s[j] >> 6) << 4));
        mn[4 + j] = (uint8_t)((s[8 + j] >> 4) | ((s[4 + j] >> 6) << 4));
    }
}

/* One row's factors into a chunk's factor runs (row r of 32; qm_fat's interleaved order):
 * d and m (dmin) per dgroup, sc per group, mn per super-block, as qlayout.pack writes them. */
static void row_factors(const uint8_t *row, int type, int nb, size_t bb, int r, uint16_t *d, uint16_t *m,
                        uint8_t *sc, uint32_t *mn) {
    for (int i = 0; i < nb; i++) {
        const uint8_t *b = row + (size_t)i * bb;
        if (type == QM_Q6_K) {
            memcpy(&d[(size_t)i * 32 + r], b + 208, 2);
            for (int s = 0; s < 16; s++) sc[((size_t)i * 16 + s) * 32 + r] = b[192 + s];
            continue;
        }
        memcpy(&d[(size_t)i * 32 + r], b, 2);
        if (type == QM_Q4_1 || type == QM_Q5_1 || type == QM_Q4_K || type == QM_Q5_K) memcpy(&m[(size_t)i * 32 + r], b + 2, 2);
        if (type == QM_Q4_K || type == QM_Q5_K) {
            uint8_t s6[8], m6[8];
            k_scales(b + 4, s6, m6);
            uint32_t low = 0;
            for (int j = 0; j < 8; j++) {
                sc[((size_t)i * 8 + j) * 32 + r] = (uint8_t)(s6[j] | ((m6[j] >> 4) << 6));
                low |= (uint32_t)(m6[j] & 15) << (4 * j);
            }
            mn[(size_t)i * 32 + r] = low;
        }
    }
}

int qm_pack_rows(int type, const uint8_t *const *rows, int n, int k, int bits, int group, int dgroup, uint8_t *codes,
                 uint16_t *d, uint16_t *m, uint8_t *sc, uint32_t *mn) {
    size_t bb, values;
    if (type == QM_Q8_0) bb = 34, values = 32;
    else if (!qm_block_shape(type, &bb, &values)) return -1;
    const int nch = (n + 31) / 32, nb = k / (int)values;
    const size_t nd = (size_t)(k / dgroup), ng = (size_t)(k / group), chunk_bytes = (size_t)k * 4 * (size_t)bits;
    uint8_t *buf = malloc((size_t)32 * k);
    if (!buf) return -2;
    for (int c = 0; c < nch; c++) {
        uint16_t *dc = d + (size_t)c * nd * 32, *mc = m ? m + (size_t)c * nd * 32 : NULL;
        uint8_t *scc = sc ? sc + (size_t)c * ng * 32 : NULL;
        uint32_t *mnc = mn ? mn + (size_t)c * (size_t)(k / 256) * 32 : NULL;
        for (int r = 0; r < 32; r++) {
            uint8_t *q = buf + (size_t)r * k;
            const int row = c * 32 + r;
            if (row >= n) { /* padding: zero codes and factors */
                memset(q, 0, (size_t)k);
                for (size_t f = 0; f < nd; f++) {
                    dc[f * 32 + r] = 0;
                    if (mc) mc[f * 32 + r] = 0;
                }
                if (scc) for (size_t f = 0; f < ng; f++) scc[f * 32 + r] = 0;
                if (mnc) for (int f = 0; f < k / 256; f++) mnc[(size_t)f * 32 + r] = 0;
                continue;
            }
            if (type == QM_Q8_0)
                for (int i = 0; i < nb; i++) memcpy(q + (size_t)i * 32, rows[row] + (size_t)i * bb + 2, 32);
            else
                qm_decode_codes(rows[row], 1, (size_t)nb, type, q);
            row_factors(rows[row], type, nb, bb, r, dc, mc, scc, mnc);
        }
        qm_pack_interleaved(buf, 32, k, bits, group, codes + (size_t)c * chunk_bytes);
    }
    free(buf);
    return 0;
}

/* The 256 (K-quants) or 32 values of one block b of a type qm_pack_rows reads, w = D q + M per
 * group with D and M as qlayout.QuantCodes.factors computes them. */
static void block_values(const uint8_t *b, int type, float *w) {
    uint16_t h;
    uint8_t q[256];
    memcpy(&h, b + (type == QM_Q6_K ? 208 : 0), 2);
    const float d = qm_f16(h);
    if (type == QM_Q8_0) {
        for (int l = 0; l < 32; l++) w[l] = d * (float)(int8_t)b[2 + l];
        return;
    }
    qm_decode_codes(b, 1, 1, type, q);
    if (type == QM_Q6_K) {
        for (int s = 0; s < 16; s++) {
            const float D = d * (float)(int8_t)b[192 + s], M = -32.0f * D;
            for (int l = 0; l < 16; l++) w[16 * s + l] = D * (float)q[16 * s + l] + M;
        }
        return;
    }
    if (type == QM_Q4_K || type == QM_Q5_K) {
        uint8_t sc[8], mn[8];
        k_scales(b + 4, sc, mn);
        memcpy(&h, b + 2, 2);
        const float dmin = qm_f16(h);
        for (int j = 0; j < 8; j++) {
            const float D = d * (float)sc[j], M = -(dmin * (float)mn[j]);
            for (int l = 0; l < 32; l++) w[32 * j + l] = D * (float)q[32 * j + l] + M;
        }
        return;
    }
    float M = (float)-(type == QM_Q4_0 ? 8 : 16) * d;
    if (type == QM_Q4_1 || type == QM_Q5_1) {
        memcpy(&h, b + 2, 2);
        M = qm_f16(h);
    }
    for (int l = 0; l < 32; l++) w[l] = d * (float)q[l] + M;
}

/* 32 values as one Q4_0 block (18 bytes): d = the value of largest magnitude / -8, so that it
 * takes code 0 exactly, and each value the nearest code of d (q - 8) for d as fp16 stores it
 * (the opposite extreme, +8 d, clamps to 15). NaN takes code 0 (a file is untrusted input).
 * A search over a few steps, each refined by least squares, left 12-34% less squared error on
 * the 0.5B's tensors but no more drafts accepted (the starter drafting for itself: 57 of 87
 * against 57 of 85), at 20 times the cost (10 s to load the 0.5B): not kept. */
static void q4_0_block(const float *x, uint8_t *out) {
    float amax = 0.0f, max = 0.0f;
    for (int l = 0; l < 32; l++)
        if (fabsf(x[l]) > amax) amax = fabsf(x[l]), max = x[l];
    const float d = max / -8.0f;
    uint16_t h;
    si4_f16_store_scalar(&h, &d, 1);
    memcpy(out, &h, 2);
    const float dh = qm_f16(h), id = dh != 0.0f ? 1.0f / dh : 0.0f;
    for (int l = 0; l < 16; l++) {
        uint8_t c[2];
        for (int t = 0; t < 2; t++) {
            const float v = x[l + 16 * t] * id + 8.5f;
            c[t] = v >= 15.0f ? 15 : v > 0.0f ? (uint8_t)v : 0;
        }
        out[2 + l] = (uint8_t)(c[0] | c[1] << 4);
    }
}

int qm_requant_q4_0(int type, const uint8_t *const *rows, int n, int k, uint8_t *out) {
    size_t bb, values;
    if (type == QM_Q8_0) bb = 34, values = 32;
    else if (!qm_block_shape(type, &bb, &values)) return -1;
    if (k % (int)values) return -1;
    float w[256];
    for (int r = 0; r < n; r++) {
        uint8_t *o = out + (size_t)r * (size_t)(k / 32) * 18;
        for (int i = 0; i < k / (int)values; i++) {
            block_values(rows[r] + (size_t)i * bb, type, w);
            for (size_t j = 0; j < values / 32; j++, o += 18) q4_0_block(w + 32 * j, o);
        }
    }
    return 0;
}

qm_sparse_prepare_fn qm_sparse_prepare_for(qm_kernel_fn kernel) {
#ifdef LLMLOCAL_X86_VARIANTS
    if (kernel == qm_kernel_avx512vnni) return qm_sparse_prepare_avx512vnni;
#ifdef LLMLOCAL_AMX
    if (kernel == qm_kernel_amx) return qm_sparse_prepare_amx;
#endif
#endif
    (void)kernel;
    return NULL;
}
