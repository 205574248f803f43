"""A prompt chunk's causal attention in the native kernels against the exact softmax attention in
float64: in bfloat16 through AMX-BF16 tiles (csrc/attn_tiles.c) where the CPU has them, else on
AVX512-BF16 (the same algorithm, its tile multiplies by vdpbf16ps: csrc/attn_bf16.c); and in
float32 on AVX2 and FMA (csrc/attn_fma.c: every other x86-64 CPU, and this one held to AVX2).
Each kernel is skipped on CPUs without its instructions and failed where the CPU has them and
the build or dispatch does not run it.

The bound, per query row i, with u the unit roundoff of the kernel's inputs (bfloat16 2^-8, or
float32 2^-24): the bfloat16 kernels round q (scaled) and every k_j to bfloat16, so a logit s_j
errs by at most d_i = max_j sum_d |q_d k_jd| ((1 + u)^2 - 1) (plus float32 sums, a 1% allowance);
the float32 kernel's FMA chain over D dims errs by at most (D + 2) u times the same sum. A
softmax whose logits each move by at most d changes every weight by a factor within e^(+-2d);
then P and v are rounded (u each) and P V summed in float32 (for the float32 kernel, sums of
up to L terms and the exponential's few ulps: (2 L + 16) u). So

    |o_i - exact_i| <= (e^(2 d_i) - 1 + c u) max_j |v_j|

(the division by the sum of the weights keeps them a convex combination). Then a second check
that the error is rounding noise, not a biased kernel within the bound: its mean relative RMS
stays under 2u (float32: 64u, its sums running over hundreds of terms). And a row's result
depends on its own query, position and keys only: the same bits whatever rows share its call
or how the prompt was chunked.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from cpu_flags import ISA_FLAGS, missing
from llmlocal.native.cpu import kernels, runtime

# (T, start, H, Hkv, D, window): GQA groups of 6 (Qwen2.5-1.5B) and 1, a chunk after a cached
# prefix, head dims 32 to 256 (Gemma 3's), a sliding window, tails not a multiple of 16
CASES = [(37, 0, 12, 2, 128, 0), (16, 100, 4, 4, 64, 0), (70, 50, 4, 1, 256, 40), (1, 200, 2, 2, 32, 0),
         (200, 1000, 12, 2, 128, 0), (33, 0, 8, 2, 96, 16)]


@pytest.fixture(autouse=True, params=["bfloat16", "float32"])
def kernel(request: pytest.FixtureRequest) -> float:
    """The kernel under test switched on; its unit roundoff."""
    before = runtime.isa()
    if request.param == "float32":
        lacking = missing(ISA_FLAGS["avx2"])
        if lacking:
            pytest.skip(f"this CPU lacks {', '.join(lacking)} (float32 attention on AVX2)")
        runtime.set_isa("avx2")
        want, u = "fma", 2.0**-24
    else:
        amx = not missing(("amx_tile", "amx_bf16", "avx512_bf16", "avx512bw"))
        lacking = missing(("avx512_bf16", "avx512f", "avx512bw", "avx512vl", "avx512dq"))
        if not amx and lacking:
            pytest.skip(f"this CPU lacks AMX-BF16 and {', '.join(lacking)} (bfloat16 attention)")
        runtime.set_isa("avx512")
        runtime.set_qmat_tiles(True)
        if amx:
            assert runtime.qmat_tiles(), "the CPU has AMX-BF16, the kernels do not run the tiles"
        want, u = ("tiles" if amx else "bf16"), 2.0**-8
    try:
        assert runtime.kernels().attn_kernel() == want, f"the CPU has {want}, attn_tiles does not run it"
        yield u
    finally:
        runtime.set_isa(before)


def attn(q: np.ndarray, k: np.ndarray, v: np.ndarray, start: int, scale: float, window: int) -> np.ndarray:
    t, h, d = q.shape
    out = np.empty_like(q)
    kernels().attn_tiles(q, k, v, out, t, h, k.shape[0], k.shape[1], d, start, window, scale)
    return out


def exact(q: np.ndarray, k: np.ndarray, v: np.ndarray, start: int, scale: float, window: int,
          u: float) -> tuple[np.ndarray, np.ndarray]:
    """float64 attention, and each output row's bound (above) for unit roundoff u."""
    t, h, d = q.shape
    group = h // k.shape[1]
    pos = np.arange(start, start + t)[:, None]
    keys = np.arange(k.shape[0])[None, :]
    seen = (keys <= pos) & ((keys > pos - window) if window else True)
    out, bound = np.zeros((t, h, d)), np.zeros((t, h))
    for head in range(h):
        qh, kh, vh = q[:, head].astype(np.float64) * scale, k[:, head // group].astype(np.float64), v[:, head // group].astype(np.float64)
        s = np.where(seen, qh @ kh.T, -np.inf)
        p = np.exp(s - s.max(axis=1, keepdims=True))
        out[:, head] = (p / p.sum(axis=1, keepdims=True)) @ vh
        bf16 = u > 2.0**-20
        per_logit = (1 + u) ** 2 - 1 if bf16 else (d + 2) * u
        delta = 1.01 * per_logit * np.where(seen, np.abs(qh) @ np.abs(kh).T, 0).max(axis=1)
        vmax = np.array([np.abs(vh[seen[i]]).max() for i in range(t)])
        bound[:, head] = (np.expm1(2 * delta) + (3 if bf16 else 2 * k.shape[0] + 16) * u) * vmax
    return out, bound


def inputs(case: tuple[int, ...], seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    t, start, h, hkv, d, _ = case
    rng = np.random.default_rng(seed)
    L = start + t
    q = rng.standard_normal((t, h, d), dtype=np.float32) * 2  # logits of a few units: a peaked softmax
    return q, rng.standard_normal((L, hkv, d), dtype=np.float32), rng.standard_normal((L, hkv, d), dtype=np.float32)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "T{}-start{}-H{}x{}-D{}-w{}".format(*c))
def test_attention_within_the_bound_of_its_roundings(case: tuple[int, ...], kernel: float) -> None:
    t, start, h, hkv, d, window = case
    q, k, v = inputs(case, seed=t + start)
    scale = 1 / math.sqrt(d)
    got = attn(q, k, v, start, scale, window)
    want, bound = exact(q, k, v, start, scale, window, kernel)
    err = np.abs(got - want).max(axis=2)
    assert (err <= bound).all(), f"worst error / bound {np.max(err / bound):.3f}"
    rms = np.sqrt(((got - want) ** 2).mean() / (want**2).mean())
    assert rms < (2 if kernel > 2.0**-20 else 64) * kernel, f"relative RMS error {rms:.2e}"


@pytest.mark.parametrize("case", CASES[:3] + CASES[5:], ids=lambda c: "T{}-start{}-H{}x{}-D{}-w{}".format(*c))
def test_a_row_is_the_same_however_the_prompt_is_chunked(case: tuple[int, ...]) -> None:
    t, start, h, hkv, d, window = case
    q, k, v = inputs(case, seed=7)
    scale = 1 / math.sqrt(d)
    whole = attn(q, k, v, start, scale, window)
    for cut in (1, 5, 16, t // 2):  # the prompt in two chunks: the second after the first's K/V
        if not 0 < cut < t:
            continue
        first = attn(q[:cut].copy(), k[: start + cut].copy(), v[: start + cut].copy(), start, scale, window)
        second = attn(q[cut:].copy(), k, v, start + cut, scale, window)
        assert np.array_equal(np.concatenate([first, second]), whole), f"cut at {cut}"


def test_threads_do_not_change_a_bit() -> None:
    case = CASES[4]
    q, k, v = inputs(case, seed=3)
    K = runtime.kernels()
    before = K.num_threads()
    try:
        K.set_num_threads(1)
        one = attn(q, k, v, case[1], 0.088, 0)
        K.set_num_threads(2)
        assert np.array_equal(attn(q, k, v, case[1], 0.088, 0), one)
    finally:
        K.set_num_threads(before)


def test_the_engine_takes_the_tiles_for_prompt_rows_only() -> None:
    """`paged_attention` sends a prefill chunk to the tiles when its rows are a prompt's
    (`prompt_rows`), and keeps torch's float32 attention otherwise (drafted tokens under
    verification): the two differ in their last bits, so which one ran shows."""
    from llmlocal.engine.model.attention import AttentionMetadata, PrefillChunk, paged_attention
    from llmlocal.native.cpu.linear import prompt_rows

    t, h, hkv, d, block = 24, 4, 2, 64, 16
    rng = np.random.default_rng(5)
    q = torch.from_numpy(rng.standard_normal((t, h, d), dtype=np.float32))
    k = torch.from_numpy(rng.standard_normal((t, hkv, d), dtype=np.float32))
    v = torch.from_numpy(rng.standard_normal((t, hkv, d), dtype=np.float32))
    cache_k = torch.zeros(4, block, hkv, d)
    cache_v = torch.zeros(4, block, hkv, d)
    slots = torch.arange(t)
    meta = AttentionMetadata(slot_mapping=slots, prefills=[PrefillChunk(0, t, 0, slots)], decode_slots=torch.zeros(0, 1),
                             prompt_tiles=True)
    plain = paged_attention(q, k, v, cache_k, cache_v, meta, d**-0.5)
    with prompt_rows(0):
        tiled = paged_attention(q, k, v, cache_k, cache_v, meta, d**-0.5)
    assert np.array_equal(tiled.numpy(), attn(q.numpy(), k.numpy(), v.numpy(), 0, d**-0.5, 0))
    assert not torch.equal(tiled, plain) and torch.allclose(tiled, plain, atol=0.05)
    runtime.set_attn_tiles(False)  # switched off alone: torch's float32 attention for them too
    try:
        with prompt_rows(0):
            assert torch.equal(paged_attention(q, k, v, cache_k, cache_v, meta, d**-0.5), plain)
    finally:
        runtime.set_attn_tiles(True)
