/* The gated activation of an MLP, out = act(gate) * up, over n values, written once over the
 * isa_*.c vector vocabulary (V_LOAD, V_STORE, V_MUL, V_ADD, V_SET1, V_EXP_NEG where the ISA has
 * a vector exponential, V_ABS, V_DIV, V_SELECT_NEG(a, x, y) = a < 0 ? x : y) and GLU_NAME.
 *
 * Both activations are g w / (1 + e) with e = e^-|a| and w = 1 where a >= 0, e where a < 0:
 *   silu:      a = g                                  g / (1 + e^-g)
 *   gelu-tanh: a = 2 sqrt(2/pi) (g + 0.044715 g^3)    0.5 g (1 + tanh(a / 2)), Gemma's
 * (1 + tanh(z) = 2 / (1 + e^-2z) for z >= 0 and 2 e^2z / (1 + e^2z) below: no cancellation for
 * negative inputs, where 1 + tanh comes near 0). One exponential of a non-positive argument,
 * the vector one of vexp.h (expf on the scalar path), so each value's result does not depend
 * on its place in the call: prompt rows and decode rows compute it alike. The last partial
 * vector runs through a padded copy. */

static inline vf glu_one(vf g, vf u, int activation) {
    vf a = g;
    if (activation == 1) /* 2 sqrt(2 / pi) (g + 0.044715 g^3) */
        a = V_MUL(V_MUL(V_SET1(1.5957691216057308f), g), V_ADD(V_SET1(1.0f), V_MUL(V_SET1(0.044715f), V_MUL(g, g))));
#ifdef V_EXP_NEG
    const vf e = V_EXP_NEG(V_SUB(V_ZERO(), V_ABS(a)));
#else
    const vf e = expf(-V_ABS(a));
#endif
    return V_MUL(V_DIV(V_MUL(g, V_SELECT_NEG(a, e, V_SET1(1.0f))), V_ADD(V_SET1(1.0f), e)), u);
}

void GLU_NAME(const float *gate, const float *up, float *out, int n, int activation) {
    int i = 0;
    for (; i + VW <= n; i += VW) V_STORE(out + i, glu_one(V_LOAD(gate + i), V_LOAD(up + i), activation));
    if (i < n) {
        float g[VW] = {0}, u[VW] = {0}, o[VW];
        memcpy(g, gate + i, (size_t)(n - i) * sizeof(float));
        memcpy(u, up + i, (size_t)(n - i) * sizeof(float));
        V_STORE(o, glu_one(V_LOAD(g), V_LOAD(u), activation));
        memcpy(out + i, o, (size_t)(n - i) * sizeof(float));
    }
}
