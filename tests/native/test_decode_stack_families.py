"""DecodeStack's per-family options (Qwen3, Gemma 3, Phi-3, Mistral) against a float64 numpy
reference of the same arithmetic: QK-norm, the sandwich norms after attention and FFN, the
GELU-tanh gated activation, a sliding window and the local layers' RoPE table, alone and
together, for 1 and 3 sequences of different lengths (longer than the window, and cut into chunks
of attention: at least one a thread), with fp32 and fp16 caches; the sparse step (non-zero per-projection
thresholds, the reference zeroing the same inputs); and the defaults (short tuples) unchanged.

The projections are INT4 `Matrix` kernels with fp32 activations, compared through their own
dequantized weights: the kernels and the stack sum in fp32, the reference in float64, so they
agree to ~1e-5 relative (1e-4 is the bound); an fp16 cache rounds k and v of the new token in
both, but from values that differ by fp32 rounding, which may move one fp16 step (1e-3 bound).
Any option misapplied (a norm skipped, a window off by a slot, the wrong RoPE table) moves the
outputs by percents.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import pytest
from llmlocal.native import cpu as si4
from llmlocal.native.cpu import SparseInt4Linear

D, NH, NKV, HD, FFN = 64, 4, 2, 16, 96
NQKV = (NH + 2 * NKV) * HD
EPS, SCALE = 1e-6, HD**-0.5
SLOTS = 700  # cache slots of each layer
GELU_C = np.sqrt(2.0 / np.pi)


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    before = si4.num_threads()
    si4.set_num_threads(request.param)
    yield request.param
    si4.set_num_threads(before)


def projection(rng: np.random.Generator, n: int, k: int) -> tuple[SparseInt4Linear, np.ndarray]:
    """An INT4 kernel for a random (n, k) weight, and the weight it computes with (float64)."""
    codes = rng.integers(0, 16, (n, k), dtype=np.uint8)
    scale = rng.uniform(0.01, 0.04, (n, k // 32)).astype(np.float16).astype(np.float32)
    zero = rng.uniform(-0.02, 0.02, (n, k // 32)).astype(np.float16).astype(np.float32)
    lin = SparseInt4Linear.from_codes(codes, scale, zero, group_size=32)
    npad = lin.packed.npad
    wt = np.zeros((k, npad), np.float32)
    lin._matrix.dequantize(wt, 0, npad, npad)
    return lin, wt[:, :n].T.astype(np.float64)


def norm_weight(rng: np.random.Generator, n: int) -> np.ndarray:
    return (1.0 + 0.2 * rng.standard_normal(n)).astype(np.float32)


@dataclass
class Layer:
    """One layer's weights and options (None / 0 / False: off), and its caches."""

    attn_norm: np.ndarray
    ffn_norm: np.ndarray
    mats: list[SparseInt4Linear]
    w: list[np.ndarray]  # qkv, o, gate_up, down (float64)
    k_cache: np.ndarray
    v_cache: np.ndarray
    qkv_bias: np.ndarray | None = None
    q_norm: np.ndarray | None = None
    k_norm: np.ndarray | None = None
    post_attn_norm: np.ndarray | None = None
    post_ffn_norm: np.ndarray | None = None
    window: int = 0
    local: bool = False
    split_qkv: bool = False  # qkv as a tuple of three matrices (q, k, v) whose outputs stack
    extra: list[SparseInt4Linear] = field(default_factory=list)

    def entry(self, full: bool) -> tuple:
        """The layer's tuple for DecodeStack: the 8 mandatory items, and the options when `full`
        or when one is set (only as many as reach the last one set)."""
        ptr = lambda a: None if a is None else a.ctypes.data  # noqa: E731
        qkv = tuple(m._matrix for m in self.extra) if self.split_qkv else self.mats[0]._matrix
        base = (self.attn_norm.ctypes.data, qkv, self.mats[1]._matrix, self.mats[2]._matrix, self.mats[3]._matrix,
                self.ffn_norm.ctypes.data, self.k_cache.ctypes.data, self.v_cache.ctypes.data)
        opts = [ptr(self.qkv_bias), ptr(self.q_norm), ptr(self.k_norm), ptr(self.post_attn_norm),
                ptr(self.post_ffn_norm), self.window, self.local]
        if not full:
            while opts and opts[-1] in (None, 0, False):
                opts.pop()
        return base + tuple(opts)


def make_layer(rng: np.random.Generator, kv_f16: bool, split_qkv: bool = False, **opts: object) -> Layer:
    mats, ws = zip(*(projection(rng, n, k) for n, k in ((NQKV, D), (D, NH * HD), (2 * FFN, D), (D, FFN))))
    dtype = np.float16 if kv_f16 else np.float32
    cache = lambda: rng.standard_normal((SLOTS, NKV, HD)).astype(dtype)  # noqa: E731
    layer = Layer(norm_weight(rng, D), norm_weight(rng, D), list(mats), list(ws), cache(), cache(), **opts)
    if split_qkv:  # the same numbers from three matrices
        parts = [projection(rng, n, D) for n in (NH * HD, NKV * HD, NKV * HD)]
        layer.extra = [m for m, _ in parts]
        layer.w[0] = np.concatenate([w for _, w in parts])
        layer.split_qkv = True
    return layer


def options(rng: np.random.Generator, names: str) -> dict:
    """Layer options by short name: bias, qk (QK-norm), post (both sandwich norms)."""
    out: dict = {}
    if "bias" in names:
        out["qkv_bias"] = (0.3 * rng.standard_normal(NQKV)).astype(np.float32)
    if "qk" in names:
        out["q_norm"], out["k_norm"] = norm_weight(rng, HD), norm_weight(rng, HD)
    if "post" in names:
        out["post_attn_norm"], out["post_ffn_norm"] = norm_weight(rng, D), norm_weight(rng, D)
    return out


def rope_table(positions: np.ndarray, base: float) -> np.ndarray:
    """(B, HD) float32 [cos, sin] of each row's position, pair j at frequency base^(-2j/HD)."""
    inv = base ** (-np.arange(0, HD, 2, dtype=np.float64) / HD)
    ang = (positions[:, None].astype(np.float64) * inv[None, :]).astype(np.float32)
    return np.stack([np.cos(ang), np.sin(ang)], axis=-1).reshape(len(positions), HD).astype(np.float32)


def rms(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + EPS) * w


def rotate(x: np.ndarray, rot: np.ndarray) -> np.ndarray:
    """x (heads, HD) interleaved pairs times rot (HD,) [cos, sin] pairs."""
    a, b = x[:, 0::2], x[:, 1::2]
    c, s = rot[0::2].astype(np.float64), rot[1::2].astype(np.float64)
    out = np.empty_like(x)
    out[:, 0::2], out[:, 1::2] = a * c - b * s, a * s + b * c
    return out


@dataclass
class Thresholding:
    """The reference's side of per-projection thresholds (layer l, projection P at l * 4 + P:
    qkv, o, gate_up, down; <= 0 dense): the inputs each projection saw and kept, and how close
    any input came to its threshold (relative), where float32 and float64 could decide apart."""

    t: np.ndarray
    inputs: dict[int, list[np.ndarray]] = field(default_factory=dict)
    kept: np.ndarray = field(init=False)
    closest: float = np.inf

    def __post_init__(self) -> None:
        self.kept = np.zeros(len(self.t), np.int64)

    def apply(self, i: int, x: np.ndarray) -> np.ndarray:
        """x' = x where |x| > t, else 0 (float64), as the kernels zero x (float32) before W x'."""
        self.inputs.setdefault(i, []).append(x.copy())
        t = float(self.t[i])
        if not t > 0:
            self.kept[i] += x.size
            return x
        keep = np.abs(x) > t
        self.kept[i] += int(keep.sum())
        self.closest = min(self.closest, float(np.min(np.abs(np.abs(x) - t))) / t)
        return np.where(keep, x, 0.0)


def reference(layers: list[Layer], activation: int, h: np.ndarray, cis: np.ndarray, cis_local: np.ndarray | None,
              slots: np.ndarray, lens: np.ndarray, kv_f16: bool, th: Thresholding | None = None) -> np.ndarray:
    """The stack in float64 on copies of the caches (read before the step); with `th`, each
    projection's input thresholded first."""
    h = h.astype(np.float64)
    th = th if th is not None else Thresholding(np.zeros(4 * len(layers), np.float32))
    caches = [(l.k_cache.astype(np.float64), l.v_cache.astype(np.float64)) for l in layers]
    for li, (layer, (kc, vc)) in enumerate(zip(layers, caches)):
        first = 4 * li  # the layer's projections: first + 0 .. 3
        for b in range(h.shape[0]):
            qkv = layer.w[0] @ th.apply(first, rms(h[b], layer.attn_norm))
            if layer.qkv_bias is not None:
                qkv = qkv + layer.qkv_bias
            q, k, v = qkv[: NH * HD].reshape(NH, HD), qkv[NH * HD : (NH + NKV) * HD].reshape(NKV, HD), qkv[(NH + NKV) * HD :]
            if layer.q_norm is not None:
                q, k = rms(q, layer.q_norm), rms(k, layer.k_norm)
            rot = (cis_local if layer.local else cis)[b]
            q, k = rotate(q, rot), rotate(k, rot)
            new = slots[b, lens[b] - 1]
            kc[new], vc[new] = k, v.reshape(NKV, HD)
            if kv_f16:  # the cache holds the new token's fp16 k, v
                kc[new] = kc[new].astype(np.float32).astype(np.float16)
                vc[new] = vc[new].astype(np.float32).astype(np.float16)
            n = min(lens[b], layer.window) if layer.window else lens[b]
            ctx = slots[b, lens[b] - n : lens[b]]
            att = np.empty((NH, HD))
            for head in range(NH):
                g = head // (NH // NKV)
                s = SCALE * kc[ctx, g] @ q[head]
                p = np.exp(s - s.max())
                att[head] = (p / p.sum()) @ vc[ctx, g]
            o = layer.w[1] @ th.apply(first + 1, att.reshape(-1))
            h[b] += o if layer.post_attn_norm is None else rms(o, layer.post_attn_norm)
            gu = layer.w[2] @ th.apply(first + 2, rms(h[b], layer.ffn_norm))
            g, up = gu[:FFN], gu[FFN:]
            if activation == 1:
                a = 0.5 * g * (1.0 + np.tanh(GELU_C * (g + 0.044715 * g**3))) * up
            else:
                a = g / (1.0 + np.exp(-g)) * up
            y = layer.w[3] @ th.apply(first + 3, a)
            h[b] += y if layer.post_ffn_norm is None else rms(y, layer.post_ffn_norm)
    return h


def run(layers: list[Layer], lens: list[int], kv_f16: bool, activation: int | None = None, full: bool = False,
        seed: int = 0, local_base: float = 10000.0, th: Thresholding | None = None
        ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(stack's h, reference's h, kept) after one step of len(lens) sequences, the projections'
    inputs thresholded by `th` (None: dense); the caches are left as the step wrote them."""
    rng = np.random.default_rng(seed)
    batch = len(lens)
    config = (D, NH, NKV, HD, FFN, EPS, SCALE, kv_f16) + (() if activation is None else (activation,))
    stack = si4.kernels().DecodeStack(config, [l.entry(full) for l in layers])
    stride = max(lens) + 5
    slots = np.zeros((batch, stride), np.int64)
    perm = rng.permutation(SLOTS)  # disjoint contexts, slots in no order
    at = 0
    for b, n in enumerate(lens):
        slots[b, :n] = perm[at : at + n]
        at += n
    lens_a = np.array(lens, np.int64)
    new = slots[np.arange(batch), lens_a - 1].copy()
    positions = lens_a - 1
    cis = rope_table(positions, 10000.0)
    local = any(l.local for l in layers)
    cis_local = rope_table(positions, local_base) if local else None
    h = rng.standard_normal((batch, D)).astype(np.float32)
    want = reference(layers, activation or 0, h, cis, cis_local, slots, lens_a, kv_f16, th)
    t = np.zeros(len(layers) * 4, np.float32) if th is None else np.ascontiguousarray(th.t, dtype=np.float32)
    kept = np.zeros(len(layers) * 4, np.int64)
    stack.step(h.ctypes.data, cis.ctypes.data, 0 if cis_local is None else cis_local.ctypes.data, slots.ctypes.data,
               stride, lens_a.ctypes.data, new.ctypes.data, batch, t.ctypes.data, kept.ctypes.data)
    return h, want, kept


def check(got: np.ndarray, want: np.ndarray, kv_f16: bool) -> None:
    err = np.abs(got - want).max() / np.abs(want).max()  # seen: ~2e-6 with either cache
    assert err < (1e-3 if kv_f16 else 1e-4), err


# ------------------------------------------------------------------------------------------------

SINGLE = {
    "plain": {},
    "bias": {"opts": "bias"},
    "qk_norm": {"opts": "qk"},
    "qk_norm_bias": {"opts": "bias qk"},
    "sandwich": {"opts": "post"},
    "gelu": {"activation": 1},
    "silu_explicit": {"activation": 0},
    "window": {"window": 40},
    "window_over_chunk": {"window": 150},
    "local": {"local": True},
    "split_qkv": {"split": True, "opts": "qk"},
}


@pytest.mark.parametrize("kv_f16", [False, True], ids=["fp32-cache", "fp16-cache"])
@pytest.mark.parametrize("lens", [[1], [300], [300, 7, 133]], ids=["b1-len1", "b1-len300", "b3"])
@pytest.mark.parametrize("case", list(SINGLE))
def test_each_option_alone(case: str, lens: list[int], kv_f16: bool, threads: int) -> None:
    c = SINGLE[case]
    rng = np.random.default_rng(1)
    layers = [make_layer(rng, kv_f16, split_qkv=c.get("split", False), window=c.get("window", 0),
                         local=c.get("local", False), **options(rng, c.get("opts", ""))) for _ in range(2)]
    got, want, kept = run(layers, lens, kv_f16, activation=c.get("activation"), local_base=500.0)
    check(got, want, kv_f16)
    np.testing.assert_array_equal(kept, np.tile([D, NH * HD, D, FFN], 2) * len(lens))  # dense: every input


def gemma_like(rng: np.random.Generator, kv_f16: bool, window: int) -> list[Layer]:
    """Local (windowed, own RoPE) layers around a global one, QK-norm and sandwich norms in all."""
    return [make_layer(rng, kv_f16, window=window if i != 1 else 0, local=i != 1, **options(rng, "qk post"))
            for i in range(3)]


@pytest.mark.parametrize("kv_f16", [False, True], ids=["fp32-cache", "fp16-cache"])
@pytest.mark.parametrize("lens", [[20], [333], [333, 12, 200]], ids=["b1-short", "b1-long", "b3"])
@pytest.mark.parametrize("window", [48, 160])
def test_gemma3_like_stack(window: int, lens: list[int], kv_f16: bool, threads: int) -> None:
    rng = np.random.default_rng(2)
    layers = gemma_like(rng, kv_f16, window)
    got, want, _ = run(layers, lens, kv_f16, activation=1, local_base=10000.0 / 3)
    check(got, want, kv_f16)


FAMILIES = ["llama", "qwen3", "gemma3"]


def family_layers(rng: np.random.Generator, family: str, kv_f16: bool) -> tuple[list[Layer], int]:
    """(layers, activation) of a small stack shaped like the family."""
    if family == "gemma3":
        return gemma_like(rng, kv_f16, 48), 1
    opts = "bias qk" if family == "qwen3" else ""
    return [make_layer(rng, kv_f16, **options(rng, opts)) for _ in range(3)], 0


@pytest.mark.parametrize("kv_f16", [False, True], ids=["fp32-cache", "fp16-cache"])
@pytest.mark.parametrize("lens", [[1], [300], [300, 7, 133]], ids=["b1-len1", "b1-len300", "b3"])
@pytest.mark.parametrize("level", [0.5, 0.9])
@pytest.mark.parametrize("family", FAMILIES)
def test_thresholds_against_float64(family: str, level: float, lens: list[int], kv_f16: bool, threads: int) -> None:
    """A sparse step: every projection with its own non-zero threshold, the `level` quantile of
    its inputs' magnitudes in a dense step (so about that share of each is zeroed), against the
    float64 stack that zeroes the same inputs; and each projection reads exactly the inputs the
    reference keeps. No input of the reference lies within 1e-5 (relative) of its threshold,
    far above where float32 and float64 could decide apart (~1e-6), so the comparison is
    exact in its decisions and the tolerance is the dense one."""
    rng = np.random.default_rng(13)  # data whose inputs all keep > 1e-4 from their thresholds
    layers, activation = family_layers(rng, family, kv_f16)
    probe = Thresholding(np.zeros(4 * len(layers), np.float32))
    run(layers, lens, kv_f16, activation=activation, th=probe)  # (a step rewrites only its new slots)
    t = np.array([np.quantile(np.abs(np.concatenate(probe.inputs[i])), level) for i in range(4 * len(layers))],
                 np.float32)
    assert (t > 0).all()
    th = Thresholding(t)
    got, want, kept = run(layers, lens, kv_f16, activation=activation, th=th)
    assert th.closest > 1e-5, f"an input within {th.closest:.1e} of its threshold: pick other data"
    check(got, want, kv_f16)
    np.testing.assert_array_equal(kept, th.kept)
    inputs = np.array([sum(x.size for x in th.inputs[i]) for i in range(len(t))])
    skipped = 1 - th.kept / inputs
    assert (skipped > 0).all() and abs(skipped.mean() - level) < 0.15, skipped
    dense, _, _ = run(layers, lens, kv_f16, activation=activation)
    assert np.abs(dense - got).max() / np.abs(want).max() > 1e-2  # the thresholds matter


def test_options_matter() -> None:
    """Each option moves the result well beyond the tolerance (the test above could not pass by
    the option being ignored): the window, the local table, the norms and the activation."""
    rng = np.random.default_rng(3)
    layers = gemma_like(rng, False, 48)
    base, _, _ = run(layers, [300, 200], False, activation=1, local_base=1000.0)
    # (a step writes only its new slots, before reading them: the runs can share the caches)
    variants = {
        "no window": dict(window=0),
        "not local": dict(local=False),
        "no q/k norm": dict(q_norm=None, k_norm=None),
        "no post norms": dict(post_attn_norm=None, post_ffn_norm=None),
    }
    for name, change in variants.items():
        changed = [Layer(**{**l.__dict__, **(change if l.local else {})}) for l in layers]
        other, _, _ = run(changed, [300, 200], False, activation=1, local_base=1000.0)
        assert np.abs(other - base).max() / np.abs(base).max() > 1e-2, name
    other, _, _ = run(layers, [300, 200], False, activation=0, local_base=1000.0)
    assert np.abs(other - base).max() / np.abs(base).max() > 1e-2, "silu"


def test_two_windows_and_a_full_layer(threads: int) -> None:
    """Layers of different windows each attend their own (a plan per distinct window)."""
    rng = np.random.default_rng(4)
    layers = [make_layer(rng, False, window=w) for w in (30, 0, 200, 30, 1)]
    got, want, _ = run(layers, [250, 31, 400], False)
    check(got, want, False)


@pytest.mark.parametrize("isa", si4.available_isas())
@pytest.mark.parametrize("kv_f16", [False, True], ids=["fp32-cache", "fp16-cache"])
def test_attention_on_every_isa(isa: str, kv_f16: bool, threads: int) -> None:
    # decode attention takes positions in blocks of the vector width (8 on AVX2, 16 on AVX-512)
    # whose scores come out together: contexts of one, of a partial block, of one past a block,
    # and of more than a chunk (512 positions; contexts are cut into at least a chunk a
    # thread), whatever variant this CPU runs
    before = si4.isa()
    si4.set_isa(isa)
    try:
        rng = np.random.default_rng(5)
        layers = [make_layer(rng, kv_f16, **options(rng, "bias")) for _ in range(2)]
        for lens in ([1, 7, 15, 17, 300], [600]):
            got, want, _ = run(layers, lens, kv_f16)
            check(got, want, kv_f16)
    finally:
        si4.set_isa(before)


@pytest.mark.parametrize("kv_f16", [False, True], ids=["fp32-cache", "fp16-cache"])
def test_defaults_are_llama(kv_f16: bool, threads: int) -> None:
    """Short tuples and the 8-item config are the Llama stack; every option spelled out as off
    (None, window 0, not local, activation 0) gives the same bits; a window longer than every
    context changes nothing either."""
    rng = np.random.default_rng(5)
    layers = [make_layer(rng, kv_f16, **options(rng, "bias")), make_layer(rng, kv_f16)]
    k0 = [(l.k_cache.copy(), l.v_cache.copy()) for l in layers]
    lens = [140, 3, 129]
    short, want, _ = run(layers, lens, kv_f16)
    check(short, want, kv_f16)
    outs = []
    for full, act, window in ((True, 0, 0), (False, 0, 0), (True, None, 1000)):
        for l, (k, v) in zip(layers, k0):
            l.k_cache[:], l.v_cache[:] = k, v
            l.window = window
        outs.append(run(layers, lens, kv_f16, activation=act, full=full)[0])
    for o in outs:
        np.testing.assert_array_equal(o, short)


def test_errors() -> None:
    rng = np.random.default_rng(6)
    layer = make_layer(rng, False, local=True)
    config = (D, NH, NKV, HD, FFN, EPS, SCALE, False)
    stack = si4.kernels().DecodeStack(config, [layer.entry(False)])
    h = np.zeros((1, D), np.float32)
    cis = rope_table(np.array([0]), 10000.0)
    one = np.zeros(1, np.int64)
    lens = np.ones(1, np.int64)
    t, kept = np.zeros(4, np.float32), np.zeros(4, np.int64)
    with pytest.raises(ValueError, match="cis_local"):
        stack.step(h.ctypes.data, cis.ctypes.data, 0, one.ctypes.data, 1, lens.ctypes.data, one.ctypes.data, 1,
                   t.ctypes.data, kept.ctypes.data)
    with pytest.raises(TypeError):  # the old signature, without cis_local
        stack.step(h.ctypes.data, cis.ctypes.data, one.ctypes.data, 1, lens.ctypes.data, one.ctypes.data, 1,
                   t.ctypes.data, kept.ctypes.data)
    with pytest.raises(ValueError, match="activation"):
        si4.kernels().DecodeStack(config + (2,), [layer.entry(False)])
    layer.window = -1
    with pytest.raises(ValueError):
        si4.kernels().DecodeStack(config, [layer.entry(True)])
