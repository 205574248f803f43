"""The paged engine's model code: exact against an unpaged reference, close to llama.cpp."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from tiny_llama import CONFIG, gguf_llama_weights, reference_logits, write_checkpoint
from llmlocal.engine.core.block_manager import BlockManager
from llmlocal.engine.core.model_runner import ModelRunner, StepItem
from llmlocal.engine.core.sequence import Sequence
from llmlocal.engine.model.gguf_tensors import INT4_TYPES, GGUFTensors
from llmlocal.engine.model.linear import Int4Linear, int4_dequantize
from llmlocal.engine.model.loader import load_gguf, load_hf, quantize_int4
from llmlocal.models import resolve, spec_from_gguf

NEAR_TIE = 0.1  # nats: where two implementations may order the top two candidates either way
# llama.cpp's own near ties are wider, and depend on the kernels it picks for the CPU: with its
# repacked AVX2 kernels on a Zen 3 host its top-1 differed from the exact one at a margin of 0.105
LLAMA_CPP_NEAR_TIE = 0.15

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    path = tmp_path_factory.mktemp("tiny")
    return path, write_checkpoint(path)


@pytest.mark.parametrize("block_size", [4, 16])
def test_paged_logits_equal_the_unpaged_reference(tiny, block_size: int) -> None:
    path, weights = tiny
    model = load_hf(path, CPU, torch.float32, weights="dense")
    runner = ModelRunner(model, num_blocks=64, block_size=block_size, kv_dtype=torch.float32)
    tokens = torch.randint(0, CONFIG["vocab_size"], (41,), generator=torch.Generator().manual_seed(1)).tolist()
    ref = reference_logits(weights, tokens).float()  # (41, vocab)

    # One prefill of everything.
    seq = Sequence(0, tokens)
    blocks = BlockManager(64, block_size, enable_prefix_caching=False)
    blocks.allocate(seq)
    logits, _ = runner.execute([StepItem(seq, 0, len(tokens), True)], all_rows=True)
    assert torch.allclose(logits, ref, atol=1e-4), (logits - ref).abs().max()
    blocks.free(seq)

    # Chunked prefill over a cached prefix, then decodes through the paged kernel path,
    # batched with a second sequence so rows and block tables interleave.
    a, b = Sequence(1, tokens), Sequence(2, tokens[::-1])
    # their tokens from position 30 on stand for generated ones: decode rows (a prompt's own
    # rows take the prompt path however few)
    a.num_prompt_tokens = b.num_prompt_tokens = 30
    ref_b = reference_logits(weights, tokens[::-1]).float()
    blocks.allocate(a)
    blocks.allocate(b)
    out, _ = runner.execute([StepItem(a, 0, 17, True), StepItem(b, 0, 30, True)])
    assert torch.allclose(out[0], ref[16], atol=1e-4) and torch.allclose(out[1], ref_b[29], atol=1e-4)
    out, _ = runner.execute([StepItem(a, 17, 13, True), StepItem(b, 30, 1, True)])
    # decodes come first in the returned order
    assert torch.allclose(out[0], ref_b[30], atol=1e-4) and torch.allclose(out[1], ref[29], atol=1e-4)
    for pos in range(30, 41):
        items = [StepItem(a, pos, 1, True)] + ([StepItem(b, pos + 1, 1, True)] if pos + 1 < 41 else [])
        out, order = runner.execute(items)
        assert order[0].seq is a
        assert torch.allclose(out[0], ref[pos], atol=1e-4), (pos, (out[0] - ref[pos]).abs().max())
        if len(items) > 1:
            assert torch.allclose(out[1], ref_b[pos + 1], atol=1e-4)


def int8_weights(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The checkpoint's weights with every projection replaced by the INT8 model's own (codes
    times row scales, float64: the weights it computes with), split back into q, k, v and gate,
    up, q and k rows back in Hugging Face's order (the engine interleaves each head's halves)."""
    d, f = CONFIG["hidden_size"], CONFIG["intermediate_size"]
    nh, nkv = CONFIG["num_attention_heads"], CONFIG["num_key_value_heads"]
    kv = nkv * d // nh

    def deq(m: torch.nn.Module) -> torch.Tensor:
        return m.qweight.double() * m.scale.double()[:, None]

    def unpermute(a: torch.Tensor, heads: int) -> torch.Tensor:  # rows (heads, hd / 2, 2) -> (heads, 2, hd / 2)
        return a.reshape(heads, a.shape[0] // heads // 2, 2, -1).transpose(1, 2).reshape(a.shape)

    out = dict(weights)
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        q, k, v = deq(layer.qkv).split([d, kv, kv])
        gate, up = deq(layer.gate_up).split([f, f])
        out |= {p + "self_attn.q_proj.weight": unpermute(q, nh), p + "self_attn.k_proj.weight": unpermute(k, nkv),
                p + "self_attn.v_proj.weight": v, p + "self_attn.o_proj.weight": deq(layer.o_proj),
                p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up, p + "mlp.down_proj.weight": deq(layer.down)}
    return out


def assert_top1_only_at_near_ties(got: np.ndarray, exact: np.ndarray, name: str, tie: float = NEAR_TIE) -> None:
    """The margin rule: where `got`'s top token differs from the exact reference's, the
    reference's two best are within `tie` nats (rows are positions, columns the vocabulary)."""
    top2 = np.sort(exact, axis=-1)[:, -2:]
    margin = top2[:, 1] - top2[:, 0]
    differ = got.argmax(-1) != exact.argmax(-1)
    assert np.all(margin[differ] < tie), (
        f"{name}: top-1 differs from the exact reference at positions {np.flatnonzero(differ & (margin >= tie)).tolist()} "
        f"where the reference's margin is {np.round(margin[differ & (margin >= tie)], 3).tolist()} nats")


def test_tied_embeddings_and_int8_weights(tmp_path: Path) -> None:
    """Dense against the float64 reference at 1e-4; INT8 against the float64 reference of its
    own INT8 weights (so what remains is its arithmetic: bf16 activations, 8 significant bits,
    a relative rounding of 2^-9) within 2^-9 of the largest logit, and the margin rule."""
    weights = write_checkpoint(tmp_path, seed=3, tie_word_embeddings=True)
    assert "lm_head.weight" not in weights
    tokens = list(range(5, 30))
    cfg = {"tie_word_embeddings": True}
    for mode in ("dense", "int8"):
        model = load_hf(tmp_path, CPU, torch.float32, weights=mode)
        runner = ModelRunner(model, num_blocks=16, block_size=16, kv_dtype=torch.float32)
        seq = Sequence(0, tokens)
        BlockManager(16, 16).allocate(seq)
        logits, _ = runner.execute([StepItem(seq, 0, len(tokens), True)], all_rows=True)
        ref = reference_logits(weights if mode == "dense" else int8_weights(model, weights), tokens, cfg)
        tol = 1e-4 if mode == "dense" else 2.0**-9 * float(ref.abs().max())
        assert (logits.double() - ref).abs().max() < tol, mode
        assert_top1_only_at_near_ties(torch.log_softmax(logits.double(), -1).numpy(),
                                      torch.log_softmax(ref, -1).numpy(), mode)


def test_int4_linear_matches_its_dequantized_weight() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 128, generator=g).numpy()
    c = quantize_int4(w)
    lin = Int4Linear(torch.from_numpy(c.codes.astype(np.int32)), torch.from_numpy(c.scale), torch.from_numpy(c.zero), 32)
    dq = int4_dequantize(torch.from_numpy(c.codes.astype(np.int32)), torch.from_numpy(c.scale), torch.from_numpy(c.zero), 32)
    assert (dq.numpy() - w).__abs__().max() <= (c.scale.max() / 2) + 1e-6  # min/max rounding error bound
    x = torch.randn(3, 128, generator=g)
    # the layer computes in bf16: compare with a bf16-sized tolerance
    ref = x @ dq.T
    assert (lin(x) - ref).abs().max() < 1e-2 * ref.abs().max()


@pytest.fixture(scope="module")
def requantized(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The starter model requantized by llama.cpp to Q4_0 and Q4_K_M (plus the Q4_1 original)."""
    import llama_cpp

    out = {"q4_1": resolve().path}
    d = tmp_path_factory.mktemp("requant")
    for name, ftype in (("q4_0", llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0), ("q4_k_m", llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M)):
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = ftype
        params.allow_requantize = True
        dst = d / f"{name}.gguf"
        assert llama_cpp.llama_model_quantize(out["q4_1"].encode(), str(dst).encode(), params) == 0
        out[name] = str(dst)
    return out


@pytest.mark.parametrize("variant", ["q4_0", "q4_1", "q4_k_m"])
def test_gguf_int4_codes_are_exact(requantized: dict[str, str], variant: str) -> None:
    t = GGUFTensors(spec_from_gguf(requantized[variant]))
    checked = set()
    for info in t.spec.tensors:
        if info.ggml_type in INT4_TYPES:
            c = t.int4(info.name)
            w = (c.codes.astype(np.float32) - 8) * np.repeat(c.scale, 32, 1) + np.repeat(c.zero, 32, 1)
            ref = t.float32(info.name)
            assert np.allclose(w, ref, rtol=0, atol=1e-6 * float(np.abs(ref).max())), info.name
            checked.add(info.type_name)
    assert checked, "no 4-bit tensors found"
    expected = {"q4_0": "Q4_0", "q4_1": "Q4_1", "q4_k_m": "Q4_K"}[variant]
    assert expected in checked


def _teacher_forced(path: str, weights: str, ids: list[int]) -> tuple[np.ndarray, torch.nn.Module]:
    """Our engine's log-probs (float64) of every next token of `ids`, and the model."""
    model = load_gguf(spec_from_gguf(path), CPU, torch.float32, weights, max_position=1024)
    runner = ModelRunner(model, num_blocks=64, block_size=16, kv_dtype=torch.float32)
    seq = Sequence(0, ids[:-1])
    BlockManager(64, 16).allocate(seq)
    logits, _ = runner.execute([StepItem(seq, 0, len(ids) - 1, True)], all_rows=True)
    return torch.log_softmax(logits.double(), -1).numpy(), model


@pytest.fixture(scope="module")
def starter_references() -> dict:
    """EVAL_TEXT's tokens, llama.cpp's log-probs of them, and the exact ones: the file's
    weights dequantized by gguf-py, float64 throughout (tiny_llama.reference_logits)."""
    from llmlocal.engine import Engine, Plan

    path = resolve().path
    with Engine.load(Plan(model=path, n_ctx=1024, backend="llamacpp")) as cpp:
        ids = cpp.tokenize(EVAL_TEXT)
        llama_cpp = cpp.log_probs(ids)
    w, cfg = gguf_llama_weights(path)
    exact = torch.log_softmax(reference_logits(w, ids[:-1], cfg), -1).numpy()
    return {"path": path, "ids": ids, "llama_cpp": np.asarray(llama_cpp, dtype=np.float64), "exact": exact,
            "weights": w, "config": cfg}


EVAL_TEXT = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk. He carried a small "
    "lamp, a notebook and a thermos of tea. From the gallery he could see the whole bay: the "
    "fishing boats coming home, the gulls circling the harbour, and far out on the horizon the "
    "grey line where the weather was born. He wrote down the wind, the state of the sea and the "
    "names of the ships he recognised. Over forty years the notebooks filled three shelves of "
    "the little house below the tower.\n\n"
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n"
    "\"Are you coming to the market tomorrow?\" asked Maria.\n\"Only if it stops raining,\" said her "
    "brother. \"Last week the stalls were half empty and the bread was gone by nine.\"\n\n"
    "Photosynthesis converts light energy into chemical energy. Plants absorb carbon dioxide "
    "and water, and with the energy of sunlight they produce glucose and release oxygen. The "
    "process takes place in the chloroplasts, which contain the green pigment chlorophyll.\n\n"
    "To bake a simple loaf, mix five hundred grams of flour with a teaspoon of salt, seven grams "
    "of dried yeast and about three hundred millilitres of warm water. Knead the dough for ten "
    "minutes until it is smooth, leave it to rise for an hour, shape it, and bake it in a hot "
    "oven for thirty minutes. The loaf is done when it sounds hollow as you tap its base."
)


@pytest.mark.parametrize("weights", ["dense", "auto"])
def test_starter_top1_agrees_with_llama_cpp(weights: str, starter_references: dict) -> None:
    r = starter_references
    ours, _ = _teacher_forced(r["path"], weights, r["ids"])
    assert len(r["ids"]) - 1 >= 256
    # llama.cpp quantizes activations to 8 bits inside its matmuls, so positions where the
    # top two candidates are nearly tied may differ; >= 95% is the bar.
    agree = float((ours.argmax(-1) == r["llama_cpp"].argmax(-1)).mean())
    assert agree >= 0.95, agree
    # and llama.cpp itself, judged by the exact reference: a differing top-1 only at near ties
    assert_top1_only_at_near_ties(r["llama_cpp"], r["exact"], "llama.cpp", tie=LLAMA_CPP_NEAR_TIE)


AUTO_HEAD_TIES = ("the INT8 output head computes with bf16 activations (torch's _weight_int8pack_mm on "
                  "the CPU): its top-1 differs from the exact reference of its own weights where the "
                  "margin is 0.145 nats (position 11 of EVAL_TEXT)")


@pytest.mark.parametrize("weights", ["dense", pytest.param("auto", marks=pytest.mark.xfail(
    strict=True, raises=AssertionError, reason=AUTO_HEAD_TIES))])
def test_starter_top1_differs_from_the_exact_model_only_at_near_ties(weights: str, starter_references: dict) -> None:
    """Our log-probs against the exact float64 forward of the same weights (for `auto`, the
    file's 4-bit projections and the per-row INT8 embedding it builds from the tied Q8_0 one,
    for the lookup and the head): a differing top-1 only where the reference's two best are
    within 0.1 nats. Dense computes in fp32 (~1e-5 from the reference)."""
    r = starter_references
    ours, model = _teacher_forced(r["path"], weights, r["ids"])
    exact = r["exact"]
    tied = model.embed_int8
    if tied is not None:  # the exact model with those weights
        w = dict(r["weights"], **{"model.embed_tokens.weight": tied.qweight.double() * tied.scale.double()[:, None]})
        exact = torch.log_softmax(reference_logits(w, r["ids"][:-1], r["config"]), -1).numpy()
    if weights == "dense":
        assert np.abs(ours - exact).max() < 1e-3
    assert_top1_only_at_near_ties(ours, exact, weights)


@pytest.mark.parametrize("weights", ["dense", "int8", "auto"])
def test_the_model_builds_on_a_device_other_than_the_cpu(weights: str) -> None:
    """Every buffer the loader makes lands on the model's device: built on PyTorch's `meta`
    device (shapes, no data), a tensor made on the CPU by default fails here as it would on a
    GPU (the rotary table's positions did: the first GPU run could not load a model)."""
    net = load_gguf(resolve(None).spec, torch.device("meta"), torch.bfloat16, weights, max_position=64)
    assert net.device.type == "meta"
    tensors = list(net.parameters()) + list(net.buffers())
    assert tensors and {t.device.type for t in tensors} == {"meta"}
