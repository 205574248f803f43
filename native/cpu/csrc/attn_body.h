/* Decode attention for one (sequence, chunk of its context) unit of DecodeStack
 * (decode_stack.c), and the fp16 and q8_0 KV writes, written once over the vector vocabulary
 * of each isa_*.c (vf, VW, V_ZERO, V_SET1, V_FMA, V_LOAD, V_STORE, V_LOAD_F16, V_LOAD_I8 (VW
 * int8 values as floats), and V_HSUM(v): the sum of v's lanes; S_F16(h) / S_TO_F16(f): one
 * fp16 value to float and back, rounding to nearest even; optionally V_STORE_F16(p, v)),
 * which defines ATTN_NAME, F16_STORE_NAME and Q8_STORE_NAME and includes this file.
 *
 * The cache holds floats, fp16 values or q8_0 rows (u->kv_type): a q8_0 row of a KV head is
 * hd int8 values q and then an fp16 scale d_g per group g of 32 (hd + hd / 16 bytes; engine:
 * kv_quant.py), read as q_e * d_(e / 32).
 * Every query head h of the sequence, over the unit's positions i: s_hi = scale q_h . k_i,
 * p_hi = softmax_i(s_hi), out_h = sum_i p_hi v_i, where k_i, v_i are of KV head h / group
 * (GQA). A position's keys (and values) of all KV heads are one contiguous row of the cache,
 * read once for all heads: a unit that read one KV head's part of each row would leave the
 * hardware prefetcher to fetch the whole rows anyway. Vectors run along the head dimension; a
 * head dimension that is not a multiple of VW takes the scalar loop. A unit that holds a chunk
 * of the context (u->m set) leaves out_h unnormalised, with the chunk's max m_h and
 * denominator l_h = sum_i e^(s_hi - m_h), for decode_stack.c to merge.
 */
#include <math.h>
#include <string.h>

#include "sparse_int4.h"

#define ATTN_INLINE static inline __attribute__((always_inline))

/* q . k over hd floats, k given as float (KV_T float) or fp16 bits (uint16_t) */
#define ATTN_DOT(NAME, KV_T, LOADV, LOAD1)                                       \
    ATTN_INLINE float NAME(const float *q, const KV_T *k, int hd) {              \
        int e = 0;                                                               \
        float sum = 0.0f;                                                        \
        if (hd % VW == 0) {                                                      \
            vf a0 = V_ZERO(), a1 = V_ZERO();                                     \
            for (; e + 2 * VW <= hd; e += 2 * VW) {                              \
                a0 = V_FMA(V_LOAD(q + e), LOADV(k + e), a0);                     \
                a1 = V_FMA(V_LOAD(q + e + VW), LOADV(k + e + VW), a1);           \
            }                                                                    \
            for (; e < hd; e += VW) a0 = V_FMA(V_LOAD(q + e), LOADV(k + e), a0); \
            sum = V_HSUM(a0) + V_HSUM(a1);                                       \
        }                                                                        \
        for (; e < hd; e++) sum += q[e] * LOAD1(k[e]);                           \
        return sum;                                                              \
    }
/* out[e] += p * v[e] */
#define ATTN_AXPY(NAME, KV_T, LOADV, LOAD1)                                                          \
    ATTN_INLINE void NAME(float *out, float p, const KV_T *v, int hd) {                              \
        int e = 0;                                                                                   \
        if (hd % VW == 0) {                                                                          \
            const vf pv = V_SET1(p);                                                                 \
            for (; e < hd; e += VW) V_STORE(out + e, V_FMA(pv, LOADV(v + e), V_LOAD(out + e)));     \
        }                                                                                            \
        for (; e < hd; e++) out[e] += p * LOAD1(v[e]);                                               \
    }
#define ATTN_F32_1(x) (x)
#define ATTN_I8_1(x) ((float)(x))
ATTN_DOT(attn_dot, float, V_LOAD, ATTN_F32_1)
ATTN_DOT(attn_dot_h, uint16_t, V_LOAD_F16, S_F16)
ATTN_DOT(attn_dot_q, int8_t, V_LOAD_I8, ATTN_I8_1)
ATTN_AXPY(attn_axpy, float, V_LOAD, ATTN_F32_1)
ATTN_AXPY(attn_axpy_h, uint16_t, V_LOAD_F16, S_F16)
ATTN_AXPY(attn_axpy_q, int8_t, V_LOAD_I8, ATTN_I8_1)

#define ATTN_Q8_GROUP 32 /* values per q8_0 scale */

/* Bytes of one KV head's part of a cache row (a row holds every KV head's) */
ATTN_INLINE size_t attn_head_bytes(int hd, const int kv) {
    return kv == SI4_KV_Q8 ? (size_t)hd + 2 * (size_t)(hd / ATTN_Q8_GROUP) : (size_t)hd * (kv == SI4_KV_F16 ? 2 : 4);
}
/* The scale of group g of a q8_0 head row */
ATTN_INLINE float attn_q8_scale(const char *head, int hd, int g) {
    uint16_t d;
    memcpy(&d, head + hd + 2 * g, sizeof d);
    return S_F16(d);
}
/* q . k and out += p v for one KV head's part of a row, in the cache's type */
ATTN_INLINE float attn_dot_any(const float *q, const char *head, int hd, const int kv) {
    if (kv == SI4_KV_Q8) {
        float sum = 0.0f;
        for (int g = 0; g < hd / ATTN_Q8_GROUP; g++)
            sum += attn_q8_scale(head, hd, g) *
                   attn_dot_q(q + g * ATTN_Q8_GROUP, (const int8_t *)head + g * ATTN_Q8_GROUP, ATTN_Q8_GROUP);
        return sum;
    }
    return kv == SI4_KV_F16 ? attn_dot_h(q, (const uint16_t *)head, hd) : attn_dot(q, (const float *)head, hd);
}
ATTN_INLINE void attn_axpy_any(float *out, float p, const char *head, int hd, const int kv) {
    if (kv == SI4_KV_Q8)
        for (int g = 0; g < hd / ATTN_Q8_GROUP; g++)
            attn_axpy_q(out + g * ATTN_Q8_GROUP, p * attn_q8_scale(head, hd, g),
                        (const int8_t *)head + g * ATTN_Q8_GROUP, ATTN_Q8_GROUP);
    else if (kv == SI4_KV_F16)
        attn_axpy_h(out, p, (const uint16_t *)head, hd);
    else
        attn_axpy(out, p, (const float *)head, hd);
}

/* The largest of n scores */
ATTN_INLINE float attn_max(const float *sc, int n) {
    float mx = -INFINITY;
    int i = 0;
    if (n >= VW) {
        vf m = V_LOAD(sc);
        for (i = VW; i + VW <= n; i += VW) m = V_MAX(m, V_LOAD(sc + i));
        mx = V_HMAX(m);
    }
    for (; i < n; i++) mx = fmaxf(mx, sc[i]);
    return mx;
}

/* sc[i] <- e^(sc[i] - mx) for n scores; returns their sum. Vectors where the ISA has an
 * exponential (vexp.h; the last partial vector padded with mx), expf on the scalar path. */
ATTN_INLINE float attn_exp(float *sc, int n, float mx) {
#ifdef V_EXP_NEG
    const vf m = V_SET1(mx);
    vf sum = V_ZERO();
    int i = 0;
    for (; i + VW <= n; i += VW) {
        const vf e = V_EXP_NEG(V_SUB(V_LOAD(sc + i), m));
        V_STORE(sc + i, e);
        sum = V_ADD(sum, e);
    }
    float total = V_HSUM(sum);
    if (i < n) {
        float t[VW];
        for (int j = 0; j < VW; j++) t[j] = i + j < n ? sc[i + j] : mx;
        V_STORE(t, V_EXP_NEG(V_SUB(V_LOAD(t), m)));
        for (int j = 0; i + j < n; j++) total += (sc[i + j] = t[j]);
    }
    return total;
#else
    float total = 0.0f;
    for (int i = 0; i < n; i++) total += (sc[i] = expf(sc[i] - mx));
    return total;
#endif
}

/* scores[h] <- e^(scores[h] - max) for each of the nh heads; inv[h]: the factor that
 * normalises them (1 for a chunk, whose max and sum go to u->m, u->l for the merge). */
ATTN_INLINE void attn_softmax(const si4_attn_unit *u, int nh, float *inv) {
    const int n = u->n_ctx;
    for (int h = 0; h < nh; h++) {
        float *sc = u->scores + (size_t)h * n;
        const float mx = attn_max(sc, n), sum = attn_exp(sc, n, mx);
        if (u->m) {
            u->m[h] = mx, u->l[h] = sum;
            inv[h] = 1.0f;
        } else {
            inv[h] = 1.0f / sum;
        }
    }
}

/* The unit, for a cache of type kv (SI4_KV_*): a constant, so each is its own loop. Any head
 * dimension, one query head at a time (see attend_vec for the common case). */
ATTN_INLINE void attend_any(const si4_attn_unit *u, const int kv) {
    const int group = u->group, hd = u->hd, n = u->n_ctx, nh = u->n_kv * group;
    const size_t head_bytes = attn_head_bytes(hd, kv), row_bytes = head_bytes * u->n_kv;
    float inv[SI4_MAX_HEADS];
    for (int i = 0; i < n; i++) {
        const char *row = (const char *)u->kc + (size_t)u->slots[i] * row_bytes; /* every KV head of position i */
        for (int h = 0; h < nh; h++)
            u->scores[(size_t)h * n + i] =
                attn_dot_any(u->q + (size_t)h * hd, row + (size_t)(h / group) * head_bytes, hd, kv) * u->scale;
    }
    attn_softmax(u, nh, inv);
    memset(u->out, 0, sizeof(float) * (size_t)nh * hd);
    for (int i = 0; i < n; i++) {
        const char *row = (const char *)u->vc + (size_t)u->slots[i] * row_bytes;
        for (int h = 0; h < nh; h++) {
            const float p = u->scores[(size_t)h * n + i] * inv[h];
            attn_axpy_any(u->out + (size_t)h * hd, p, row + (size_t)(h / group) * head_bytes, hd, kv);
        }
    }
}

#define ATTN_MAXV 16 /* head dimensions of up to 16 vectors take attend_vec */
#define ATTN_OREG 8  /* vectors of a head's output held in registers over a block of positions */

/* One KV head's key or value at p (nv vectors, hd = nv * VW values), as floats (q8_0: q
 * times its group's scale; a group of 32 is whole vectors, VW dividing 32). */
ATTN_INLINE void load_head(vf *dst, const void *p, int nv, const int kv) {
    for (int v = 0; v < nv; v++)
        dst[v] = kv == SI4_KV_Q8
                     ? V_FMA(V_LOAD_I8((const int8_t *)p + v * VW),
                             V_SET1(attn_q8_scale((const char *)p, nv * VW, v * VW / ATTN_Q8_GROUP)), V_ZERO())
                 : kv == SI4_KV_F16 ? V_LOAD_F16((const uint16_t *)p + v * VW)
                                    : V_LOAD((const float *)p + v * VW);
}

/* KV head g of positions i0 .. i0 + nb - 1 (cache c) as floats, row j at buf + j hd; rows nb ..
 * VW - 1 zero where `pad` (a partial block's keys, whose scores are then computed and dropped). */
ATTN_INLINE void block_rows(const si4_attn_unit *u, const void *c, int i0, int nb, int g, size_t head_bytes,
                            size_t row_bytes, float *buf, int pad, const int kv) {
    const int nv = u->hd / VW;
    for (int j = 0; j < nb; j++) {
        vf t[ATTN_MAXV];
        load_head(t, (const char *)c + (size_t)u->slots[i0 + j] * row_bytes + (size_t)g * head_bytes, nv, kv);
        for (int v = 0; v < nv; v++) V_STORE(buf + (size_t)j * u->hd + v * VW, t[v]);
    }
    if (pad && nb < VW) memset(buf + (size_t)nb * u->hd, 0, sizeof(float) * (size_t)(VW - nb) * u->hd);
}

/* Cache rows asked for ahead of their use: a unit reads its n positions' keys and then their
 * values, rows 0 .. 2n - 1 of one stream (key rows, then value rows), and this asks for rows
 * r0 .. r1 - 1 of it (every KV head of each; past the stream's end nothing). A unit's positions
 * lie in blocks of the paged cache, apart in memory, and without it their rows came from DRAM
 * at the pace of demand misses. */
ATTN_INLINE void prefetch_rows(const si4_attn_unit *u, int r0, int r1, size_t row_bytes) {
    const int n = u->n_ctx;
    for (int r = r0; r < r1 && r < 2 * n; r++) {
        const char *row = (const char *)(r < n ? u->kc : u->vc) + (size_t)u->slots[r < n ? r : r - n] * row_bytes;
        for (size_t l = 0; l < row_bytes; l += 64) __builtin_prefetch(row + l, 0, 3);
    }
}

/* o[0 .. W vectors) += sum over the block's nb positions j of p[j] inv vb[j] (the values of
 * positions in order, each FMA as attend_any's axpy), the W vectors in registers throughout */
ATTN_INLINE void block_axpy(float *o, const float *vb, int hd, const float *p, float inv, int nb, const int W) {
    vf acc[ATTN_OREG];
    for (int r = 0; r < W; r++) acc[r] = V_LOAD(o + r * VW);
    for (int j = 0; j < nb; j++) {
        const vf pj = V_SET1(p[j] * inv);
        for (int r = 0; r < W; r++) acc[r] = V_FMA(pj, V_LOAD(vb + (size_t)j * hd + r * VW), acc[r]);
    }
    for (int r = 0; r < W; r++) V_STORE(o + r * VW, acc[r]);
}

/* As attend_any, for a head dimension of whole vectors, in blocks of VW positions: a block's
 * keys and values of a KV head are converted to floats once for its `group` query heads; a
 * head's VW scores of a block come out as one vector (V_SUMS: the block's dot products summed
 * across lanes together, not a horizontal sum each), and its output stays in registers over
 * the block's values. */
ATTN_INLINE void attend_vec(const si4_attn_unit *u, const int kv) {
    const int group = u->group, hd = u->hd, n = u->n_ctx, nkv = u->n_kv, nh = nkv * group, nv = hd / VW;
    const size_t head_bytes = attn_head_bytes(hd, kv), row_bytes = head_bytes * nkv;
    const vf scale = V_SET1(u->scale);
    float inv[SI4_MAX_HEADS], buf[VW * ATTN_MAXV * VW];
    /* rows asked for ahead (64 to 128 measured the same on a Zen 5 with the 1.5B's shapes at a
     * 3,000-token context); the stalls on the rows' loads were most of the time */
    enum { AHEAD = 64 };
    prefetch_rows(u, 0, AHEAD, row_bytes);
    for (int i0 = 0; i0 < n; i0 += VW) {
        const int nb = n - i0 < VW ? n - i0 : VW;
        prefetch_rows(u, i0 + AHEAD, i0 + AHEAD + VW, row_bytes);
        for (int g = 0; g < nkv; g++) {
            block_rows(u, u->kc, i0, nb, g, head_bytes, row_bytes, buf, 1, kv);
            for (int h = g * group; h < (g + 1) * group; h++) {
                const float *q = u->q + (size_t)h * hd;
                vf acc[VW];
                for (int j = 0; j < VW; j++) acc[j] = V_ZERO();
                for (int v = 0; v < nv; v++) {
                    const vf qv = V_LOAD(q + v * VW);
                    for (int j = 0; j < VW; j++) acc[j] = V_FMA(qv, V_LOAD(buf + (size_t)j * hd + v * VW), acc[j]);
                }
                float *sc = u->scores + (size_t)h * n + i0;
                if (nb == VW) {
                    V_STORE(sc, V_MUL(V_SUMS(acc), scale));
                } else {
                    float t[VW];
                    V_STORE(t, V_MUL(V_SUMS(acc), scale));
                    memcpy(sc, t, sizeof(float) * (size_t)nb);
                }
            }
        }
    }
    attn_softmax(u, nh, inv);
    memset(u->out, 0, sizeof(float) * (size_t)nh * hd);
    for (int i0 = 0; i0 < n; i0 += VW) {
        const int nb = n - i0 < VW ? n - i0 : VW;
        prefetch_rows(u, n + i0 + AHEAD, n + i0 + AHEAD + VW, row_bytes);
        for (int g = 0; g < nkv; g++) {
            block_rows(u, u->vc, i0, nb, g, head_bytes, row_bytes, buf, 0, kv);
            for (int h = g * group; h < (g + 1) * group; h++) {
                const float *p = u->scores + (size_t)h * n + i0;
                float *o = u->out + (size_t)h * hd;
                for (int v = 0; v < nv;) {
                    if (nv - v >= 8) block_axpy(o + v * VW, buf + v * VW, hd, p, inv[h], nb, 8), v += 8;
                    else if (nv - v >= 4) block_axpy(o + v * VW, buf + v * VW, hd, p, inv[h], nb, 4), v += 4;
                    else block_axpy(o + v * VW, buf + v * VW, hd, p, inv[h], nb, 1), v += 1;
                }
            }
        }
    }
}

void ATTN_NAME(const si4_attn_unit *u) {
    const int vec = u->hd % VW == 0 && u->hd / VW <= ATTN_MAXV;
    switch (u->kv_type * 2 + vec) {
    case SI4_KV_F32 * 2 + 1: attend_vec(u, SI4_KV_F32); break;
    case SI4_KV_F16 * 2 + 1: attend_vec(u, SI4_KV_F16); break;
    case SI4_KV_Q8 * 2 + 1: attend_vec(u, SI4_KV_Q8); break;
    case SI4_KV_F32 * 2: attend_any(u, SI4_KV_F32); break;
    case SI4_KV_F16 * 2: attend_any(u, SI4_KV_F16); break;
    default: attend_any(u, SI4_KV_Q8); break;
    }
}

/* dst[i] = src[i] as IEEE binary16, rounded to nearest even (the KV write of an fp16 cache) */
void F16_STORE_NAME(uint16_t *dst, const float *src, int n) {
    int i = 0;
#ifdef V_STORE_F16
    for (; i + VW <= n; i += VW) V_STORE_F16(dst + i, V_LOAD(src + i));
#endif
    for (; i < n; i++) dst[i] = S_TO_F16(src[i]);
}

/* n_heads rows of hd floats -> q8_0 rows (the KV write of a q8_0 cache), as
 * kv_quant.quantize_q8: per group of 32, d = fp16(max|x| / 127), q = x / float(d) rounded to
 * nearest even and clamped to +-127 (0 where d = 0); a row's values, then its groups' d. */
void Q8_STORE_NAME(int8_t *dst, const float *src, int n_heads, int hd) {
    for (int h = 0; h < n_heads; h++) {
        int8_t *row = dst + (size_t)h * attn_head_bytes(hd, SI4_KV_Q8);
        for (int g = 0; g < hd / ATTN_Q8_GROUP; g++) {
            const float *x = src + (size_t)h * hd + g * ATTN_Q8_GROUP;
            int8_t *q = row + g * ATTN_Q8_GROUP;
            float amax = 0.0f;
            for (int e = 0; e < ATTN_Q8_GROUP; e++) amax = fmaxf(amax, fabsf(x[e]));
            const uint16_t dh = S_TO_F16(amax / 127.0f);
            const float d = S_F16(dh);
            for (int e = 0; e < ATTN_Q8_GROUP; e++) {
                float r = d > 0.0f ? rintf(x[e] / d) : 0.0f; /* the default rounding: nearest even */
                r = r > 127.0f ? 127.0f : (r < -127.0f ? -127.0f : r);
                q[e] = (int8_t)r;
            }
            memcpy(row + hd + 2 * g, &dh, sizeof dh);
        }
    }
}
