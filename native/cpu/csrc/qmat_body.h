/* Quantized matrices (qmat.h), AVX2: integer dot products of four columns at a time.
 *
 * For a chunk of 32 rows and four slots (columns), the codes become four vectors W[v] whose
 * int32 element e holds row 8v + e's codes of the four columns in its four bytes; with the four
 * quantized activations broadcast into every element, vpmaddubsw + vpmaddwd give each row's
 * sum of four products in int32 (|q| <= 63 times |qx| <= 127: no int16 saturation; Q8_0's
 * signed codes take the sign of x instead, as |x| * sign(q, x)). The chunk layout (qlayout.py)
 * is chosen so that the byte interleave below yields rows in natural order. Two kernels:
 *
 *   the column layout (sparse files: a column's run is skipped when its input is zeroed):
 *     groups outer, per group the int32 sums scaled by D * dx and M * dx * sum(qx) added to y;
 *   the interleaved layout (dense decoding, batches, prefill; the section below): a chunk of
 *     32 rows over all of K in one run, each row's sums in registers, sub-block scales applied
 *     in the integer widening.
 *
 * This body is compiled three times (setup.py), each translation unit defining QM_SUFFIX and
 * QM_DPBUSD before including it:
 *   qmat_avx2.c        -mavx2 -mfma -mf16c: vpmaddubsw into int16, vpmaddwd into int32;
 *   qmat_avxvnni.c     the same with AVX-VNNI (Alder Lake and later, Zen 5) and
 *   qmat_avx512vnni.c  with AVX512-VNNI on 256-bit registers (Cascade Lake, Ice Lake, Sapphire
 *                      Rapids, Zen 4): vpdpbusd adds the four products of each int32 element
 *                      to it in one instruction, with no int16 stage to widen; the sub-block
 *                      scales then multiply the int32 sums (Q6_K: vpmulld; Q4_K / Q5_K: as
 *                      floats, exactly), which gives the same numbers as weighting the
 *                      widening, so every variant computes the same floats;
 *   qmat_amx.c         the AVX512-VNNI kernels with prefill's group sums made by AMX tile
 *                      multiplies (QM_AMX, below): the same integers, the same floats.
 * Each is called only on CPUs that have its instructions. */
#include <immintrin.h>
#include <stdlib.h>
#include <string.h>

#include "qmat.h"

#ifndef QM_SUFFIX
#error "define QM_SUFFIX (and QM_DPBUSD for a VNNI variant) before including qmat_body.h"
#endif
#define QM_CAT_(a, b) a##_##b
#define QM_CAT(a, b) QM_CAT_(a, b)
#define QM_NAME(f) QM_CAT(f, QM_SUFFIX)
#ifdef QM_DPBUSD
#define QM_VNNI 1
#else
#define QM_VNNI 0
#endif
#ifndef QM_ZMM
#define QM_ZMM 0 /* 1: AVX512-VNNI on 512-bit registers for decode steps (the section below) */
#endif

#define AI static inline __attribute__((always_inline))
#define PASS 2 /* batch rows per pass over a chunk: 8 accumulators + 4 code vectors */

AI __m256i join(__m128i lo, __m128i hi) { return _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1); }

/* The codes of rows 0..31 of four columns' chunks at p[0..3] (see the file comment). */
AI void load_quad(const uint8_t *const p[4], const int BITS, __m256i W[4]) {
    if (BITS == 8) { /* bytes 0..31 of each column: 4 (r / 8) + r % 4 + 16 ((r % 8) / 4) */
        const __m256i c0 = _mm256_loadu_si256((const __m256i *)p[0]), c1 = _mm256_loadu_si256((const __m256i *)p[1]);
        const __m256i c2 = _mm256_loadu_si256((const __m256i *)p[2]), c3 = _mm256_loadu_si256((const __m256i *)p[3]);
        const __m256i a = _mm256_unpacklo_epi8(c0, c1), b = _mm256_unpackhi_epi8(c0, c1);
        const __m256i c = _mm256_unpacklo_epi8(c2, c3), d = _mm256_unpackhi_epi8(c2, c3);
        W[0] = _mm256_unpacklo_epi16(a, c);
        W[1] = _mm256_unpackhi_epi16(a, c);
        W[2] = _mm256_unpacklo_epi16(b, d);
        W[3] = _mm256_unpackhi_epi16(b, d);
        return;
    }
    /* low nibbles: byte 8 (r / 16) + r % 8, nibble (r % 16) / 8 */
    const __m128i c0 = _mm_loadu_si128((const __m128i *)p[0]), c1 = _mm_loadu_si128((const __m128i *)p[1]);
    const __m128i c2 = _mm_loadu_si128((const __m128i *)p[2]), c3 = _mm_loadu_si128((const __m128i *)p[3]);
    const __m128i a = _mm_unpacklo_epi8(c0, c1), b = _mm_unpackhi_epi8(c0, c1);
    const __m128i c = _mm_unpacklo_epi8(c2, c3), d = _mm_unpackhi_epi8(c2, c3);
    const __m256i u01 = join(_mm_unpacklo_epi16(a, c), _mm_unpackhi_epi16(a, c)); /* element e: byte e */
    const __m256i u23 = join(_mm_unpacklo_epi16(b, d), _mm_unpackhi_epi16(b, d)); /* element e: byte 8 + e */
    const __m256i f = _mm256_set1_epi8(15);
    W[0] = _mm256_and_si256(u01, f);
    W[1] = _mm256_and_si256(_mm256_srli_epi16(u01, 4), f);
    W[2] = _mm256_and_si256(u23, f);
    W[3] = _mm256_and_si256(_mm256_srli_epi16(u23, 4), f);
    if (BITS == 5) { /* bytes 16..19: byte r % 4, bit 2 (r / 8) + (r % 8) / 4 */
        int32_t h[4];
        for (int t = 0; t < 4; t++) memcpy(&h[t], p[t] + 16, 4);
        const __m128i ab = _mm_unpacklo_epi8(_mm_cvtsi32_si128(h[0]), _mm_cvtsi32_si128(h[1]));
        const __m128i cd = _mm_unpacklo_epi8(_mm_cvtsi32_si128(h[2]), _mm_cvtsi32_si128(h[3]));
        const __m256i hv = _mm256_broadcastsi128_si256(_mm_unpacklo_epi16(ab, cd)); /* element e: byte e % 4 */
        const __m256i sixteen = _mm256_set1_epi8(16);
        for (int v = 0; v < 4; v++) {
            /* elements 0..3 take bit 2v, elements 4..7 bit 2v + 1 */
            const __m256i bit = join(_mm_set1_epi8((char)(1 << (2 * v))), _mm_set1_epi8((char)(1 << (2 * v + 1))));
            const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(hv, bit), bit);
            W[v] = _mm256_or_si256(W[v], _mm256_and_si256(set, sixteen));
        }
    } else if (BITS == 6) { /* bytes 16..23: byte r % 8, bits 2 (r / 8) .. + 1 */
        const __m128i ab = _mm_unpacklo_epi8(_mm_loadl_epi64((const __m128i *)(p[0] + 16)),
                                             _mm_loadl_epi64((const __m128i *)(p[1] + 16)));
        const __m128i cd = _mm_unpacklo_epi8(_mm_loadl_epi64((const __m128i *)(p[2] + 16)),
                                             _mm_loadl_epi64((const __m128i *)(p[3] + 16)));
        const __m256i hv = join(_mm_unpacklo_epi16(ab, cd), _mm_unpackhi_epi16(ab, cd)); /* element e: byte e */
        const __m256i m = _mm256_set1_epi8(0x30);
        W[0] = _mm256_or_si256(W[0], _mm256_and_si256(_mm256_slli_epi16(hv, 4), m));
        W[1] = _mm256_or_si256(W[1], _mm256_and_si256(_mm256_slli_epi16(hv, 2), m));
        W[2] = _mm256_or_si256(W[2], _mm256_and_si256(hv, m));
        W[3] = _mm256_or_si256(W[3], _mm256_and_si256(_mm256_srli_epi16(hv, 2), m));
    }
}

/* The codes of half h (rows 16 h .. 16 h + 15 of the chunk) of the quad at p: W[0] rows
 * 16 h + e, W[1] rows 16 h + 8 + e (element e). */
AI void load_half_il(const uint8_t *p, const int h, const int BITS, __m256i W[2]) {
    if (BITS == 8) {
        W[0] = _mm256_loadu_si256((const __m256i *)(p + 64 * h));
        W[1] = _mm256_loadu_si256((const __m256i *)(p + 64 * h + 32));
        return;
    }
    if (BITS == 6) { /* qlayout.py: rows 0..15 whole in bytes 0..63, rows 16..31 from a nibble and two bits */
        const __m256i v1 = _mm256_loadu_si256((const __m256i *)p), v2 = _mm256_loadu_si256((const __m256i *)(p + 32));
        if (h == 0) {
            const __m256i m63 = _mm256_set1_epi8(63);
            W[0] = _mm256_and_si256(v1, m63);
            W[1] = _mm256_and_si256(v2, m63);
            return;
        }
        const __m256i nib = _mm256_loadu_si256((const __m256i *)(p + 64)), f = _mm256_set1_epi8(15), top = _mm256_set1_epi8(0x30);
        W[0] = _mm256_or_si256(_mm256_and_si256(nib, f), _mm256_and_si256(_mm256_srli_epi16(v1, 2), top));
        W[1] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(nib, 4), f), _mm256_and_si256(_mm256_srli_epi16(v2, 2), top));
        return;
    }
    const __m256i u = _mm256_loadu_si256((const __m256i *)(p + 32 * h)), f = _mm256_set1_epi8(15);
    W[0] = _mm256_and_si256(u, f);
    W[1] = _mm256_and_si256(_mm256_srli_epi16(u, 4), f);
    if (BITS == 5) {
        const __m256i hv = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(p + 64)));
        const __m256i sixteen = _mm256_set1_epi8(16);
        for (int t = 0; t < 2; t++) {
            const int v = 2 * h + t;
            const __m256i bit = join(_mm_set1_epi8((char)(1 << (2 * v))), _mm_set1_epi8((char)(1 << (2 * v + 1))));
            const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(hv, bit), bit);
            W[t] = _mm256_or_si256(W[t], _mm256_and_si256(set, sixteen));
        }
    }
}

/* The same four vectors from a quad-interleaved chunk at p (qlayout.py, interleaved=True):
 * the bytes already in the order the column layout's interleave produces; the two halves. */
AI void load_quad_il(const uint8_t *p, const int BITS, __m256i W[4]) {
    load_half_il(p, 0, BITS, W);
    load_half_il(p, 1, BITS, W + 2);
}

/* D and M (w = D q + M) of rows n .. n + 7 in group g. */
AI void factors8(const qm_matrix *m, int g, int n, __m256 *D, __m256 *M) {
    const size_t dg = (size_t)g * m->group / m->dgroup, nd = (size_t)(m->k / m->dgroup);
    const size_t at = qm_fat(m, (size_t)g, (size_t)(m->k / m->group), n), dat = qm_fat(m, dg, nd, n);
    __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(m->d + dat)));
    if (m->mn) { /* Q4_K / Q5_K: 6-bit scale and min of sub-block g % 8 */
        const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(m->sc + at)));
        const __m256i lo = _mm256_srli_epi32(_mm256_loadu_si256((const __m256i *)(m->mn + dat)), 4 * (g % 8));
        const __m256i sc = _mm256_and_si256(b, _mm256_set1_epi32(63));
        const __m256i mn = _mm256_or_si256(_mm256_slli_epi32(_mm256_srli_epi32(b, 6), 4), _mm256_and_si256(lo, _mm256_set1_epi32(15)));
        d = _mm256_mul_ps(d, _mm256_cvtepi32_ps(sc));
        *D = d;
        const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(m->m + dat)));
        *M = _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(mn)));
        return;
    }
    if (m->sc) {
        const __m128i s = _mm_loadl_epi64((const __m128i *)(m->sc + at));
        d = _mm256_mul_ps(d, _mm256_cvtepi32_ps(m->sc_signed ? _mm256_cvtepi8_epi32(s) : _mm256_cvtepu8_epi32(s)));
    }
    *D = d;
    if (m->m) *M = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(m->m + dat)));
    else *M = _mm256_mul_ps(_mm256_set1_ps((float)-m->off), d);
}

/* Quads whose vpmaddubsw sums int16 lanes can add before they overflow: a lane holds two
 * products q x, |q| <= 2^bits - 1 (Q8_0 through the sign trick: 128), |x| <= 127. */
#define QUADS_PER_I16(BITS) ((BITS) == 4 ? 8 : (BITS) == 5 ? 4 : (BITS) == 6 ? 2 : 1)

/* AVX2's quad for a row of x, as asm text (group_sums_rows_il; four rows of it in qm_mac_peak):
 * the activations at X broadcast into %[x], times the code vectors %[w0], %[w1] by vpmaddubsw
 * into %[t], added to the int16 sums %[A], %[B] (row r's are s<r>0, s<r>1). */
#define QM_ROW_ASM(X, A, B)                                                                   \
    "vpbroadcastd " X ", %[x]\n\t"                                                            \
    "vpmaddubsw %[x], %[w0], %[t]\n\t"                                                        \
    "vpaddw %[t], %[" A "], %[" A "]\n\t"                                                     \
    "vpmaddubsw %[x], %[w1], %[t]\n\t"                                                        \
    "vpaddw %[t], %[" B "], %[" B "]\n\t"
#define QM_ROW0_ASM(X, A, B) /* the first quad of a run: the products are the sums */         \
    "vpbroadcastd " X ", %[x]\n\t"                                                            \
    "vpmaddubsw %[x], %[w0], %[" A "]\n\t"                                                    \
    "vpmaddubsw %[x], %[w1], %[" B "]\n\t"
#define QM_QUAD4_ASM(X0, X1, X2, X3)                                                          \
    QM_ROW_ASM(X0, "s00", "s01") QM_ROW_ASM(X1, "s10", "s11") QM_ROW_ASM(X2, "s20", "s21")   \
    QM_ROW_ASM(X3, "s30", "s31")

/* The asm text of group_sums_rows_il's runs: a quad's codes into %[w0], %[w1] (QM_U*: from the
 * interleaved tile at %[w], quad I, as load_half_il unpacks them; QM_U2 from unpack_group's
 * buffer), and the rows' multiply-adds (QM_R1 .. QM_R4: rows 0..NB-1 of x at %[y0] ..). */
#define QM_U2(I) /* unpacked codes (unpack_group's buffer) */                                             \
    "vmovdqa " #I "*64(%[w]), %[w0]\n\t"                                                                  \
    "vmovdqa " #I "*64+32(%[w]), %[w1]\n\t"
#define QM_U4(I) /* half h of the tile's 4-bit quad (load_half_il): low nibbles, then high */           \
    "vmovdqu " #I "*64(%[w]), %[w1]\n\t"                                                                  \
    "vpand %[w1], %[f], %[w0]\n\t"                                                                        \
    "vpsrlw $4, %[w1], %[w1]\n\t"                                                                         \
    "vpand %[f], %[w1], %[w1]\n\t"
#define QM_U6L(I) /* 6-bit quad, rows 0..15: whole bytes, masked to 63 */                                 \
    "vmovdqu " #I "*96(%[w]), %[w0]\n\t"                                                                  \
    "vpand %[w0], %[f], %[w0]\n\t"                                                                        \
    "vmovdqu " #I "*96+32(%[w]), %[w1]\n\t"                                                               \
    "vpand %[w1], %[f], %[w1]\n\t"
#define QM_U6H(I) /* 6-bit quad, rows 16..31: a nibble of bytes 64..95, two bits of bytes 0..63 */        \
    "vmovdqu " #I "*96+64(%[w]), %[w1]\n\t"                                                               \
    "vpand %[w1], %[f], %[w0]\n\t"                                                                        \
    "vpsrlw $4, %[w1], %[w1]\n\t"                                                                         \
    "vpand %[f], %[w1], %[w1]\n\t"                                                                        \
    "vmovdqu " #I "*96(%[w]), %[t]\n\t"                                                                   \
    "vpsrlw $2, %[t], %[t]\n\t"                                                                           \
    "vpand %[g], %[t], %[t]\n\t"                                                                          \
    "vpor %[t], %[w0], %[w0]\n\t"                                                                         \
    "vmovdqu " #I "*96+32(%[w]), %[t]\n\t"                                                                \
    "vpsrlw $2, %[t], %[t]\n\t"                                                                           \
    "vpand %[g], %[t], %[t]\n\t"                                                                          \
    "vpor %[t], %[w1], %[w1]\n\t"
#define QM_U5(I, OFF) /* half h of a 5-bit quad: nibbles at OFF, the fifth bits of bytes 64..79 */  \
    "vmovdqu " #I "*80+" OFF "(%[w]), %[w1]\n\t"                                                          \
    "vpand %[w1], %[f], %[w0]\n\t"                                                                        \
    "vpsrlw $4, %[w1], %[w1]\n\t"                                                                         \
    "vpand %[f], %[w1], %[w1]\n\t"                                                                        \
    "vbroadcasti128 " #I "*80+64(%[w]), %[u]\n\t"                                                         \
    "vpand %[b0], %[u], %[t]\n\t"                                                                         \
    "vpcmpeqb %[b0], %[t], %[t]\n\t"                                                                      \
    "vpand %[g], %[t], %[t]\n\t"                                                                          \
    "vpor %[t], %[w0], %[w0]\n\t"                                                                         \
    "vpand %[b1], %[u], %[t]\n\t"                                                                         \
    "vpcmpeqb %[b1], %[t], %[t]\n\t"                                                                      \
    "vpand %[g], %[t], %[t]\n\t"                                                                          \
    "vpor %[t], %[w1], %[w1]\n\t"
#define QM_U5L(I) QM_U5(I, "0")
#define QM_U5H(I) QM_U5(I, "32")
#define QM_U8(I) /* half h of an 8-bit quad */                                                            \
    "vmovdqu " #I "*128(%[w]), %[w0]\n\t"                                                                \
    "vmovdqu " #I "*128+32(%[w]), %[w1]\n\t"
/* Q8_0's row (mac1's sign trick: |x| times the codes with x's sign), each quad's products
 * widened at once into the int32 sums A, B (a quad's pair of products can fill an int16) */
#define QM_ROW8_HALF(WV, S, FIRST)                                                                        \
    "vpsignb %[x], %[" WV "], %[t]\n\t"                                                                  \
    "vpmaddubsw %[t], %[u], %[t]\n\t"                                                                    \
    FIRST("vpmaddwd %[f], %[t], %[" S "]\n\t", "vpmaddwd %[f], %[t], %[t]\n\tvpaddd %[t], %[" S "], %[" S "]\n\t")
#define QM_FIRST(A, B) A
#define QM_LATER(A, B) B
#define QM_ROW8_0_ASM(X, A, B)                                                                            \
    "vpbroadcastd " X ", %[x]\n\t"                                                                       \
    "vpsignb %[x], %[x], %[u]\n\t" QM_ROW8_HALF("w0", A, QM_FIRST) QM_ROW8_HALF("w1", B, QM_FIRST)
#define QM_ROW8_ASM(X, A, B)                                                                              \
    "vpbroadcastd " X ", %[x]\n\t"                                                                       \
    "vpsignb %[x], %[x], %[u]\n\t" QM_ROW8_HALF("w0", A, QM_LATER) QM_ROW8_HALF("w1", B, QM_LATER)
#define QM_X(I, R) #I "*4(%[y" #R "])"
#define QM_R1(I, ROW) ROW(QM_X(I, 0), "s00", "s01")
#define QM_R2(I, ROW) QM_R1(I, ROW) ROW(QM_X(I, 1), "s10", "s11")
#define QM_R3(I, ROW) QM_R2(I, ROW) ROW(QM_X(I, 2), "s20", "s21")
#define QM_R4(I, ROW) QM_R3(I, ROW) ROW(QM_X(I, 3), "s30", "s31")

/* acc += the products of the codes W with a quad of activations broadcast in xq: VNNI, each
 * int32 element's four in one vpdpbusd; AVX2, into int16 lanes by vpmaddubsw (the caller widens
 * after each run of QUADS_PER_RUN quads). 8-bit codes are signed, so there |x| * sign(q, x),
 * one quad per int16 run on AVX2 (acc is zero there). */
AI __m256i mac1(__m256i acc, __m256i W, __m256i xq, const int BITS) {
    if (BITS == 8) {
#if QM_VNNI
        return QM_DPBUSD(acc, _mm256_sign_epi8(xq, xq), _mm256_sign_epi8(W, xq));
#else
        return _mm256_maddubs_epi16(_mm256_sign_epi8(xq, xq), _mm256_sign_epi8(W, xq));
#endif
    }
#if QM_VNNI
    return QM_DPBUSD(acc, W, xq);
#else
    return _mm256_add_epi16(acc, _mm256_maddubs_epi16(W, xq));
#endif
}

/* mac1 on code vectors W[0 .. NV-1], into acc[v]. */
AI void mac_quad(const __m256i *W, const int NV, __m256i xq, const int BITS, __m256i *acc) {
    for (int v = 0; v < NV; v++) acc[v] = mac1(acc[v], W[v], xq, BITS);
}

#if QM_VNNI
/* Quads summed before the sums are widened and weighted: int32 sums never overflow in a group. */
#define QUADS_PER_RUN(BITS) 64

/* A run's sums as int32, weighted by the row's sub-block scale (one int32 per element). */
AI __m256i widen(__m256i s, __m256i wt, const int WEIGHTED) { return WEIGHTED ? _mm256_mullo_epi32(s, wt) : s; }
#else
#define QUADS_PER_RUN(BITS) QUADS_PER_I16(BITS)

/* A run's int16 sums widened to int32, each pair weighted by wt (the row's sub-block scale
 * in both int16 of its element; 1 for the plain types). */
AI __m256i widen(__m256i s, __m256i wt, const int WEIGHTED) {
    (void)WEIGHTED;
    return _mm256_madd_epi16(s, wt);
}
#endif

/* The int32 sums of group g over the chunk at `row`, batch rows b0 .. b0 + BB - 1:
 * acc[b][v] element e = sum over the group's slots of q (row + 8v + e) * qx (b0 + b). */
AI void group_sums(const qm_matrix *m, const qm_acts *a, int g, int row, int b0, const int BB, const int BITS,
                   int prefetch, __m256i acc[PASS][4]) {
    const size_t choff = (size_t)(row / 32) * (4 * BITS), stride = m->colstride;
    const int s0 = a->goff[g], s1 = a->goff[g + 1];
    const __m256i ones = _mm256_set1_epi16(1); /* the widening's weights: none */
    for (int b = 0; b < BB; b++)
        for (int v = 0; v < 4; v++) acc[b][v] = _mm256_setzero_si256();
    const int pf = prefetch ? si4_prefetch_ahead * BITS / 4 : 0;
    for (int i0 = s0; i0 < s1; i0 += 4 * QUADS_PER_RUN(BITS)) {
        const int i1 = i0 + 4 * QUADS_PER_RUN(BITS) < s1 ? i0 + 4 * QUADS_PER_RUN(BITS) : s1;
        __m256i acc16[PASS][4];
        for (int b = 0; b < BB; b++)
            for (int v = 0; v < 4; v++) acc16[b][v] = _mm256_setzero_si256();
        for (int i = i0; i < i1; i += 4) {
            __m256i W[4];
            const uint8_t *p[4];
            for (int t = 0; t < 4; t++) p[t] = m->codes + (size_t)a->cols[i + t] * stride + choff;
            if (pf)
                for (int t = 0; t < 4; t++) __builtin_prefetch(p[t] + pf, 0, 3);
            load_quad(p, BITS, W);
            for (int b = 0; b < BB; b++) {
                int32_t q4;
                memcpy(&q4, a->qx + (size_t)(b0 + b) * a->qx_stride + i, 4);
                mac_quad(W, 4, _mm256_set1_epi32(q4), BITS, acc16[b]);
            }
        }
        for (int b = 0; b < BB; b++)
            for (int v = 0; v < 4; v++) acc[b][v] = _mm256_add_epi32(acc[b][v], widen(acc16[b][v], ones, 0));
    }
}

/* y (8 rows) += D dx acc + M xs, in this order (both kernels: the same numbers per row). */
AI __m256 flush(__m256 y, __m256 D, __m256 M, float dx, float xs, __m256i acc) {
    const __m256 t = _mm256_fmadd_ps(M, _mm256_set1_ps(xs), y);
    return _mm256_fmadd_ps(_mm256_mul_ps(D, _mm256_set1_ps(dx)), _mm256_cvtepi32_ps(acc), t);
}

/* One pass: batch rows b0 .. b0 + BB - 1 over the chunk at `row` of group g, into ybuf. */
AI void pass(const qm_matrix *m, const qm_acts *a, int g, int row, int b0, const int BB, const int BITS, int prefetch,
             float *ybuf) {
    __m256i acc[PASS][4];
    group_sums(m, a, g, row, b0, BB, BITS, prefetch, acc);
    const int qb = g * m->group / QM_QBLOCK, B = a->batch;
    for (int v = 0; v < 4; v++) {
        __m256 D, M;
        factors8(m, g, row + 8 * v, &D, &M);
        for (int b = 0; b < BB; b++) {
            float *y = ybuf + (size_t)(b0 + b) * m->npad + row + 8 * v;
            _mm256_storeu_ps(y, flush(_mm256_loadu_ps(y), D, M, a->dx[(size_t)(b0 + b) * a->dx_stride + qb],
                                      a->xs[(size_t)g * B + b0 + b], acc[b][v]));
        }
    }
}

/* Many rows of x (prefill): chunks of 32 rows outer, every group inner, each pass of two rows
 * of x summing in registers: the chunk's codes of all groups (K / 2 bytes at 4 bits) stay in
 * L1/L2 for every pass, and y is written once (the group-outer loop would read and write all
 * of y once per group). */
AI void wide(const qm_matrix *m, const qm_acts *a, int row0, int row1, int g0, int g1, float *ybuf, const int BITS) {
    const int B = a->batch, G = g1 - g0;
    __m256 *dm = aligned_alloc(32, sizeof(__m256) * 8 * (size_t)(G > 0 ? G : 1)); /* (group, v, D|M) */
    if (!dm) return;
    for (int row = row0; row < row1; row += 32) {
        for (int g = g0; g < g1; g++)
            for (int v = 0; v < 4; v++) factors8(m, g, row + 8 * v, &dm[((g - g0) * 4 + v) * 2], &dm[((g - g0) * 4 + v) * 2 + 1]);
        for (int b0 = 0; b0 < B; b0 += PASS) {
            const int BB = B - b0 >= 2 ? 2 : 1;
            __m256 y[PASS][4];
            for (int b = 0; b < PASS; b++)
                for (int v = 0; v < 4; v++) y[b][v] = _mm256_setzero_ps();
            for (int g = g0; g < g1; g++) {
                if (a->goff[g] == a->goff[g + 1]) continue;
                __m256i acc[PASS][4];
                const int qb = g * m->group / QM_QBLOCK;
                if (BB == 2) group_sums(m, a, g, row, b0, 2, BITS, 0, acc);
                else group_sums(m, a, g, row, b0, 1, BITS, 0, acc);
                for (int b = 0; b < BB; b++)
                    for (int v = 0; v < 4; v++)
                        y[b][v] = flush(y[b][v], dm[((g - g0) * 4 + v) * 2], dm[((g - g0) * 4 + v) * 2 + 1],
                                        a->dx[(size_t)(b0 + b) * a->dx_stride + qb], a->xs[(size_t)g * B + b0 + b], acc[b][v]);
            }
            for (int b = 0; b < BB; b++)
                for (int v = 0; v < 4; v++) _mm256_storeu_ps(ybuf + (size_t)(b0 + b) * m->npad + row + 8 * v, y[b][v]);
        }
    }
    free(dm);
}

/* ---------------------------------------------------------------- quads of columns (interleaved)
 *
 * Dense decoding, verification of drafted tokens, batches and prefill. Tiles are in the order
 * (chunk, group): the codes of 32 rows over all of K are one run. A chunk is taken in two
 * halves of 16 rows; per half and pass of up to NB rows of x, the groups' int16 / int32 sums
 * are made as the quads come (a half's codes unpacked once for all the pass's rows), and each
 * row's float sums stay in registers across all of K: y is written once per half. (On AVX2 a
 * decode step of one row takes the whole chunk in one pass: chunk_pass1.)
 *
 * Each factor is applied where it costs least:
 *   Q4_K / Q5_K: the sub-block's 6-bit scale weights the int16 -> int32 widening (vpmaddwd by
 *     the scale instead of by 1); per group one float multiply-add by its dx, and the
 *     super-block's d and dmin once per 256 inputs:
 *         y += d sum_g dx_g (sc_g S_g)  -  dmin sum_g mn_g xs_g
 *   Q6_K: the int8 scale of each 16 inputs the same way, the two groups of a block of 32
 *     summed in int32 before their dx:   y += d (sum_b dx_b P_b  -  32 sum_g sc_g xs_g)
 *   the others (a factor per group of 32): y += D dx S + M xs per group (`flush`).
 * Per row of x these are the same float operations in the same order at every batch size and
 * pass width: a row's result does not depend on the rows computed beside it. */

enum { KIND_PLAIN, KIND_KQ, KIND_Q6 };

/* Group g's tile of a chunk (interleaved layout), its lines prefetched `pf` bytes ahead (0: none). */
AI const uint8_t *group_tile(const uint8_t *chunk, unsigned g, size_t tile_bytes, int pf) {
    const uint8_t *p = chunk + (size_t)g * tile_bytes;
    if (pf) /* the tile's lines, once, ahead of the stream */
        for (size_t l = 0; l < tile_bytes; l += 64) __builtin_prefetch(p + pf + l, 0, 3);
    return p;
}
/* Where a group's quads come from over one chunk: the interleaved layout's tile, or (IL 0: the
 * column layout's prefill) the runs of the group's columns at the chunk's offset, four at a time
 * through load_quad, which gives the same vectors. */
typedef struct {
    const uint8_t *tile, *col0; /* IL: the tile; else the group's first column at the chunk */
    size_t colstride;
} quad_src;

AI quad_src group_quads(const qm_matrix *m, const uint8_t *chunk, int row, unsigned g, size_t tile_bytes, int pf,
                        const int IL) {
    quad_src q = {NULL, NULL, m->colstride};
    if (IL) q.tile = group_tile(chunk, g, tile_bytes, pf);
    else q.col0 = m->codes + (size_t)g * (size_t)(m->bits == 6 ? 16 : 32) * m->colstride + (size_t)(row / 32) * (size_t)(4 * m->bits);
    return q;
}

/* Half h of quad i's codes (load_half_il's W[0], W[1]). IL 2: the source is unpack_group's
 * buffer of this half's vectors, two loads. */
AI void quad_half(const quad_src *q, unsigned i, const int h, const int BITS, const int IL, __m256i W[2]) {
    if (IL == 2) {
        W[0] = _mm256_load_si256((const __m256i *)(q->tile + 64 * (size_t)i));
        W[1] = _mm256_load_si256((const __m256i *)(q->tile + 64 * (size_t)i + 32));
        return;
    }
    if (IL) {
        load_half_il(q->tile + (size_t)i * (16 * BITS), h, BITS, W);
        return;
    }
    const uint8_t *c[4];
    for (int t = 0; t < 4; t++) c[t] = q->col0 + (size_t)(4 * i + (unsigned)t) * q->colstride;
    __m256i Q[4];
    load_quad(c, BITS, Q);
    W[0] = Q[2 * h];
    W[1] = Q[2 * h + 1];
}
#define NB_MAX 4 /* rows of x per pass over a half */

/* Half h of a group's quads (from p) unpacked into buf, 64 bytes a quad (W[0], W[1]): prefill's
 * passes of NB_MAX rows of x read them from there (quad_half's IL 2) instead of unpacking the
 * codes again in every pass, and they are AMX's B tile as they are. */
AI void unpack_group(const quad_src *p, const int h, const int BITS, const int IL, uint8_t *buf) {
    for (int i = 0; i < (BITS == 6 ? 16 : 32) / 4; i++) {
        __m256i W[2];
        quad_half(p, (unsigned)i, h, BITS, IL, W);
        _mm256_store_si256((__m256i *)(buf + 64 * i), W[0]);
        _mm256_store_si256((__m256i *)(buf + 64 * i + 32), W[1]);
    }
}

/* A chunk's factors from row n on: factor f of rows n .. n + 7 at [fs f] (d and m per
 * super-block for the K-quants and Q6_K, per group of 32 for the others; sc per group; mn per
 * super-block). The interleaved layout keeps each array chunk by chunk (qm_fat: fs = 32), the
 * column layout factor by factor (fs = npad). */
typedef struct {
    const uint16_t *d, *m;
    const uint8_t *sc;
    const uint32_t *mn;
    size_t fs;
} chunk_fac;

AI chunk_fac chunk_factors(const qm_matrix *m, int n) {
    const size_t nd = (size_t)(m->k / m->dgroup), ng = (size_t)(m->k / m->group);
    const chunk_fac f = {
        .d = m->d + qm_fat(m, 0, nd, n),
        .m = m->m ? m->m + qm_fat(m, 0, nd, n) : NULL,
        .sc = m->sc ? m->sc + qm_fat(m, 0, ng, n) : NULL,
        .mn = m->mn ? m->mn + qm_fat(m, 0, nd, n) : NULL,
        .fs = m->interleaved ? 32 : (size_t)m->npad,
    };
    return f;
}

/* A group's factors for 8 rows of W, shared by every row of x: the widening weights (each
 * row's int16 pair (sc, sc) per int32 element: 1 for the plain types), and D, M (plain: y +=
 * D dx S + M xs) or what multiplies xs (Q4_K / Q5_K the 6-bit min, Q6_K the scale). */
typedef struct {
    __m256i wt;
    __m256 D, M, mnf, wf; /* wf: the scales as floats where not INT_SCALED */
} fac8;

AI void group_factors(const qm_matrix *m, const chunk_fac *cf, unsigned g, int t, const int KIND, fac8 *f) {
    if (KIND == KIND_PLAIN) {
        f->wt = _mm256_set1_epi16(1);
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(cf->d + cf->fs * g + 8 * t)));
        f->D = d; /* the same numbers as factors8 */
        f->M = cf->m ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(cf->m + cf->fs * g + 8 * t)))
                     : _mm256_mul_ps(_mm256_set1_ps((float)-m->off), d);
        return;
    }
    const uint8_t *sc = cf->sc + cf->fs * g + 8 * t;
    const __m256i b8 = _mm256_broadcastq_epi64(_mm_loadl_epi64((const __m128i *)sc));
    if (KIND == KIND_KQ) {
        const __m256i b32 = _mm256_cvtepu8_epi32(_mm256_castsi256_si128(b8)); /* byte r in element r */
#if QM_VNNI /* the scale is the byte's low 6 bits */
        f->wf = _mm256_cvtepi32_ps(_mm256_and_si256(b32, _mm256_set1_epi32(63)));
#else /* ... in both int16 of the element */
        const __m256i at = _mm256_setr_epi8(0, -1, 0, -1, 1, -1, 1, -1, 2, -1, 2, -1, 3, -1, 3, -1, 4, -1, 4, -1, 5, -1, 5,
                                            -1, 6, -1, 6, -1, 7, -1, 7, -1);
        f->wt = _mm256_and_si256(_mm256_shuffle_epi8(b8, at), _mm256_set1_epi16(63));
#endif
        /* the min: the byte's top 2 bits above the low nibble of its word */
        const __m256i lo = _mm256_srl_epi32(_mm256_loadu_si256((const __m256i *)(cf->mn + cf->fs * (g / 8) + 8 * t)),
                                            _mm_cvtsi32_si128((int)(4 * (g % 8))));
        const __m256i top = _mm256_srli_epi32(_mm256_and_si256(b32, _mm256_set1_epi32(0xc0)), 2);
        f->mnf = _mm256_cvtepi32_ps(_mm256_or_si256(top, _mm256_and_si256(lo, _mm256_set1_epi32(15))));
        return;
    }
    const __m256i s32 = _mm256_cvtepi8_epi32(_mm256_castsi256_si128(b8)); /* Q6_K: signed byte r in element r */
#if QM_VNNI
    f->wt = s32;
#else /* into the high bytes of both int16, then down */
    const __m256i at = _mm256_setr_epi8(-1, 0, -1, 0, -1, 1, -1, 1, -1, 2, -1, 2, -1, 3, -1, 3, -1, 4, -1, 4, -1, 5, -1, 5,
                                        -1, 6, -1, 6, -1, 7, -1, 7);
    f->wt = _mm256_srai_epi16(_mm256_shuffle_epi8(b8, at), 8);
#endif
    f->mnf = _mm256_cvtepi32_ps(s32);
}

/* The running sums of one row of x for 8 rows of W: y, and for the K-quants and Q6_K the
 * super-block's fs, fm and (Q6_K) the int32 sums of a block of 32. */
typedef struct {
    __m256 y, fs, fm;
    __m256i blk;
} acc8;

/* Whether a group's int32 sums are weighted by the sub-block scales as integers (AVX2: in the
 * widening; VNNI: vpmulld, for Q6_K) or, VNNI's Q4_K / Q5_K, as floats in group_update (one
 * vmulps instead of vpmulld's two uops, 3-4% in prefill). Both are exact, the same floats:
 * |sum| x scale <= 32 x 31 x 127 x 63 < 2^24. */
#define INT_SCALED(KIND) ((KIND) == KIND_Q6 || ((KIND) == KIND_KQ && !QM_VNNI))

/* acc[b][t] element e = sum over the group's quads (from p) of q(row 16 h + 8 t + e) * qx,
 * weighted by the row's sub-block scale in f[t].wt if INT_SCALED, for the BB rows of x at
 * qx[b * qs]. */
AI void group_sums_il(const quad_src *p, const int8_t *qx, size_t qs, const int h, const int BB, const int BITS,
                      const int KIND, const int IL, const fac8 f[2], __m256i acc[NB_MAX][2]) {
    const int NQ = (BITS == 6 ? 16 : 32) / 4, RUN = QUADS_PER_RUN(BITS) < NQ ? QUADS_PER_RUN(BITS) : NQ;
    for (int b = 0; b < BB; b++) acc[b][0] = acc[b][1] = _mm256_setzero_si256();
    for (int i0 = 0; i0 < NQ; i0 += RUN) { /* RUN divides NQ */
        __m256i s16[NB_MAX][2];
        for (int b = 0; b < BB; b++) s16[b][0] = s16[b][1] = _mm256_setzero_si256();
        /* unrolled whole, GCC hoists every quad's loads and unpacking ahead and spills them */
#pragma GCC unroll 2
        for (int i = i0; i < i0 + RUN; i++) {
            __m256i W[2];
            quad_half(p, (unsigned)i, h, BITS, IL, W);
            for (int b = 0; b < BB; b++) {
                int32_t q4;
                memcpy(&q4, qx + (size_t)b * qs + 4 * i, 4);
                mac_quad(W, 2, _mm256_set1_epi32(q4), BITS, s16[b]);
            }
        }
        for (int b = 0; b < BB; b++)
            for (int t = 0; t < 2; t++)
                acc[b][t] = _mm256_add_epi32(acc[b][t], widen(s16[b][t], f[t].wt, INT_SCALED(KIND)));
    }
}

/* group_sums_il for one to four rows of x (a decode step's row, a pass of prefill, of a
 * verification or of a batch),
 * written out: the sums are named values that stay in registers for the whole group (16 ymm hold
 * 8 sums, 2 code vectors, the masks and the temporaries). On AVX2 each run of quads is one asm
 * block, the codes' unpacking included (Q8_0: the whole group, each quad widened at once): in C
 * (GCC 12) two sums lived on the stack, a store-to-load chain through every quad, and around a
 * block per quad GCC copied the sums between registers and reloaded the masks every quad. The
 * C loop is the VNNI variants' (and AMX's column layout, IL 0). The same integers everywhere. */
AI void group_sums_rows_il(const quad_src *p, const int8_t *qx, size_t qs, const int h, const int NB, const int BITS,
                           const int KIND, const int IL, const fac8 f[2], __m256i acc[NB_MAX][2]) {
    const int NQ = (BITS == 6 ? 16 : 32) / 4, RUN = QUADS_PER_RUN(BITS) < NQ ? QUADS_PER_RUN(BITS) : NQ;
    /* rows past NB: row 0's address, never read */
    const int8_t *x0 = qx, *x1 = NB > 1 ? qx + qs : qx, *x2 = NB > 2 ? qx + 2 * qs : qx, *x3 = NB > 3 ? qx + 3 * qs : qx;
    __m256i a00 = _mm256_setzero_si256(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00, a30 = a00, a31 = a00;
    for (int i0 = 0; i0 < NQ; i0 += RUN) {
        __m256i s00 = _mm256_setzero_si256(), s01 = s00, s10 = s00, s11 = s00, s20 = s00, s21 = s00, s30 = s00, s31 = s00;
#if !QM_VNNI
        if (IL) {
            /* quad i0 (half h's bytes where the halves lie apart: 4- and 8-bit quads) */
            const size_t quad = IL == 2 ? 64 : 16 * BITS, half = IL == 1 && (BITS == 4 || BITS == 8) ? quad / 2 : 0;
            const uint8_t *w = p->tile + (size_t)i0 * quad + half * (size_t)h;
            const int8_t *y0 = x0 + 4 * i0, *y1 = x1 + 4 * i0, *y2 = x2 + 4 * i0, *y3 = x3 + 4 * i0;
            /* f: the low mask (Q8_0: the widening's int16 ones); g: Q6_K's top two bits, the fifth
             * bit's 16; b: the fifth bits' masks of this half's two code vectors (load_half_il) */
            const __m256i fm = BITS == 8 ? _mm256_set1_epi16(1) : _mm256_set1_epi8(BITS == 6 && h == 0 ? 63 : 15);
            const __m256i top = _mm256_set1_epi8(BITS == 5 ? 16 : 0x30);
            const __m256i b0 = join(_mm_set1_epi8((char)(1 << (4 * h))), _mm_set1_epi8((char)(1 << (4 * h + 1))));
            const __m256i b1 = join(_mm_set1_epi8((char)(1 << (4 * h + 2))), _mm_set1_epi8((char)(1 << (4 * h + 3))));
            __m256i w0, w1, xt, tt, ut;
#define QM_RUN_ASM(BODY) /* the sums are the block's outputs: its first quad writes them */              \
    __asm__(BODY                                                                                          \
            : [s00] "=&x"(s00), [s01] "=&x"(s01), [s10] "=&x"(s10), [s11] "=&x"(s11), [s20] "=&x"(s20),    \
              [s21] "=&x"(s21), [s30] "=&x"(s30), [s31] "=&x"(s31), [w0] "=&x"(w0), [w1] "=&x"(w1),       \
              [x] "=&x"(xt), [t] "=&x"(tt), [u] "=&x"(ut)                                                 \
            : [w] "r"(w), [y0] "r"(y0), [y1] "r"(y1), [y2] "r"(y2), [y3] "r"(y3), [f] "x"(fm), [g] "x"(top), \
              [b0] "m"(b0), [b1] "m"(b1)                                                                  \
            : "memory")
#define QM_Q(U, R, I) U(I) R(I, QM_ROW_ASM)
#define QM_RUNS(U, R)                                                                                     \
    if (RUN == 8)                                                                                         \
        QM_RUN_ASM(U(0) R(0, QM_ROW0_ASM) QM_Q(U, R, 1) QM_Q(U, R, 2) QM_Q(U, R, 3) QM_Q(U, R, 4)          \
                       QM_Q(U, R, 5) QM_Q(U, R, 6) QM_Q(U, R, 7));                                        \
    else if (RUN == 4) QM_RUN_ASM(U(0) R(0, QM_ROW0_ASM) QM_Q(U, R, 1) QM_Q(U, R, 2) QM_Q(U, R, 3));       \
    else if (RUN == 2) QM_RUN_ASM(U(0) R(0, QM_ROW0_ASM) QM_Q(U, R, 1));                                  \
    else QM_RUN_ASM(U(0) R(0, QM_ROW0_ASM))
#define QM_Q8(U, R, I) U(I) R(I, QM_ROW8_ASM)
#define QM_RUNS8(U, R) /* Q8_0: the whole group */                                                        \
    QM_RUN_ASM(U(0) R(0, QM_ROW8_0_ASM) QM_Q8(U, R, 1) QM_Q8(U, R, 2) QM_Q8(U, R, 3) QM_Q8(U, R, 4)        \
                   QM_Q8(U, R, 5) QM_Q8(U, R, 6) QM_Q8(U, R, 7))
#define QM_BY_ROWS(RUNS, U)                                                                               \
    if (NB == 1) RUNS(U, QM_R1);                                                                          \
    else if (NB == 2) RUNS(U, QM_R2);                                                                     \
    else if (NB == 3) RUNS(U, QM_R3);                                                                     \
    else RUNS(U, QM_R4)
            if (BITS == 8) { /* the sums are int32 already, of the whole group */
                if (IL == 2) QM_BY_ROWS(QM_RUNS8, QM_U2);
                else QM_BY_ROWS(QM_RUNS8, QM_U8);
                a00 = s00, a01 = s01, a10 = s10, a11 = s11, a20 = s20, a21 = s21, a30 = s30, a31 = s31;
                break;
            }
            if (IL == 2) QM_BY_ROWS(QM_RUNS, QM_U2);
            else if (BITS == 4) QM_BY_ROWS(QM_RUNS, QM_U4);
            else if (BITS == 5 && h == 0) QM_BY_ROWS(QM_RUNS, QM_U5L);
            else if (BITS == 5) QM_BY_ROWS(QM_RUNS, QM_U5H);
            else if (h == 0) QM_BY_ROWS(QM_RUNS, QM_U6L);
            else QM_BY_ROWS(QM_RUNS, QM_U6H);
#undef QM_BY_ROWS
#undef QM_RUNS8
#undef QM_Q8
#undef QM_RUNS
#undef QM_Q
#undef QM_RUN_ASM
        } else
#endif
#pragma GCC unroll 2
        for (int i = i0; i < i0 + RUN; i++) {
            __m256i W[2];
            quad_half(p, (unsigned)i, h, BITS, IL, W);
#define QM_ROW(xb, s0, s1)                                                                    \
    do {                                                                                      \
        int32_t q;                                                                            \
        memcpy(&q, (xb) + 4 * i, 4);                                                          \
        const __m256i xq = _mm256_set1_epi32(q);                                              \
        s0 = mac1(s0, W[0], xq, BITS);                                                        \
        s1 = mac1(s1, W[1], xq, BITS);                                                        \
    } while (0)
            QM_ROW(x0, s00, s01);
            if (NB > 1) QM_ROW(x1, s10, s11);
            if (NB > 2) QM_ROW(x2, s20, s21);
            if (NB > 3) QM_ROW(x3, s30, s31);
#undef QM_ROW
        }
        const int W8 = INT_SCALED(KIND);
        a00 = _mm256_add_epi32(a00, widen(s00, f[0].wt, W8)), a01 = _mm256_add_epi32(a01, widen(s01, f[1].wt, W8));
        if (NB > 1)
            a10 = _mm256_add_epi32(a10, widen(s10, f[0].wt, W8)), a11 = _mm256_add_epi32(a11, widen(s11, f[1].wt, W8));
        if (NB > 2)
            a20 = _mm256_add_epi32(a20, widen(s20, f[0].wt, W8)), a21 = _mm256_add_epi32(a21, widen(s21, f[1].wt, W8));
        if (NB > 3)
            a30 = _mm256_add_epi32(a30, widen(s30, f[0].wt, W8)), a31 = _mm256_add_epi32(a31, widen(s31, f[1].wt, W8));
    }
    acc[0][0] = a00, acc[0][1] = a01, acc[1][0] = a10, acc[1][1] = a11;
    acc[2][0] = a20, acc[2][1] = a21, acc[3][0] = a30, acc[3][1] = a31;
}

/* One row of x's float update by a group's int32 sums (the same operations on every path),
 * its dx and xs broadcast. Q6_K: `first` is the first group of a block of 32, whose sums wait
 * for the second's. FM 0: fm is left to superblock_fm (prefill). */
AI void group_update_fm(acc8 *s, const fac8 *f, __m256i acc, __m256 dx, __m256 xs, const int KIND, int first,
                        const int FM) {
    if (KIND == KIND_PLAIN) {
        const __m256 t = _mm256_fmadd_ps(f->M, xs, s->y); /* flush's operations */
        s->y = _mm256_fmadd_ps(_mm256_mul_ps(f->D, dx), _mm256_cvtepi32_ps(acc), t);
        return;
    }
    if (FM) s->fm = _mm256_fmadd_ps(f->mnf, xs, s->fm);
    if (KIND == KIND_KQ) { /* a group is a block of 32 */
        const __m256 sums = INT_SCALED(KIND) ? _mm256_cvtepi32_ps(acc) : _mm256_mul_ps(_mm256_cvtepi32_ps(acc), f->wf);
        s->fs = _mm256_fmadd_ps(sums, dx, s->fs);
    } else if (first) {
        s->blk = acc;
    } else {
        s->fs = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(s->blk, acc)), dx, s->fs);
    }
}
AI void group_update_v(acc8 *s, const fac8 *f, __m256i acc, __m256 dx, __m256 xs, const int KIND, int first) {
    group_update_fm(s, f, acc, dx, xs, KIND, first, 1);
}

AI void group_update(acc8 *s, const fac8 *f, __m256i acc, float dx, float xs, const int KIND, int first) {
    group_update_v(s, f, acc, _mm256_set1_ps(dx), _mm256_set1_ps(xs), KIND, first);
}

/* group_update of BB rows of x (their sums in s[0 .. BB)): row b's dx at dx[b * dx_stride], its
 * xs at xs[b], each broadcast straight from memory (passed as floats, GCC kept them on the
 * stack and recomputed every address from the pass's indices). */
AI void rows_update(acc8 (*s)[2], const fac8 f[2], __m256i acc[NB_MAX][2], const float *dx, size_t dx_stride,
                    const float *xs, const int BB, const int KIND, int first, const int FM) {
    for (int b = 0; b < BB; b++) {
        const __m256 dxv = _mm256_broadcast_ss(dx + (size_t)b * dx_stride), xsv = _mm256_broadcast_ss(xs + b);
        group_update_fm(&s[b][0], &f[0], acc[b][0], dxv, xsv, KIND, first, FM);
        group_update_fm(&s[b][1], &f[1], acc[b][1], dxv, xsv, KIND, first, FM);
    }
}

/* A row of x's fm over a super-block's PER_SB groups, from their mins (Q6_K: scales) mn[j] and
 * its xs (group j's at xs[j * B]), as group_update adds them: from zero, one FMA a group, so the
 * same floats. */
AI __m256 superblock_fm(const __m256 *mn, const float *xs, unsigned B, const unsigned PER_SB) {
    __m256 fm = _mm256_setzero_ps();
    for (unsigned j = 0; j < PER_SB; j++) fm = _mm256_fmadd_ps(mn[j], _mm256_broadcast_ss(xs + (size_t)j * B), fm);
    return fm;
}

/* The super-block's d (and dmin) into y, after its last group. */
AI void superblock_update(acc8 *s, __m256 d, __m256 dmin, const int KIND) {
    if (KIND == KIND_KQ) s->y = _mm256_fnmadd_ps(dmin, s->fm, _mm256_fmadd_ps(d, s->fs, s->y));
    else s->y = _mm256_fmadd_ps(d, _mm256_fnmadd_ps(_mm256_set1_ps(32.0f), s->fm, s->fs), s->y);
    s->fs = s->fm = _mm256_setzero_ps();
}

/* Super-block sb's d and (the K-quants) dmin of rows 8 t .. 8 t + 7 of a chunk's factors. */
AI void superblock_scales(const chunk_fac *cf, unsigned sb, int t, const int KIND, __m256 *d, __m256 *dmin) {
    *d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(cf->d + cf->fs * sb + 8 * t)));
    *dmin = KIND == KIND_KQ ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(cf->m + cf->fs * sb + 8 * t)))
                            : _mm256_setzero_ps();
}

#if QM_ZMM
/* ---------------------------------------------------------------- 512-bit passes (AVX512-VNNI)
 *
 * The AVX512-VNNI variants take a half-chunk's 16 rows of W in one 512-bit vector: a quad's
 * codes of all 16 rows are one vector (W[0] and W[1] of load_half_il side by side), one
 * vpdpbusd makes the int32 sums two make on 256-bit registers, and a row of x's float updates
 * of the 16 rows are one vector operation each. Per element these are the same integer sums and
 * the same float operations as half_pass's, so every variant still computes the same floats. */
/* A row of x's running sums for the 16 rows of W of a half-chunk (acc8's two halves in one
 * 512-bit vector each), and a group's factors for them (fac8's two halves). */
typedef struct {
    __m512 y, fs, fm;
    __m512 blk; /* Q6_K: a block of 32's first group's weighted sums (exact integers, as floats) */
} acc16;

typedef struct {
    __m512i wt;
    __m512 D, M, mnf, wf;
} fac16;

AI __m512 join_ps(__m256 lo, __m256 hi) {
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(lo)), _mm256_castps_pd(hi), 1));
}
AI __m512i join_si(__m256i lo, __m256i hi) { return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1); }

AI fac16 join_factors(const fac8 f[2], const int KIND) {
    fac16 F;
    F.wt = KIND == KIND_Q6 ? join_si(f[0].wt, f[1].wt) : _mm512_setzero_si512();
    if (KIND == KIND_PLAIN) {
        F.D = join_ps(f[0].D, f[1].D), F.M = join_ps(f[0].M, f[1].M);
        F.mnf = F.wf = _mm512_setzero_ps();
    } else {
        F.mnf = join_ps(f[0].mnf, f[1].mnf);
        F.wf = KIND == KIND_KQ ? join_ps(f[0].wf, f[1].wf) : _mm512_setzero_ps();
        F.D = F.M = _mm512_setzero_ps();
    }
    return F;
}

/* group_factors on 16 rows of W at once (fac8's two halves): the same integers converted, so
 * the same floats as join_factors of two group_factors, in fewer instructions. */
AI fac16 group_factors16(const qm_matrix *m, const chunk_fac *cf, unsigned g, const int KIND) {
    fac16 F;
    F.wt = _mm512_setzero_si512();
    F.D = F.M = F.mnf = F.wf = _mm512_setzero_ps();
    if (KIND == KIND_PLAIN) {
        F.D = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(cf->d + cf->fs * g)));
        F.M = cf->m ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(cf->m + cf->fs * g)))
                    : _mm512_mul_ps(_mm512_set1_ps((float)-m->off), F.D);
        return F;
    }
    const __m128i b = _mm_loadu_si128((const __m128i *)(cf->sc + cf->fs * g));
    if (KIND == KIND_KQ) {
        const __m512i b32 = _mm512_cvtepu8_epi32(b);
        F.wf = _mm512_cvtepi32_ps(_mm512_and_si512(b32, _mm512_set1_epi32(63)));
        const __m512i lo = _mm512_srl_epi32(_mm512_loadu_si512((const void *)(cf->mn + cf->fs * (g / 8))),
                                            _mm_cvtsi32_si128((int)(4 * (g % 8))));
        const __m512i top = _mm512_srli_epi32(_mm512_and_si512(b32, _mm512_set1_epi32(0xc0)), 2);
        F.mnf = _mm512_cvtepi32_ps(_mm512_or_si512(top, _mm512_and_si512(lo, _mm512_set1_epi32(15))));
        return F;
    }
    F.wt = _mm512_cvtepi8_epi32(b); /* Q6_K: the signed scale */
    F.mnf = _mm512_cvtepi32_ps(F.wt);
    return F;
}

/* group_update (with the VNNI variant's scaling) on 16 rows of W at once: the same operations
 * per element, so the same floats. FM 0: the K-quants' and Q6_K's fm is left to
 * superblocks_update16_fm (chunk_big16). */
AI void group_update16_fm(acc16 *s, const fac16 *f, __m512i acc, float dx, float xs, const int KIND, int first,
                          const int FM) {
    if (KIND == KIND_PLAIN) {
        const __m512 t = _mm512_fmadd_ps(f->M, _mm512_set1_ps(xs), s->y);
        s->y = _mm512_fmadd_ps(_mm512_mul_ps(f->D, _mm512_set1_ps(dx)), _mm512_cvtepi32_ps(acc), t);
        return;
    }
    if (FM) s->fm = _mm512_fmadd_ps(f->mnf, _mm512_set1_ps(xs), s->fm);
    if (KIND == KIND_KQ) {
        s->fs = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(acc), f->wf), _mm512_set1_ps(dx), s->fs);
        return;
    }
    /* Q6_K: the block of 32's weighted sum as float products, not vpmulld's (two uops each, on
     * the pipes vpdpbusd needs): a group's |sum| x |scale| <= 16 x 63 x 127 x 128 < 2^24 is
     * exact, and the second group's FMA rounds the block's exact sum once, as the cvt of the
     * int32 sum the other variants make, so the same floats. */
    if (first) s->blk = _mm512_mul_ps(_mm512_cvtepi32_ps(acc), f->mnf);
    else s->fs = _mm512_fmadd_ps(_mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), f->mnf, s->blk), _mm512_set1_ps(dx), s->fs);
}
AI void group_update16(acc16 *s, const fac16 *f, __m512i acc, float dx, float xs, const int KIND, int first) {
    group_update16_fm(s, f, acc, dx, xs, KIND, first, 1);
}

AI void superblock_update16(acc16 *s, __m512 d, __m512 dmin, const int KIND) {
    if (KIND == KIND_KQ) s->y = _mm512_fnmadd_ps(dmin, s->fm, _mm512_fmadd_ps(d, s->fs, s->y));
    else s->y = _mm512_fmadd_ps(d, _mm512_fnmadd_ps(_mm512_set1_ps(32.0f), s->fm, s->fs), s->y);
    s->fs = s->fm = _mm512_setzero_ps();
}

/* superblocks_update16 with each row's fm made here from the super-block's PER_SB mins mn[j]
 * and the rows' xs (group j's at xs[j * B + r]), in the order group_update16 adds them: fm from
 * zero, one FMA a group, so the same floats. */
AI void superblocks_update16_fm(acc16 *s, unsigned n, const chunk_fac *cf, unsigned sb, const int KIND,
                                const __m512 *mn, const float *xs, unsigned B) {
    const unsigned PER_SB = KIND == KIND_KQ ? 8 : 16;
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(cf->d + cf->fs * sb)));
    const __m512 dmin = KIND == KIND_KQ ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(cf->m + cf->fs * sb)))
                                        : _mm512_setzero_ps();
    for (unsigned r = 0; r < n; r++) {
        __m512 fm = _mm512_setzero_ps();
        for (unsigned j = 0; j < PER_SB; j++) fm = _mm512_fmadd_ps(mn[j], _mm512_set1_ps(xs[(size_t)j * B + r]), fm);
        s[r].fm = fm;
        superblock_update16(&s[r], d, dmin, KIND);
    }
}

/* Rows s[0 .. n) of running sums set to zero (a pass's start). */
AI void zero_sums16(acc16 *s, unsigned n) {
    for (unsigned b = 0; b < n; b++) {
        s[b].y = s[b].fs = s[b].fm = _mm512_setzero_ps();
        s[b].blk = _mm512_setzero_ps();
    }
}

/* superblock_update16 of super-block sb (its d and dmin from the chunk's factors) on rows s[0 .. n). */
AI void superblocks_update16(acc16 *s, unsigned n, const chunk_fac *cf, unsigned sb, const int KIND) {
    if (!n) return;
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(cf->d + cf->fs * sb)));
    const __m512 dmin = KIND == KIND_KQ ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(cf->m + cf->fs * sb)))
                                        : _mm512_setzero_ps();
    for (unsigned r = 0; r < n; r++) superblock_update16(&s[r], d, dmin, KIND);
}

/* The codes of half h of the quad at p in one vector: element e holds row 16 h + e's four codes
 * (load_half_il's W[0] in the low half, W[1] in the high half). */
AI __m512i load_half16(const uint8_t *p, const int h, const int BITS) {
    if (BITS == 8) return _mm512_loadu_si512((const void *)(p + 64 * h));
    if (BITS == 4) {
        const __m256i u = _mm256_loadu_si256((const __m256i *)(p + 32 * h));
        return _mm512_and_si512(join_si(u, _mm256_srli_epi16(u, 4)), _mm512_set1_epi8(15));
    }
    __m256i W[2];
    load_half_il(p, h, BITS, W);
    return join_si(W[0], W[1]);
}

/* acc += W's codes times a quad of x broadcast in xq (mac_quad on 16 rows of W). */
AI __m512i mac_quad16(__m512i acc, __m512i W, __m512i xq, const int BITS) {
    if (BITS == 8) { /* signed codes: |x| * sign(q, x) */
        const __m512i sw = _mm512_mask_sub_epi8(W, _mm512_movepi8_mask(xq), _mm512_setzero_si512(), W);
        return _mm512_dpbusd_epi32(acc, _mm512_abs_epi8(xq), sw);
    }
    return _mm512_dpbusd_epi32(acc, W, xq);
}

/* half_pass for a decode step on 512-bit registers (Q8_0 up to 2 rows; the other types take
 * chunk_big16): half h (rows n .. n + 15) of the chunk at `chunk` over all of K, for rows
 * [b0, b0 + BB) of x (BB <= NB_MAX), y written to ybuf. */
AI void half_pass16(const qm_matrix *m, const qm_acts *a, const uint8_t *chunk, int n, const int h, int b0,
                    const int BB, float *ybuf, const int BITS, const int KIND, int pf) {
    const unsigned GROUP = BITS == 6 ? 16 : 32, PER_SB = KIND == KIND_PLAIN ? 1 : 256 / GROUP, NQ = GROUP / 4;
    const unsigned G = (unsigned)m->k / GROUP, B = (unsigned)a->batch;
    const size_t tile_bytes = (size_t)GROUP / 4 * (16 * BITS), qs = a->qx_stride;
    const chunk_fac cf = chunk_factors(m, n);
    acc16 s[NB_MAX];
    zero_sums16(s, (unsigned)BB);
    for (unsigned sb = 0; sb < G / PER_SB; sb++) {
        for (unsigned j = 0; j < PER_SB; j++) {
            const unsigned g = sb * PER_SB + j, qb = g * GROUP / QM_QBLOCK;
            const uint8_t *p = group_tile(chunk, g, tile_bytes, pf);
            const int8_t *qx = a->qx + (size_t)(b0) * qs + (size_t)g * GROUP;
            __m512i acc[NB_MAX];
            for (int b = 0; b < BB; b++) acc[b] = _mm512_setzero_si512();
#pragma GCC unroll 8
            for (unsigned i = 0; i < NQ; i++) {
                const __m512i W = load_half16(p + (size_t)i * (16 * BITS), h, BITS);
                for (int b = 0; b < BB; b++) {
                    int32_t q4;
                    memcpy(&q4, qx + (size_t)b * qs + 4 * i, 4);
                    acc[b] = mac_quad16(acc[b], W, _mm512_set1_epi32(q4), BITS);
                }
            }
            const fac16 F = group_factors16(m, &cf, g, KIND);
            for (int b = 0; b < BB; b++)
                group_update16(&s[b], &F, acc[b], a->dx[(size_t)(b0 + b) * a->dx_stride + qb], a->xs[(size_t)g * B + b0 + b],
                               KIND, j % 2 == 0);
        }
        if (KIND != KIND_PLAIN) superblocks_update16(s, (unsigned)BB, &cf, sb, KIND);
    }
    for (int b = 0; b < BB; b++) _mm512_storeu_ps(ybuf + (size_t)(b0 + b) * m->npad + n, s[b].y);
}

/* chunk_big16 prefetches its codes BIG_AHEAD times as far ahead as the decode passes (3 KB of
 * 4-bit codes): a group's tile serves every row of x before the next is read, so the stream
 * moves slower than a decode pass's and lines must be asked for earlier to arrive in time. On
 * two Zen 5 threads, with the weights in DRAM: Q4_K 1.16x / 1.26x / 1.43x at 1 / 4 / 8 rows
 * against the decode passes' distance (2x: 0.82-0.97x of 4x; 8x: 0.93-1.07x), no change at 64. */
enum { BIG_AHEAD = 4 };

/* A row of x's int32 sums (from xb) over a group's NQ quads, for both halves of a chunk (codes
 * W0, W1 in registers), starting from c0, c1 (Q8_0: see chunk_big16); two chains of 4 quads a
 * half. */
AI void row_sums16(const int8_t *xb, const __m512i *W0, const __m512i *W1, const unsigned NQ, const int BITS,
                   __m512i c0, __m512i c1, __m512i *s0, __m512i *s1) {
    __m512i a0[2] = {c0, _mm512_setzero_si512()}, a1[2] = {c1, _mm512_setzero_si512()};
#pragma GCC unroll 8
    for (unsigned i = 0; i < NQ; i++) {
        int32_t q4;
        memcpy(&q4, xb + 4 * i, 4);
        const __m512i xq = _mm512_set1_epi32(q4);
        const unsigned c = NQ == 8 ? i % 2 : 0;
        if (BITS == 8) {
            const __m512i xu = _mm512_xor_si512(xq, _mm512_set1_epi8((char)0x80)); /* x + 128 */
            a0[c] = _mm512_dpbusd_epi32(a0[c], xu, W0[i]);
            a1[c] = _mm512_dpbusd_epi32(a1[c], xu, W1[i]);
            continue;
        }
        a0[c] = mac_quad16(a0[c], W0[i], xq, BITS);
        a1[c] = mac_quad16(a1[c], W1[i], xq, BITS);
    }
    *s0 = _mm512_add_epi32(a0[0], a0[1]);
    *s1 = _mm512_add_epi32(a1[0], a1[1]);
}

/* The interleaved layout's pass on 512-bit registers, for every row count (Q8_0: from 3 rows;
 * see kernel_il): the chunk at `chunk` (rows row .. row + 31 of W, both halves) over all of K
 * for every row of x, groups outer. A group's codes are unpacked once into registers (a vector
 * a quad and half: sixteen for 4-bit codes), then each row of x in turn makes its int32 sums
 * for both halves from one set of broadcasts, and its float updates; the rows' running sums
 * wait in s (s[b] half 0, s[B + b] half 1: 32 KB at most, in L1). Both halves a turn halve the
 * broadcasts and the loop's bookkeeping a vpdpbusd, which held one half a turn to about 60% of
 * the vpdpbusd rate. (On Zen 5 the float multiplies and FMAs share vpdpbusd's two pipes: a
 * 4-bit group's 16 vpdpbusd and 6 float products bound it at 16/22.) The same integer sums and
 * float operations per element as half_pass16, so the same floats. The mins' term (fm) is made
 * per row at the super-block's end, from the groups' mins kept aside, in the same order, instead
 * of loaded and stored in every group's row loop: Q4_K 1.02x, Q6_K 1.07x at 64 rows (1.34x at
 * 16) on two Zen 5 threads. */
AI void chunk_big16(const qm_matrix *m, const qm_acts *a, const uint8_t *chunk, int row, acc16 *s, float *ybuf,
                    const int BITS, const int KIND, int pf) {
    const unsigned GROUP = BITS == 6 ? 16 : 32, PER_SB = KIND == KIND_PLAIN ? 1 : 256 / GROUP, NQ = GROUP / 4;
    const unsigned G = (unsigned)m->k / GROUP, B = (unsigned)a->batch;
    const size_t tile_bytes = (size_t)GROUP / 4 * (16 * BITS), qs = a->qx_stride;
    const chunk_fac cf[2] = {chunk_factors(m, row), chunk_factors(m, row + 16)};
    acc16 *const s1 = s + B;
    __m512 mn[2][16]; /* the super-block's groups' mins (Q6_K: scales) for the deferred fm */
    zero_sums16(s, 2 * B);
    for (unsigned sb = 0; sb < G / PER_SB; sb++) {
        for (unsigned j = 0; j < PER_SB; j++) {
            const unsigned g = sb * PER_SB + j, qb = g * GROUP / QM_QBLOCK;
            const uint8_t *p = group_tile(chunk, g, tile_bytes, pf);
            __m512i W0[8], W1[8];
#pragma GCC unroll 8
            for (unsigned i = 0; i < NQ; i++) {
                W0[i] = load_half16(p + (size_t)i * (16 * BITS), 0, BITS);
                W1[i] = load_half16(p + (size_t)i * (16 * BITS), 1, BITS);
            }
            const fac16 F0 = group_factors16(m, &cf[0], g, KIND), F1 = group_factors16(m, &cf[1], g, KIND);
            /* Q8_0's signed codes: x + 128 as the unsigned operand, and the sums start from
             * -128 times the group's codes summed (per row of W, made once for every row of x):
             * the same int32 sums as mac_quad16's sign transfer, with none of its three
             * instructions a quad (a mask, an abs and a masked subtract a vpdpbusd) */
            __m512i c0 = _mm512_setzero_si512(), c1 = c0;
            if (BITS == 8) {
                const __m512i ones = _mm512_set1_epi8(1);
                for (unsigned i = 0; i < NQ; i++)
                    c0 = _mm512_dpbusd_epi32(c0, ones, W0[i]), c1 = _mm512_dpbusd_epi32(c1, ones, W1[i]);
                c0 = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(c0, 7));
                c1 = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(c1, 7));
            }
            const int8_t *qx = a->qx + (size_t)g * GROUP;
            for (unsigned b = 0; b < B; b++) {
                __m512i a0, a1;
                row_sums16(qx + (size_t)b * qs, W0, W1, NQ, BITS, c0, c1, &a0, &a1);
                const float dx = a->dx[(size_t)b * a->dx_stride + qb], xs = a->xs[(size_t)g * B + b];
                group_update16_fm(&s[b], &F0, a0, dx, xs, KIND, j % 2 == 0, 0);
                group_update16_fm(&s1[b], &F1, a1, dx, xs, KIND, j % 2 == 0, 0);
            }
            mn[0][j] = F0.mnf, mn[1][j] = F1.mnf;
        }
        if (KIND != KIND_PLAIN) {
            superblocks_update16_fm(s, B, &cf[0], sb, KIND, mn[0], a->xs + (size_t)sb * PER_SB * B, B);
            superblocks_update16_fm(s1, B, &cf[1], sb, KIND, mn[1], a->xs + (size_t)sb * PER_SB * B, B);
        }
    }
    for (unsigned b = 0; b < B; b++) {
        _mm512_storeu_ps(ybuf + (size_t)b * m->npad + row, s[b].y);
        _mm512_storeu_ps(ybuf + (size_t)b * m->npad + row + 16, s1[b].y);
    }
}

/* The column layout's decode step on 512-bit registers (sparse files). The factors are applied
 * as half_pass16 applies them: a group's int32 sums weighted per row, d and dmin once per
 * super-block, so that a row's floats are the interleaved kernel's for the same thresholded x
 * (zeroed inputs add exact zeros there) when one call covers all of K. Groups are the outer
 * loop, as in `kernel`: a group's kept columns are a dozen runs read side by side, which the
 * prefetchers follow, and each row's running super-block sums (fs, fm and Q6_K's first-group
 * weighted sums) wait in `col_sums` between groups. */
typedef struct {
    float *fs, *fm, *blk;
    size_t rows; /* per row of x */
} col_sums;

/* load_quad for two consecutive 4-bit chunks at once (each column's 32 bytes in one load), as
 * col_group16 wants them: Z[0], Z[1] rows 0-15 and 16-31 of the first chunk, Z[2], Z[3] of the
 * second. The same bytes as two load_quad calls and their joins, in about half the shuffles. */
AI void load_quad64_4(const uint8_t *const p[4], __m512i Z[4]) {
    const __m256i c0 = _mm256_loadu_si256((const __m256i *)p[0]), c1 = _mm256_loadu_si256((const __m256i *)p[1]);
    const __m256i c2 = _mm256_loadu_si256((const __m256i *)p[2]), c3 = _mm256_loadu_si256((const __m256i *)p[3]);
    const __m256i a = _mm256_unpacklo_epi8(c0, c1), b = _mm256_unpackhi_epi8(c0, c1);
    const __m256i c = _mm256_unpacklo_epi8(c2, c3), d = _mm256_unpackhi_epi8(c2, c3);
    /* 128-bit lanes of U: bytes 0-3 of chunk A, of chunk B, bytes 4-7 of A, of B (V: 8-11, 12-15) */
    const __m512i U = join_si(_mm256_unpacklo_epi16(a, c), _mm256_unpackhi_epi16(a, c));
    const __m512i V = join_si(_mm256_unpacklo_epi16(b, d), _mm256_unpackhi_epi16(b, d));
    const __m512i f = _mm512_set1_epi8(15);
    const __m512i ul = _mm512_and_si512(U, f), uh = _mm512_and_si512(_mm512_srli_epi16(U, 4), f);
    const __m512i vl = _mm512_and_si512(V, f), vh = _mm512_and_si512(_mm512_srli_epi16(V, 4), f);
    const __m512i first = _mm512_setr_epi64(0, 1, 4, 5, 8, 9, 12, 13), second = _mm512_setr_epi64(2, 3, 6, 7, 10, 11, 14, 15);
    Z[0] = _mm512_permutex2var_epi64(ul, first, uh);
    Z[1] = _mm512_permutex2var_epi64(vl, first, vh);
    Z[2] = _mm512_permutex2var_epi64(ul, second, uh);
    Z[3] = _mm512_permutex2var_epi64(vl, second, vh);
}

/* Group g (j-th of its super-block) over CH chunks (32 CH rows) from `row` (offset `at` into
 * the sums), rows [b0, b0 + BB) of x; CH 2 for 4-bit codes only. Each quad's four columns are
 * prefetched `pf` bytes ahead in their runs, or, past `end` (the call's last row's bytes), the
 * next group's slot at the wrapped offset. */
AI void col_group16(const qm_matrix *m, const qm_acts *a, unsigned g, unsigned j, int row, size_t at, int b0,
                    const int BB, float *ybuf, const col_sums *cs, const int BITS, const int KIND, const int CH, int pf,
                    size_t end, size_t start) {
    const unsigned GROUP = BITS == 6 ? 16 : 32, B = (unsigned)a->batch, qb = g * GROUP / QM_QBLOCK;
    const size_t qs = a->qx_stride, stride = m->colstride, choff = (size_t)(row / 32) * (size_t)(4 * BITS);
    const int s0 = a->goff[g], s1 = a->goff[g + 1];
    const size_t ahead = choff + (size_t)pf;
    const int wrap = pf && ahead >= end, next0 = (int)g + 1 < a->n_groups ? a->goff[g + 1] : s1;
    const int next_n = (int)g + 1 < a->n_groups ? a->goff[g + 2] - next0 : 0;
    __m512i acc[NB_MAX][4];
    for (int b = 0; b < BB; b++)
        for (int t = 0; t < 2 * CH; t++) acc[b][t] = _mm512_setzero_si512();
    for (int i = s0; i < s1; i += 4) {
        const uint8_t *p[4];
        for (int t = 0; t < 4; t++) p[t] = m->codes + (size_t)a->cols[i + t] * stride + choff;
        if (pf && !wrap)
            for (int t = 0; t < 4; t++) __builtin_prefetch(p[t] + pf, 0, 3);
        else if (wrap)
            for (int t = 0; t < 4 && i - s0 + t < next_n; t++)
                __builtin_prefetch(m->codes + (size_t)a->cols[next0 + i - s0 + t] * stride + start + (ahead - end), 0, 3);
        __m512i Z[4];
        if (CH == 2) {
            load_quad64_4(p, Z);
        } else {
            __m256i W[4];
            load_quad(p, BITS, W);
            Z[0] = join_si(W[0], W[1]), Z[1] = join_si(W[2], W[3]);
        }
        for (int b = 0; b < BB; b++) {
            int32_t q4;
            memcpy(&q4, a->qx + (size_t)(b0 + b) * qs + i, 4);
            const __m512i xq = _mm512_set1_epi32(q4);
            for (int t = 0; t < 2 * CH; t++) acc[b][t] = mac_quad16(acc[b][t], Z[t], xq, BITS);
        }
    }
    for (int t = 0; t < 2 * CH; t++) {
        const chunk_fac cf = chunk_factors(m, row + 16 * t);
        const fac16 F = group_factors16(m, &cf, g, KIND);
        for (int b = 0; b < BB; b++) {
            const size_t o = (size_t)(b0 + b) * cs->rows + at + 16 * (size_t)t;
            float *y = ybuf + (size_t)(b0 + b) * m->npad + row + 16 * t;
            acc16 s;
            if (KIND == KIND_PLAIN) {
                s.y = _mm512_loadu_ps(y);
            } else {
                s.fs = j == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(cs->fs + o);
                s.fm = j == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(cs->fm + o);
                s.blk = KIND == KIND_Q6 && j % 2 ? _mm512_loadu_ps(cs->blk + o) : _mm512_setzero_ps();
            }
            group_update16(&s, &F, acc[b][t], a->dx[(size_t)(b0 + b) * a->dx_stride + qb], a->xs[(size_t)g * B + b0 + b],
                           KIND, j % 2 == 0);
            if (KIND == KIND_PLAIN) {
                _mm512_storeu_ps(y, s.y);
                continue;
            }
            _mm512_storeu_ps(cs->fs + o, s.fs);
            _mm512_storeu_ps(cs->fm + o, s.fm);
            if (KIND == KIND_Q6 && j % 2 == 0) _mm512_storeu_ps(cs->blk + o, s.blk);
        }
    }
}

/* After a super-block's last group: its d and dmin into y, rows of the chunk at `row`. */
AI void col_superblock16(const qm_matrix *m, unsigned sb, int row, size_t at, int B, float *ybuf, const col_sums *cs,
                         const int KIND) {
    for (int t = 0; t < 2; t++) {
        const chunk_fac cf = chunk_factors(m, row + 16 * t);
        acc16 s[SI4_MAX_BATCH];
        for (int b = 0; b < B; b++) {
            const size_t o = (size_t)b * cs->rows + at + 16 * (size_t)t;
            s[b].y = _mm512_loadu_ps(ybuf + (size_t)b * m->npad + row + 16 * t);
            s[b].fs = _mm512_loadu_ps(cs->fs + o);
            s[b].fm = _mm512_loadu_ps(cs->fm + o);
        }
        superblocks_update16(s, (unsigned)B, &cf, sb, KIND);
        for (int b = 0; b < B; b++) _mm512_storeu_ps(ybuf + (size_t)b * m->npad + row + 16 * t, s[b].y);
    }
}

/* A decode step (up to SI4_MAX_BATCH rows of x) on the column layout: rows [row0, row1) over
 * the groups [g0, g1) (whole super-blocks: module.c splits on them). */
AI void kernel_col16(const qm_matrix *m, const qm_acts *a, int row0, int row1, int g0, int g1, float *ybuf,
                     const int BITS, const int KIND) {
    static _Thread_local float *buf; /* the running sums, grown as needed */
    static _Thread_local size_t buf_n;
    const int B = a->batch, cb = 4 * BITS, PER_SB = KIND == KIND_PLAIN ? 1 : 256 / (BITS == 6 ? 16 : 32);
    const size_t R = (size_t)(row1 - row0), need = 3 * R * (size_t)B;
    if (KIND != KIND_PLAIN && buf_n < need) {
        free(buf);
        buf_n = 0;
        if (!(buf = aligned_alloc(64, need * sizeof(float)))) return;
        buf_n = need;
    }
    const col_sums cs = {buf, buf + R * (size_t)B, buf + 2 * R * (size_t)B, R};
    const int pf0 = si4_prefetch_ahead * BITS / 4;
    const size_t start = (size_t)(row0 / 32) * (size_t)cb, end = (size_t)(row1 / 32) * (size_t)cb;
    for (int b = 0; b < B; b++) memset(ybuf + (size_t)b * m->npad + row0, 0, sizeof(float) * R);
    for (int g = g0; g < g1; g++) {
        const unsigned j = (unsigned)(g % PER_SB);
        for (int row = row0; row < row1;) {
            const size_t at = (size_t)(row - row0);
            const int CH = BITS == 4 && row + 64 <= row1 ? 2 : 1; /* 4-bit: two chunks a pass */
            const int pf = (int)(((size_t)(row / 32) * cb) % 64) < cb * CH ? pf0 : 0; /* once per line of a run */
#define COL_GROUP(BB_, CH_)                                                                                         \
    col_group16(m, a, (unsigned)g, j, row, at, b0, BB_, ybuf, &cs, BITS, KIND, CH_, b0 ? 0 : pf, end, start)
            for (int b0 = 0; b0 < B; b0 += NB_MAX) {
                const int bb = B - b0 < NB_MAX ? B - b0 : NB_MAX;
                if (CH == 2) switch (bb) {
                    case 1: COL_GROUP(1, 2); break;
                    case 2: COL_GROUP(2, 2); break;
                    case 3: COL_GROUP(3, 2); break;
                    default: COL_GROUP(4, 2); break;
                    }
                else switch (bb) {
                    case 1: COL_GROUP(1, 1); break;
                    case 2: COL_GROUP(2, 1); break;
                    case 3: COL_GROUP(3, 1); break;
                    default: COL_GROUP(4, 1); break;
                    }
            }
#undef COL_GROUP
            row += 32 * CH;
        }
        if (KIND != KIND_PLAIN && j == (unsigned)PER_SB - 1)
            for (int row = row0; row < row1; row += 32) col_superblock16(m, (unsigned)(g / PER_SB), row, (size_t)(row - row0), B, ybuf, &cs, KIND);
    }
}
#endif

#if QM_ZMM
/* qm_prepare's thresholded case for the column layout (the columns some row keeps listed, each
 * group's slots padded to a multiple of 4) on 512-bit registers: the same cols, goff, qx, dx,
 * xs and counts as the scalar loop (the same products rounded the same way), for a decode step
 * whose K is large (8,960 inputs of an MLP's down projection took a fifth of its call there). */
int QM_NAME(qm_sparse_prepare)(const float *x, size_t x_stride, int batch, int k, int group, float threshold,
                               int32_t *cols, int32_t *goff, int8_t *qx, size_t qx_stride, float *dx, size_t dx_stride,
                               float *xs, int32_t *row_counts, int *n_slots) {
    const int nq = k / QM_QBLOCK, n_groups = k / group, pieces = group / 16;
    const __m512 t = _mm512_set1_ps(threshold);
    const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int b = 0; b < batch; b++) { /* each block's scale over the values its row keeps */
        const float *xb = x + (size_t)b * x_stride;
        int32_t cnt = 0;
        for (int q = 0; q < nq; q++) {
            const __m512 a0 = _mm512_abs_ps(_mm512_loadu_ps(xb + 32 * q)), a1 = _mm512_abs_ps(_mm512_loadu_ps(xb + 32 * q + 16));
            const __mmask16 k0 = _mm512_cmp_ps_mask(a0, t, _CMP_GT_OQ), k1 = _mm512_cmp_ps_mask(a1, t, _CMP_GT_OQ);
            cnt += __builtin_popcount(k0) + __builtin_popcount(k1);
            const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_maskz_mov_ps(k0, a0), _mm512_maskz_mov_ps(k1, a1)));
            dx[(size_t)b * dx_stride + q] = amax / 127.0f;
        }
        if (row_counts) row_counts[b] = cnt;
    }
    int n = 0, kept = 0;
    for (int g = 0; g < n_groups; g++) {
        goff[g] = n;
        for (int h = 0; h < pieces; h++) { /* 16 inputs at a time */
            const int j0 = g * group + 16 * h;
            __mmask16 keep[SI4_MAX_BATCH], any = 0;
            __m512 v[SI4_MAX_BATCH];
            for (int b = 0; b < batch; b++) {
                v[b] = _mm512_loadu_ps(x + (size_t)b * x_stride + j0);
                keep[b] = _mm512_cmp_ps_mask(_mm512_abs_ps(v[b]), t, _CMP_GT_OQ);
                any |= keep[b];
            }
            const int c = __builtin_popcount(any);
            _mm512_mask_compressstoreu_epi32(cols + n, any, _mm512_add_epi32(iota, _mm512_set1_epi32(j0)));
            for (int b = 0; b < batch; b++) {
                const float d = dx[(size_t)b * dx_stride + j0 / QM_QBLOCK], id = d > 0.0f ? 1.0f / d : 0.0f;
                const __m512i qv = _mm512_maskz_cvtps_epi32(keep[b], _mm512_mul_ps(v[b], _mm512_set1_ps(id)));
                _mm_mask_storeu_epi8(qx + (size_t)b * qx_stride + n, (__mmask16)((1u << c) - 1),
                                     _mm512_cvtepi32_epi8(_mm512_maskz_compress_epi32(any, qv)));
                const int32_t part = _mm512_reduce_add_epi32(qv);
                /* xs: the group's sum, made in int32 and scaled once (below) */
                if (h == 0) xs[(size_t)g * batch + b] = (float)part;
                else xs[(size_t)g * batch + b] = (float)((int32_t)xs[(size_t)g * batch + b] + part);
            }
            n += c;
        }
        for (int b = 0; b < batch; b++)
            xs[(size_t)g * batch + b] *= dx[(size_t)b * dx_stride + g * group / QM_QBLOCK];
        kept += n - goff[g];
        n = qm_pad_slots(cols, qx, qx_stride, batch, goff[g], n);
    }
    goff[n_groups] = n;
    *n_slots = n;
    return kept;
}
#endif

#ifdef QM_AMX
/* Prefill with AMX (Sapphire Rapids and later; qmat_amx.c): per group and half-chunk, the codes
 * of its quads, unpacked as the VNNI kernel unpacks them, are one B tile (a row per quad: 16
 * rows of W x 4 codes, the layout the tile multiply wants), 16 rows of x one A tile (their qx,
 * straight from memory), and one tdpbsud (tdpbssd for Q8_0's signed codes) makes the 16 x 16
 * int32 group sums the VNNI kernel makes in 64 vpdpbusd. The sums are the same integers, and
 * group_update applies the same float operations to them: every row's floats are the VNNI
 * kernel's. Rows of x beyond a multiple of 16 take the VNNI passes. */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_config;

/* Tiles for groups of `group` inputs: 0, 3, 4, 5 C (16 x 16 int32 sums, one per block of 16
 * rows of x: prefill calls have at most QM_MAX_BATCH = 64 rows), 1 and 6 A (16 rows of x by
 * the group's inputs, int8), 2 B (the group's quads by 16 rows of W, 4 codes each). */
#define AMX_BLOCKS 4
static inline void amx_configure(unsigned group) {
    amx_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) c.rows[t] = 16, c.colsb[t] = 64;
    c.colsb[1] = c.colsb[6] = (uint16_t)group;
    c.rows[2] = (uint8_t)(group / 4);
    _tile_loadconfig(&c);
}


/* C tile c (0 .. 3: tiles 0, 3, 4, 5) = the 16 rows of x at `x` (through A tile 1 or 6, by
 * parity) times B (tile 2); the tile numbers are immediates, hence the switches. */
#define AMX_BLOCK(c, x, qs, BITS)                                                                   \
    do {                                                                                          \
        switch (c) {                                                                              \
        case 0: AMX_MUL(0, 1, x, qs, BITS); break;                                                \
        case 1: AMX_MUL(3, 6, x, qs, BITS); break;                                                \
        case 2: AMX_MUL(4, 1, x, qs, BITS); break;                                                \
        default: AMX_MUL(5, 6, x, qs, BITS); break;                                               \
        }                                                                                         \
    } while (0)
#define AMX_MUL(C, A, x, qs, BITS)                                                                  \
    do {                                                                                          \
        _tile_zero(C);                                                                            \
        _tile_loadd(A, (x), (long)(qs));                                                          \
        if ((BITS) == 8) _tile_dpbssd(C, A, 2);                                                   \
        else _tile_dpbsud(C, A, 2);                                                               \
    } while (0)
#define AMX_STORE(c, ct)                                                                            \
    do {                                                                                          \
        switch (c) {                                                                              \
        case 0: _tile_stored(0, (ct), 64); break;                                                 \
        case 1: _tile_stored(3, (ct), 64); break;                                                 \
        case 2: _tile_stored(4, (ct), 64); break;                                                 \
        default: _tile_stored(5, (ct), 64); break;                                                \
        }                                                                                         \
    } while (0)
#endif

/* Half h (rows n .. n + 15) of the chunk at `chunk` over all of K, for rows [b0, b0 + BB) of x
 * (BB <= NB_MAX: their sums in registers), or with `s` for every row of x (groups outer, the
 * rows' sums in s, each group's factors computed once for all of them); y written to ybuf.
 * Interleaved x: row b's qx of group g at qx + b * qs + GROUP g (every column has its slot). */
AI void half_pass(const qm_matrix *m, const qm_acts *a, const uint8_t *chunk, int n, const int h, int b0, const int BB,
                  acc8 (*big)[2], void *tiled, float *ybuf, const int BITS, const int KIND, const int IL, int pf) {
    const unsigned GROUP = BITS == 6 ? 16 : 32, PER_SB = KIND == KIND_PLAIN ? 1 : 256 / GROUP;
    const unsigned G = (unsigned)m->k / GROUP, B = (unsigned)a->batch, NR = big ? B : (unsigned)BB;
    const size_t tile_bytes = (size_t)GROUP / 4 * (16 * BITS), qs = a->qx_stride;
    const chunk_fac cf = chunk_factors(m, n);
    acc8 reg[NB_MAX][2], (*s)[2] = big ? big : reg;
    uint8_t unpacked[8 * 64] __attribute__((aligned(32))); /* a group's quads of this half (unpack_group) */
    /* prefill: each row's fm made at the super-block's end from the groups' mins (Q6_K: scales)
     * kept aside, not loaded and stored in every group's passes: on two Zen 5 threads AVX2's Q6_K
     * 1.11-1.14x at 8-64 rows, Q4_K 0.99-1.05x, AVX-VNNI's Q4_K 1.02-1.04x; AVX-VNNI's Q6_K
     * (its sums weighted by vpmulld) ran 0.86-0.90x and keeps the update in the passes */
    const int FM_LATER = big && !(QM_VNNI && KIND == KIND_Q6);
    __m256 mn[2][16];
    unsigned R = 0; /* rows of x whose sums the tile multiply makes: whole blocks of 16, in prefill */
#ifdef QM_AMX
    acc16 *st = tiled;
    uint8_t bts[2][8 * 64] __attribute__((aligned(64))); /* B of this group and the next */
    int32_t ct[16 * 16] __attribute__((aligned(64)));   /* a C tile's sums */
    if (big && st) R = (B < 16 * AMX_BLOCKS ? B : 16 * AMX_BLOCKS) / 16 * 16;
    zero_sums16(st, R);
#else
    (void)tiled;
#endif
    for (unsigned b = R; b < NR; b++)
        for (int t = 0; t < 2; t++) {
            s[b][t].y = s[b][t].fs = s[b][t].fm = _mm256_setzero_ps();
            s[b][t].blk = _mm256_setzero_si256();
        }
    for (unsigned sb = 0; sb < G / PER_SB; sb++) {
        for (unsigned j = 0; j < PER_SB; j++) {
            const unsigned g = sb * PER_SB + j, qb = g * GROUP / QM_QBLOCK;
            const quad_src p = group_quads(m, chunk, n - 16 * h, g, tile_bytes, pf, IL);
            fac8 f[2];
            for (int t = 0; t < 2; t++) group_factors(m, &cf, g, t, KIND, &f[t]);
            if (FM_LATER && KIND != KIND_PLAIN) mn[0][j] = f[0].mnf, mn[1][j] = f[1].mnf;
            const int8_t *qx = a->qx + (size_t)g * GROUP;
#ifdef QM_AMX
            if (R) {
                /* this group's tile multiplies first, then the next group's codes unpacked while
                 * they run, then this group's float updates from their sums */
                uint8_t *bt = bts[g % 2];
                if (g == 0) unpack_group(&p, h, BITS, IL, bt);
                _tile_loadd(2, bt, 64);
                for (unsigned c = 0; c < R / 16; c++) AMX_BLOCK(c, qx + (size_t)(16 * c) * qs, qs, BITS);
                if (g + 1 < G) {
                    const quad_src next = group_quads(m, chunk, n - 16 * h, g + 1, tile_bytes, 0, IL);
                    unpack_group(&next, h, BITS, IL, bts[(g + 1) % 2]);
                }
                const fac16 F = join_factors(f, KIND);
                for (unsigned c = 0; c < R / 16; c++) {
                    AMX_STORE(c, ct);
                    for (unsigned b = 0; b < 16; b++) {
                        const unsigned r = 16 * c + b;
                        group_update16(&st[r], &F, _mm512_load_si512(ct + 16 * b), a->dx[(size_t)r * a->dx_stride + qb],
                                       a->xs[(size_t)g * B + r], KIND, j % 2 == 0);
                    }
                }
            }
#endif
#define PASS_ROWS(SRC, IL_, BB_, C0, R0)                                                                       \
    do {                                                                                                        \
        __m256i acc[NB_MAX][2];                                                                                 \
        if (BB_ >= 2) group_sums_rows_il(SRC, qx + (size_t)(C0) * qs, qs, h, BB_, BITS, KIND, IL_, f, acc);     \
        else group_sums_il(SRC, qx + (size_t)(C0) * qs, qs, h, BB_, BITS, KIND, IL_, f, acc);                   \
        rows_update(s + (R0), f, acc, a->dx + (size_t)(C0) * a->dx_stride + qb, a->dx_stride,                   \
                    a->xs + (size_t)g * B + (C0), BB_, KIND, j % 2 == 0, !FM_LATER);                            \
    } while (0)
            /* a decode step: one pass, written without prefill's loop (around it GCC unpacked
             * the group's codes ahead, kept them on the stack and loaded them back) */
            if (!big) {
                PASS_ROWS(&p, IL, BB, (unsigned)b0, 0);
                continue;
            }
            /* prefill: the group's codes unpacked once for all passes of NB_MAX rows */
            const quad_src u = {unpacked, NULL, 0};
            if (B - R > NB_MAX) unpack_group(&p, h, BITS, IL, unpacked);
            for (unsigned c0 = R; c0 < B; c0 += NB_MAX) {
                const unsigned rows = B - c0 < NB_MAX ? B - c0 : NB_MAX;
                if (B - R <= NB_MAX) switch (rows) { /* one pass: the codes as they are */
                    case 1: PASS_ROWS(&p, IL, 1, c0, c0); break;
                    case 2: PASS_ROWS(&p, IL, 2, c0, c0); break;
                    case 3: PASS_ROWS(&p, IL, 3, c0, c0); break;
                    default: PASS_ROWS(&p, IL, 4, c0, c0); break;
                    }
                else switch (rows) {
                    case 1: PASS_ROWS(&u, 2, 1, c0, c0); break;
                    case 2: PASS_ROWS(&u, 2, 2, c0, c0); break;
                    case 3: PASS_ROWS(&u, 2, 3, c0, c0); break;
                    default: PASS_ROWS(&u, 2, 4, c0, c0); break;
                    }
            }
#undef PASS_ROWS
        }
#ifdef QM_AMX
        if (KIND != KIND_PLAIN) superblocks_update16(st, R, &cf, sb, KIND);
#endif
        if (KIND != KIND_PLAIN)
            for (int t = 0; t < 2; t++) {
                __m256 d, dmin;
                superblock_scales(&cf, sb, t, KIND, &d, &dmin);
                const float *xs = a->xs + (size_t)sb * PER_SB * B;
                for (unsigned b = R; b < NR; b++) {
                    if (FM_LATER) s[b][t].fm = superblock_fm(mn[t], xs + b, B, PER_SB);
                    superblock_update(&s[b][t], d, dmin, KIND);
                }
            }
    }
#ifdef QM_AMX
    for (unsigned r = 0; r < R; r++) _mm512_storeu_ps(ybuf + (size_t)r * m->npad + n, st[r].y);
#endif
    for (unsigned b = R; b < NR; b++)
        for (int t = 0; t < 2; t++)
            _mm256_storeu_ps(ybuf + (size_t)((big ? 0 : b0) + b) * m->npad + n + 8 * t, s[b][t].y);
}

#if !QM_ZMM
/* A decode step of one row of x over a whole chunk, both halves at once (AVX2, AVX-VNNI): each group's
 * factors made once for all 32 rows and its tile's lines read from memory once, where two half
 * passes each streamed the chunk's run and made their own loop, factors and updates. The 4- and
 * 5-bit types take each half's sums from group_sums_rows_il's asm runs: in C, GCC reassociated a
 * run's adds into a tree and kept all 32 products of a group on the stack (callgrind: Q5_0 12%
 * fewer instructions a weight in asm, Q4_1 4%). The 6- and 8-bit quads stay in C, both halves
 * unpacked from one load (Q6_K's halves share bytes 0..63: 15% more instructions as two halves).
 * The same int32 sums and, per 8 rows, the same float operations in the same order as half_pass,
 * so the same floats. AVX-VNNI takes the C loops (vpdpbusd, no int16 stage): against its two half
 * passes 1.08-1.36x at one row on two Zen 5 threads (Q4_K 1.13x, Q6_K 1.19x, Q8_0 1.36x). */
AI void chunk_pass1(const qm_matrix *m, const qm_acts *a, const uint8_t *chunk, int n, float *ybuf, const int BITS,
                    const int KIND, int pf) {
    const unsigned GROUP = BITS == 6 ? 16 : 32, PER_SB = KIND == KIND_PLAIN ? 1 : 256 / GROUP;
    const unsigned G = (unsigned)m->k / GROUP, NQ = GROUP / 4;
    const unsigned RUN = QUADS_PER_RUN(BITS) < (int)NQ ? (unsigned)QUADS_PER_RUN(BITS) : NQ;
    const size_t tile_bytes = (size_t)NQ * (16 * BITS);
    const chunk_fac cf = chunk_factors(m, n);
    const float *dx = a->dx;
    acc8 s[4];
    for (int v = 0; v < 4; v++) {
        s[v].y = s[v].fs = s[v].fm = _mm256_setzero_ps();
        s[v].blk = _mm256_setzero_si256();
    }
    for (unsigned sb = 0; sb < G / PER_SB; sb++) {
        for (unsigned j = 0; j < PER_SB; j++) {
            const unsigned g = sb * PER_SB + j;
            const quad_src src = {group_tile(chunk, g, tile_bytes, pf), NULL, 0};
            const int8_t *xg = a->qx + (size_t)g * GROUP;
            fac8 f[4];
            for (int v = 0; v < 4; v++) group_factors(m, &cf, g, v, KIND, &f[v]);
            __m256i acc[4];
            if (BITS == 4 || BITS == 5) {
                __m256i h0[NB_MAX][2], h1[NB_MAX][2];
                group_sums_rows_il(&src, xg, 0, 0, 1, BITS, KIND, 1, f, h0);
                group_sums_rows_il(&src, xg, 0, 1, 1, BITS, KIND, 1, f + 2, h1);
                acc[0] = h0[0][0], acc[1] = h0[0][1], acc[2] = h1[0][0], acc[3] = h1[0][1];
            } else {
                for (int v = 0; v < 4; v++) acc[v] = _mm256_setzero_si256();
                for (unsigned i0 = 0; i0 < NQ; i0 += RUN) {
                    __m256i s16[4];
                    for (int v = 0; v < 4; v++) s16[v] = _mm256_setzero_si256();
                    for (unsigned i = i0; i < i0 + RUN; i++) {
                        __m256i W[4];
                        load_quad_il(src.tile + (size_t)i * (16 * BITS), BITS, W);
                        int32_t q4;
                        memcpy(&q4, xg + 4 * i, 4);
                        mac_quad(W, 4, _mm256_set1_epi32(q4), BITS, s16);
                    }
                    for (int v = 0; v < 4; v++)
                        acc[v] = _mm256_add_epi32(acc[v], widen(s16[v], f[v].wt, INT_SCALED(KIND)));
                }
            }
            const __m256 dxv = _mm256_broadcast_ss(dx + g * GROUP / QM_QBLOCK), xsv = _mm256_broadcast_ss(a->xs + g);
            for (int v = 0; v < 4; v++) group_update_v(&s[v], &f[v], acc[v], dxv, xsv, KIND, j % 2 == 0);
        }
        if (KIND != KIND_PLAIN)
            for (int v = 0; v < 4; v++) {
                __m256 d, dmin;
                superblock_scales(&cf, sb, v, KIND, &d, &dmin);
                superblock_update(&s[v], d, dmin, KIND);
            }
    }
    for (int v = 0; v < 4; v++) _mm256_storeu_ps(ybuf + n + 8 * v, s[v].y);
}
#endif

#if QM_ZMM
#define DECODE_PASS(H, b0, BB, pf) half_pass16(m, a, chunk, row + 16 * (H), H, b0, BB, ybuf, BITS, KIND, pf)
#else
#define DECODE_PASS(H, b0, BB, pf) half_pass(m, a, chunk, row + 16 * (H), H, b0, BB, NULL, NULL, ybuf, BITS, KIND, 1, pf)
#endif

/* The 256-bit passes (AVX2, AVX-VNNI) prefetch their codes AHEAD_256 times as far ahead as
 * si4_prefetch_ahead says (6 KB of 4-bit codes, 12 groups' tiles). On two Zen 5 threads held to
 * AVX2, a layer of the 1.5B's shapes, Q4_K against 1x: 1.06x at one row, 1.17x / 1.27x / 1.32x
 * at 2 / 3 / 4 rows (one thread: 1.30x / 1.30x / 1.40x at 1 / 2 / 4 rows); 4x and 16x are
 * within a few percent of 8x, and from 16 rows on nothing changes (a group's tile serves so many
 * rows that the stream moves slowly enough for the hardware's own prefetcher). */
enum { AHEAD_256 = 8 };

/* Rows [row0, row1) of W over all of its groups (calls are split by rows: g0 = 0, g1 = K / group).
 * IL 0: the column layout, prefill only (more than SI4_MAX_BATCH rows of x, every column in its
 * slot), its quads from the columns' runs: the same sums, the same floats. */
AI void kernel_il(const qm_matrix *m, const qm_acts *a, int row0, int row1, float *ybuf, const int BITS, const int KIND,
                  const int IL) {
    const int B = a->batch;
    const int pf0 = IL ? si4_prefetch_ahead * BITS / 4 * 4 * (QM_ZMM ? 1 : AHEAD_256) : 0;
    /* prefill, and on 256-bit registers any call of more than one pass: every row's sums in
     * memory, groups outer, each group's codes unpacked once for all passes (a decode pass
     * holds its rows' sums in registers over all of K, and 5-8 rows took two such passes,
     * each unpacking every code again). On 512-bit registers the interleaved layout takes
     * chunk_big16 at every row count (on Zen 5 1.06-1.26x the decode pass at one row,
     * 1.05-1.49x at 2-8), except Q8_0 up to 2 rows: there the decode pass, whose rows' sums
     * stay in registers, streams its bytes faster (two Zen 5 threads, chunk_big16 against it:
     * 0.85x at one row, 0.98x at 2, 1.10x at 4, 1.28x at 8) */
    const int big_from = !QM_ZMM ? NB_MAX : IL != 1 ? SI4_MAX_BATCH : BITS == 8 ? 2 : 0;
    /* the rows' sums: of a half-chunk (acc16 each), of a chunk for chunk_big16; a decode step's
     * on the stack, since every one-row call on 512-bit registers takes this path */
    _Alignas(64) acc8 local[2 * SI4_MAX_BATCH][2];
    const size_t n_big = (size_t)B * (QM_ZMM ? 2 : 1);
    acc8 (*big)[2] = NULL;
    if (B > big_from && !(big = n_big <= 2 * SI4_MAX_BATCH ? local : aligned_alloc(64, sizeof(acc8) * 2 * n_big))) return;
    void *tiled = NULL; /* prefill's rows by AMX: their sums (acc16) */
#ifdef QM_AMX
    if (big && B >= 16 && (tiled = aligned_alloc(64, sizeof(acc16) * (size_t)B))) amx_configure(BITS == 6 ? 16 : 32);
#endif
#if !QM_ZMM
    const int ONE_PASS = IL == 1 && B == 1; /* chunk_pass1 */
#endif
#if QM_ZMM
    const int BIG16 = IL == 1 && big && !tiled; /* chunk_big16 */
#else
    const int BIG16 = 0;
#define chunk_big16(...) ((void)0) /* 512-bit registers only */
#endif
    for (int row = row0; row < row1; row += 32) {
        const uint8_t *chunk = qm_tile(m, row / 32, 0);
#if !QM_ZMM
        if (ONE_PASS) {
            chunk_pass1(m, a, chunk, row, ybuf, BITS, KIND, pf0);
            continue;
        }
#endif
        if (BIG16) {
            chunk_big16(m, a, chunk, row, (acc16 *)big, ybuf, BITS, KIND, BIG_AHEAD * pf0);
            continue;
        }
#define HALF(H)                                                                                                 \
    do {                                                                                                        \
        const int n = row + 16 * (H), pf = (H) == 0 ? pf0 : 0; /* each line once, ahead of the stream */        \
        if (big) {                                                                                              \
            half_pass(m, a, chunk, n, H, 0, 0, big, tiled, ybuf, BITS, KIND, IL, pf);                           \
            break;                                                                                              \
        }                                                                                                       \
        for (int b0 = 0; IL && b0 < B; b0 += NB_MAX) /* a decode step: passes of rows in registers */          \
            switch (B - b0 < NB_MAX ? B - b0 : NB_MAX) {                                                        \
            case 1: DECODE_PASS(H, b0, 1, b0 ? 0 : pf); break;                                                  \
            case 2: DECODE_PASS(H, b0, 2, b0 ? 0 : pf); break;                                                  \
            case 3: DECODE_PASS(H, b0, 3, b0 ? 0 : pf); break;                                                  \
            default: DECODE_PASS(H, b0, 4, b0 ? 0 : pf); break;                                                 \
            }                                                                                                   \
    } while (0)
        HALF(0);
        HALF(1);
#undef HALF
    }
#ifdef QM_AMX
    if (tiled) _tile_release();
#endif
    free(tiled);
    if (big != local) free(big);
}

/* kernel_il with the matrix's factor kind as a compile-time constant. */
AI void kernel_il_kinds(const qm_matrix *m, const qm_acts *a, int row0, int row1, float *ybuf, const int BITS,
                        const int IL) {
    if ((BITS == 4 || BITS == 5) && m->mn) kernel_il(m, a, row0, row1, ybuf, BITS, KIND_KQ, IL);
    else if (BITS == 6) kernel_il(m, a, row0, row1, ybuf, BITS, KIND_Q6, IL);
    else kernel_il(m, a, row0, row1, ybuf, BITS, KIND_PLAIN, IL);
}

AI void kernel(const qm_matrix *m, const qm_acts *a, int row0, int row1, int g0, int g1, float *ybuf, const int BITS,
              const int IL) {
    const int B = a->batch, cb = 4 * BITS;
    if (IL) { /* split by rows only (module.c) */
        kernel_il_kinds(m, a, row0, row1, ybuf, BITS, 1);
        return;
    }
#ifdef QM_AMX
    if (B > SI4_MAX_BATCH) { /* prefill of a sparse file: every column has its slot, split by rows */
        kernel_il_kinds(m, a, row0, row1, ybuf, BITS, 0);
        return;
    }
#endif
    if (B > SI4_MAX_BATCH) {
        wide(m, a, row0, row1, g0, g1, ybuf, BITS);
        return;
    }
#if QM_ZMM
    if ((BITS == 4 || BITS == 5) && m->mn) kernel_col16(m, a, row0, row1, g0, g1, ybuf, BITS, KIND_KQ);
    else if (BITS == 6) kernel_col16(m, a, row0, row1, g0, g1, ybuf, BITS, KIND_Q6);
    else kernel_col16(m, a, row0, row1, g0, g1, ybuf, BITS, KIND_PLAIN);
    return;
#endif
    for (int b = 0; b < B; b++) memset(ybuf + (size_t)b * m->npad + row0, 0, sizeof(float) * (size_t)(row1 - row0));
    for (int g = g0; g < g1; g++) {
        if (a->goff[g] == a->goff[g + 1]) continue; /* nothing kept: nothing read */
        for (int row = row0; row < row1; row += 32) {
            /* prefetch once per cache line of each column's run, on the first pass */
            const int line = (int)(((size_t)(row / 32) * cb) % 64) < cb;
            for (int b0 = 0; b0 < B; b0 += PASS) {
                if (B - b0 >= 2) pass(m, a, g, row, b0, 2, BITS, line && !b0, ybuf);
                else pass(m, a, g, row, b0, 1, BITS, line && !b0, ybuf);
            }
        }
    }
}

/* CALL(BITS, IL) with m's bit width and layout as compile-time constants. */
#define BY_FORMAT(m, CALL)                                                                    \
    switch ((m)->bits * 2 + !!(m)->interleaved) {                                             \
    case 8: CALL(4, 0); break;                                                                \
    case 9: CALL(4, 1); break;                                                                \
    case 10: CALL(5, 0); break;                                                               \
    case 11: CALL(5, 1); break;                                                               \
    case 12: CALL(6, 0); break;                                                               \
    case 13: CALL(6, 1); break;                                                               \
    case 16: CALL(8, 0); break;                                                               \
    default: CALL(8, 1); break;                                                               \
    }

void QM_NAME(qm_kernel)(const qm_matrix *m, const qm_acts *a, int row0, int row1, int g0, int g1, float *ybuf) {
#define KERNEL(BITS, IL) kernel(m, a, row0, row1, g0, g1, ybuf, BITS, IL)
    BY_FORMAT(m, KERNEL)
#undef KERNEL
}

#ifdef QM_AMX
/* Group g's codes of rows [n, n + 16) of W (n a multiple of 16), as prefill's B tile holds them
 * (unpack_group): group / 4 rows of 64 bytes, row i holding inputs 4i .. 4i + 3 of each of the
 * 16 rows (Q8_0's signed). qmat_tiles.c makes its bfloat16 tiles from them. */
void qm_group_codes_amx(const qm_matrix *m, int n, int g, uint8_t *out) {
    const uint8_t *chunk = qm_tile(m, n / 32, 0);
    const size_t tile_bytes = (size_t)(m->bits == 6 ? 16 : 32) / 4 * (size_t)(16 * m->bits);
#define CODES(BITS, IL)                                                                                  \
    do {                                                                                                 \
        const quad_src p = group_quads(m, chunk, n & ~31, (unsigned)g, tile_bytes, 0, IL);               \
        if (n & 16) unpack_group(&p, 1, BITS, IL, out);                                                  \
        else unpack_group(&p, 0, BITS, IL, out);                                                         \
    } while (0)
    BY_FORMAT(m, CODES)
#undef CODES
}
#endif

#if !QM_VNNI /* the VNNI variants share these with AVX2 (no dot products in them) */
/* Columns [j0, j1), rows [row0, row1) of W as float32, transposed (qmat.h), a quad of columns
 * and 32 rows at a time through the kernels' own code loads. */
AI void dequant(const qm_matrix *m, int j0, int j1, int row0, int row1, float *out, size_t out_stride, const int BITS,
                const int IL) {
    const int cb = 4 * BITS;
    for (int j = j0 & ~3; j < j1; j += 4) {
        const int g = j / m->group;
        for (int row = row0; row < row1; row += 32) {
            __m256i W[4];
            if (IL) {
                load_quad_il(qm_tile(m, row / 32, g) + (size_t)(j % m->group) / 4 * (4 * cb), BITS, W);
            } else {
                const uint8_t *p[4];
                for (int t = 0; t < 4; t++) p[t] = m->codes + (size_t)(j + t) * m->colstride + (size_t)(row / 32) * cb;
                load_quad(p, BITS, W);
            }
            for (int v = 0; v < 4; v++) {
                __m256 D, M;
                factors8(m, g, row + 8 * v, &D, &M);
                for (int t = 0; t < 4; t++) {
                    if (j + t < j0 || j + t >= j1) continue;
                    const __m256i q = BITS == 8 ? _mm256_srai_epi32(_mm256_slli_epi32(W[v], 24 - 8 * t), 24)
                                                : _mm256_and_si256(_mm256_srli_epi32(W[v], 8 * t), _mm256_set1_epi32(255));
                    float *o = out + (size_t)(j + t - j0) * out_stride + (row - row0) + 8 * v;
                    _mm256_storeu_ps(o, _mm256_fmadd_ps(D, _mm256_cvtepi32_ps(q), M));
                }
            }
        }
    }
}

void qm_dequant_avx2(const qm_matrix *m, int j0, int j1, int row0, int row1, float *out, size_t out_stride) {
#define DEQUANT(BITS, IL) dequant(m, j0, j1, row0, row1, out, out_stride, BITS, IL)
    BY_FORMAT(m, DEQUANT)
#undef DEQUANT
}

/* qm_dense_prepare (qmat_scalar.c) eight inputs at a time, and with ZEROING its all-columns
 * case with a threshold (the values at or below it zeroed, each row's count kept, the columns
 * some row keeps marked in `any`, a bit per input of each block): the same float operations as
 * the scalar loops (vcvtps2dq rounds to nearest even, as lrintf), so every ISA gives the same
 * qx, dx and xs. */
AI void prepare_rows_avx2(const float *x, size_t x_stride, int batch, int k, int group, float threshold, int8_t *qx,
                          size_t qx_stride, float *dx, size_t dx_stride, float *xs, int32_t *row_counts,
                          uint32_t *any, const int ZEROING) {
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff)), t = _mm256_set1_ps(threshold);
    for (int b = 0; b < batch; b++) {
        const float *xb = x + (size_t)b * x_stride;
        int8_t *qb = qx + (size_t)b * qx_stride;
        int32_t cnt = 0;
        for (int q = 0; q < k / QM_QBLOCK; q++) {
            const float *p = xb + q * QM_QBLOCK;
            __m256 v[4], mx = _mm256_setzero_ps();
            uint32_t bits = 0;
            for (int i = 0; i < 4; i++) {
                v[i] = _mm256_loadu_ps(p + 8 * i);
                __m256 a = _mm256_and_ps(v[i], absmask);
                if (ZEROING) {
                    const __m256 keep = _mm256_cmp_ps(a, t, _CMP_GT_OQ);
                    v[i] = _mm256_and_ps(v[i], keep);
                    a = _mm256_and_ps(a, keep);
                    bits |= (uint32_t)_mm256_movemask_ps(keep) << (8 * i);
                }
                mx = _mm256_max_ps(mx, a);
            }
            if (ZEROING) {
                cnt += __builtin_popcount(bits);
                any[q] |= bits;
            }
            __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
            m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
            const float d = _mm_cvtss_f32(m4) / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
            dx[(size_t)b * dx_stride + q] = d;
            const __m256 idv = _mm256_set1_ps(id);
            __m256i r[4];
            for (int i = 0; i < 4; i++) r[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], idv));
            /* int32 -> int8, in order: packs work within 128-bit lanes, a permute restores it */
            const __m256i w01 = _mm256_packs_epi32(r[0], r[1]), w23 = _mm256_packs_epi32(r[2], r[3]);
            const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(w01, w23),
                                                              _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            _mm256_storeu_si256((__m256i *)(qb + q * QM_QBLOCK), bytes);
        }
        if (ZEROING && row_counts) row_counts[b] = cnt;
        for (int g = 0; g < k / group; g++) {
            int32_t isum = 0;
            for (int j = g * group; j < (g + 1) * group; j++) isum += qb[j];
            xs[(size_t)g * batch + b] = (float)isum * dx[(size_t)b * dx_stride + g * group / QM_QBLOCK];
        }
    }
}

void qm_dense_prepare_avx2(const float *x, size_t x_stride, int batch, int k, int group, int8_t *qx,
                           size_t qx_stride, float *dx, size_t dx_stride, float *xs) {
    prepare_rows_avx2(x, x_stride, batch, k, group, 0.0f, qx, qx_stride, dx, dx_stride, xs, NULL, NULL, 0);
}

/* qm_prepare's all-columns case with a threshold (the interleaved layout's thresholded calls,
 * and prefill on either layout; the scalar loop was a fifth of a thresholded prefill's time). */
int qm_zeroing_prepare_avx2(const float *x, size_t x_stride, int batch, int k, int group, float threshold, int8_t *qx,
                            size_t qx_stride, float *dx, size_t dx_stride, float *xs, int32_t *row_counts) {
    const int nq = k / QM_QBLOCK;
    uint32_t local[1024], *any = nq <= 1024 ? local : malloc((size_t)nq * sizeof(uint32_t)); /* K up to 32,768 */
    if (!any) return -1;
    memset(any, 0, (size_t)nq * sizeof(uint32_t));
    prepare_rows_avx2(x, x_stride, batch, k, group, threshold, qx, qx_stride, dx, dx_stride, xs, row_counts, any, 1);
    int kept = 0;
    for (int q = 0; q < nq; q++) kept += __builtin_popcount(any[q]);
    if (any != local) free(any);
    return kept;
}
#endif

#if !QM_VNNI && !QM_ZMM
/* The ceiling of the multi-row path's structure (bench_kernels' pass_peak): its passes alone,
 * as prefill runs them (64 rows of x in passes of four over 16 rows of W, K = 1536), with a
 * group's codes already unpacked in L1: the quads' multiply-adds (group_sums_rows_il) and each
 * group's widening by the sub-block scales and float update of the rows' sums (rows_update), and
 * none of the call's other work (unpacking, factors, super-blocks, threads). `iters` groups of
 * all 64 rows; returns the multiply-adds done. */
long long QM_NAME(qm_pass_peak)(long long iters) {
    enum { ROWS = 64, K = 1536, G = K / 32 };
    int8_t *qx = aligned_alloc(64, (size_t)ROWS * K);
    float *dx = aligned_alloc(64, sizeof(float) * ROWS * G), *xs = aligned_alloc(64, sizeof(float) * ROWS * G);
    acc8 (*s)[2] = aligned_alloc(64, sizeof(acc8) * 2 * ROWS);
    uint8_t codes[8 * 64] __attribute__((aligned(32)));
    if (!qx || !dx || !xs || !s) {
        free(qx), free(dx), free(xs), free(s);
        return -1;
    }
    for (size_t i = 0; i < (size_t)ROWS * K; i++) qx[i] = (int8_t)(i * 7 % 100);
    for (int i = 0; i < ROWS * G; i++) dx[i] = 0.01f, xs[i] = 1.0f;
    for (int i = 0; i < 8 * 64; i++) codes[i] = (uint8_t)(i % 15);
    memset(s, 0, sizeof(acc8) * 2 * ROWS);
    fac8 f[2];
    for (int t = 0; t < 2; t++) {
        f[t].wt = _mm256_set1_epi16(3);
        f[t].D = f[t].M = f[t].wf = _mm256_setzero_ps();
        f[t].mnf = _mm256_set1_ps(1.0f);
    }
    const quad_src u = {codes, NULL, 0};
    long long groups = 0;
    while (groups < iters)
        for (unsigned g = 0; g < G; g++, groups++)
            for (unsigned r0 = 0; r0 < ROWS; r0 += NB_MAX) {
                __m256i acc[NB_MAX][2];
                group_sums_rows_il(&u, qx + (size_t)r0 * K + 32 * g, K, 0, 4, 4, KIND_KQ, 2, f, acc);
                rows_update(s + r0, f, acc, dx + (size_t)r0 * G + g, G, xs + (size_t)g * ROWS + r0, NB_MAX, KIND_KQ, 1, 1);
            }
    volatile float sink = _mm256_cvtss_f32(s[ROWS - 1][1].fs);
    (void)sink;
    free(qx), free(dx), free(xs), free(s);
    return groups * ROWS * 32 * 16;
}
#endif

#if QM_ZMM && !defined(QM_AMX)
/* The ceiling of chunk_big16's structure (bench_kernels' pass_peak on 512-bit registers): its
 * inner loop alone, as prefill runs it (64 rows of x, K = 1536, Q4_K), with a group's codes
 * already unpacked in registers: per row of x its sums (row_sums16: the quads' broadcasts and
 * 16 vpdpbusd) and both halves' float updates (group_update16), and none of the call's other work (unpacking,
 * factors, super-blocks, prefetches, threads). `iters` groups of all 64 rows; returns the
 * multiply-adds done. */
long long QM_NAME(qm_pass_peak)(long long iters) {
    enum { ROWS = 64, K = 1536, G = K / 32 };
    int8_t *qx = aligned_alloc(64, (size_t)ROWS * K);
    float *dx = aligned_alloc(64, sizeof(float) * ROWS * G), *xs = aligned_alloc(64, sizeof(float) * ROWS * G);
    acc16 *s = aligned_alloc(64, sizeof(acc16) * 2 * ROWS);
    if (!qx || !dx || !xs || !s) {
        free(qx), free(dx), free(xs), free(s);
        return -1;
    }
    for (size_t i = 0; i < (size_t)ROWS * K; i++) qx[i] = (int8_t)(i * 7 % 100);
    for (int i = 0; i < ROWS * G; i++) dx[i] = 0.01f, xs[i] = 1.0f;
    zero_sums16(s, 2 * ROWS);
    fac16 F[2];
    for (int t = 0; t < 2; t++) {
        F[t].wt = _mm512_setzero_si512();
        F[t].D = F[t].M = _mm512_setzero_ps();
        F[t].wf = _mm512_set1_ps(3.0f), F[t].mnf = _mm512_set1_ps(1.0f);
    }
    __m512i W0[8], W1[8];
    for (int i = 0; i < 8; i++) W0[i] = _mm512_set1_epi8((char)(i % 15)), W1[i] = _mm512_set1_epi8((char)(i % 13));
    long long groups = 0;
    while (groups < iters)
        for (unsigned g = 0; g < G; g++, groups++) {
            for (int i = 0; i < 8; i++) __asm__ volatile("" : "+v"(W0[i]), "+v"(W1[i])); /* a new tile */
            const __m512i zero = _mm512_setzero_si512();
            for (unsigned b = 0; b < ROWS; b++) {
                __m512i a0, a1;
                row_sums16(qx + (size_t)b * K + 32 * g, W0, W1, 8, 4, zero, zero, &a0, &a1);
                const float d = dx[(size_t)b * G + g], x = xs[(size_t)g * ROWS + b];
                group_update16(&s[b], &F[0], a0, d, x, KIND_KQ, 1);
                group_update16(&s[ROWS + b], &F[1], a1, d, x, KIND_KQ, 1);
            }
        }
    volatile float sink = _mm512_reduce_add_ps(_mm512_add_ps(s[ROWS - 1].fs, s[2 * ROWS - 1].fm));
    (void)sink;
    free(qx), free(dx), free(xs), free(s);
    return groups * ROWS * 32 * 32;
}
#endif

/* bench_kernels.py's peak: the passes' multiply-add instruction sequence alone, with eight
 * independent accumulators in registers (a pass of up to 4 rows of x keeps 8): AVX2 the
 * prefill passes' own asm (group_sums_rows_il: two code vectors, four activations broadcast from
 * L1, vpmaddubsw + vpaddw, 32 multiply-adds each), VNNI vpdpbusd (32, or 64 on 512-bit
 * registers). Returns the multiply-adds done. The empty asm makes x new each round, so nothing
 * is hoisted. (An intrinsic AVX2 version with eight code vectors held 17 vectors live and
 * spilled: it measured 84-95 G MAC/s where the sequence runs at 113-127 on a Zen 3 thread.) */
long long QM_NAME(qm_mac_peak)(long long iters) {
#if QM_ZMM
    __m512i acc[8], w[8], x = _mm512_set1_epi32((int)iters | 0x01010101);
    for (int v = 0; v < 8; v++) acc[v] = _mm512_setzero_si512(), w[v] = _mm512_set1_epi8((char)(v + 1));
    for (long long i = 0; i < iters; i++) {
        __asm__ volatile("" : "+v"(x));
        for (int v = 0; v < 8; v++) acc[v] = _mm512_dpbusd_epi32(acc[v], w[v], x);
    }
    __m512i s = acc[0];
    for (int v = 1; v < 8; v++) s = _mm512_add_epi32(s, acc[v]);
    volatile int sink = _mm512_reduce_add_epi32(s);
    (void)sink;
    return iters * 8 * 64;
#else
    __m256i acc[8], w[8];
    for (int v = 0; v < 8; v++) acc[v] = _mm256_setzero_si256(), w[v] = _mm256_set1_epi8((char)(v + 1));
#if QM_VNNI
    __m256i x = _mm256_set1_epi32((int)iters | 0x01010101);
    for (long long i = 0; i < iters; i++) {
        __asm__ volatile("" : "+x"(x));
        for (int v = 0; v < 8; v++) acc[v] = QM_DPBUSD(acc[v], w[v], x);
    }
#else
    /* named sums, not acc[]: with the array GCC stored all eight to the stack every quad, and
     * the peak read 74-78 G MAC/s on a Zen 3 thread where the sequence runs at 113-127 */
    int32_t xm[4] = {(int32_t)iters | 0x01010101, 0x02020202, 0x03030303, 0x04040404};
    __m256i s00 = acc[0], s01 = s00, s10 = s00, s11 = s00, s20 = s00, s21 = s00, s30 = s00, s31 = s00;
    const __m256i w0 = w[0], w1 = w[1];
    for (long long i = 0; i < iters; i++) {
        __m256i xt, tt;
        __asm__ volatile(QM_QUAD4_ASM("(%[xm])", "4(%[xm])", "8(%[xm])", "12(%[xm])")
                         : [s00] "+x"(s00), [s01] "+x"(s01), [s10] "+x"(s10), [s11] "+x"(s11), [s20] "+x"(s20),
                           [s21] "+x"(s21), [s30] "+x"(s30), [s31] "+x"(s31), [x] "=&x"(xt), [t] "=&x"(tt)
                         : [w0] "x"(w0), [w1] "x"(w1), [xm] "r"(xm)
                         : "memory");
    }
    acc[0] = s00, acc[1] = s01, acc[2] = s10, acc[3] = s11, acc[4] = s20, acc[5] = s21, acc[6] = s30, acc[7] = s31;
#endif
    __m256i s = acc[0];
    for (int v = 1; v < 8; v++) s = _mm256_add_epi32(s, acc[v]);
    volatile int sink = _mm256_extract_epi32(s, 0) + _mm256_extract_epi32(s, 7);
    (void)sink;
    return iters * 8 * 32;
#endif
}
