"""The planner's choices on invented machines, for real model shapes.

Model files are written out tensor by tensor: the published shapes (layers, heads, KV heads,
dimensions, vocabulary) and llama.cpp's quant mixtures (Q4_K_M keeps the output in Q6_K, and
attn_v / ffn_down in Q6_K on the layers `use_more_bits` picks), sized with the GGUF block
sizes. The totals match the published files: Llama-3.1-8B Q4_K_M 4.91 GB, Q8_0 8.53 GB;
Qwen2-7B Q4_K_M 4.68 GB; Llama-3.1-70B Q4_K_M 42.5 GB (checked below).
"""

from __future__ import annotations

import json

import pytest
from llmlocal.engine import Plan
from llmlocal.engine.planning.hardware import GPU, Hardware
from llmlocal.engine.planning.memory_model import estimate
from llmlocal.engine.planning.planner import NothingFitsError, Pins, choose, usable_budget
from llmlocal.models import ModelSpec, TensorInfo
from llmlocal.models.sizes import format_size
from llmlocal.models.spec import SpecialTokens

GIB = 1 << 30
# ggml type: (id, values per block, bytes per block)
TYPES = {
    "F32": (0, 1, 4),
    "F16": (1, 1, 2),
    "Q4_1": (3, 32, 20),  # fp16 d, fp16 m, 16 bytes of nibbles
    "Q8_0": (8, 32, 34),  # fp16 d, 32 int8
    "Q4_K": (12, 256, 144),  # fp16 d, dmin, 12 bytes of 6-bit scales, 128 bytes of nibbles
    "Q5_K": (13, 256, 176),
    "Q6_K": (14, 256, 210),
}


def _more_bits(i: int, n: int) -> bool:
    """llama.cpp's use_more_bits: the first and last eighth of the layers, and every third."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def model(
    name: str, layers: int, d: int, heads: int, kv_heads: int, ffn: int, vocab: int, ctx: int, ftype: str,
    tied: bool = False, bias: bool = False, arch: str = "llama", v_q5k: bool = False,
) -> ModelSpec:
    """A ModelSpec with every tensor of a llama-family GGUF of this shape and file type."""
    head_dim = d // heads
    base = {"Q4_K_M": "Q4_K", "Q8_0": "Q8_0", "F16": "F16", "Q4_1": "Q4_1"}[ftype]
    tensors: list[tuple[str, tuple[int, ...], str]] = []

    def w(n: str, k: int, rows: int, t: str) -> None:
        tensors.append((n, (k, rows), t))  # GGUF order: inputs (fastest) first

    w("token_embd.weight", d, vocab, "Q8_0" if ftype == "Q4_1" else base)
    if not tied:
        w("output.weight", d, vocab, "Q6_K" if ftype == "Q4_K_M" else base)
    tensors.append(("output_norm.weight", (d,), "F32"))
    for i in range(layers):
        b = f"blk.{i}."
        k4m = ftype == "Q4_K_M"
        v_type = ("Q6_K" if _more_bits(i, layers) else ("Q5_K" if v_q5k else "Q4_K")) if k4m else base
        down_type = ("Q6_K" if _more_bits(i, layers) else "Q4_K") if k4m else base
        tensors += [(b + "attn_norm.weight", (d,), "F32"), (b + "ffn_norm.weight", (d,), "F32")]
        w(b + "attn_q.weight", d, heads * head_dim, base)
        w(b + "attn_k.weight", d, kv_heads * head_dim, base)
        w(b + "attn_v.weight", d, kv_heads * head_dim, v_type)
        w(b + "attn_output.weight", heads * head_dim, d, base)
        w(b + "ffn_gate.weight", d, ffn, base)
        w(b + "ffn_up.weight", d, ffn, base)
        w(b + "ffn_down.weight", ffn, d, down_type)
        if bias:
            tensors += [(b + "attn_q.bias", (heads * head_dim,), "F32"), (b + "attn_k.bias", (kv_heads * head_dim,), "F32"),
                        (b + "attn_v.bias", (kv_heads * head_dim,), "F32")]
    infos, offset = [], 0
    for n, shape, t in tensors:
        type_id, block, nbytes = TYPES[t]
        elements = shape[0] * (shape[1] if len(shape) > 1 else 1)
        size = elements // block * nbytes
        infos.append(TensorInfo(n, shape, type_id, offset, size))
        offset += size
    return ModelSpec(
        path=f"/models/{name}-{ftype}.gguf", format="gguf", name=name, architecture=arch, n_layers=layers,
        d_model=d, n_heads=heads, n_kv_heads=kv_heads, head_dim=head_dim, d_ffn=ffn, vocab_size=vocab,
        context_length=ctx, rope_freq_base=500000.0, norm_eps=1e-5, file_type=ftype, tensors=tuple(infos),
        chat_template=None, special=SpecialTokens(), tokenizer_model="gpt2",
    )


def llama_8b(ftype: str) -> ModelSpec:
    return model("Llama-3.1-8B", 32, 4096, 32, 8, 14336, 128256, 131072, ftype)


def qwen2_7b(ftype: str) -> ModelSpec:
    return model("Qwen2-7B", 28, 3584, 28, 4, 18944, 152064, 32768, ftype, bias=True, arch="qwen2")


def llama_70b(ftype: str) -> ModelSpec:
    # llama.cpp gives the 70B's attn_v Q5_K where other sizes get Q4_K (8 heads share it)
    return model("Llama-3.1-70B", 80, 8192, 64, 8, 28672, 128256, 131072, ftype, v_q5k=True)


def smollm2() -> ModelSpec:
    return model("SmolLM2-135M", 30, 576, 9, 3, 1536, 49152, 8192, "Q4_1", tied=True)


AVX2 = frozenset({"avx", "avx2", "fma", "f16c"})
LAPTOP_8GB = Hardware(total_ram=8 * GIB, available_ram=int(5.5 * GIB), physical_cores=4, simd=AVX2)
DESKTOP_6GB_GPU = Hardware(
    total_ram=16 * GIB, available_ram=12 * GIB, physical_cores=8, simd=AVX2,
    gpus=(GPU(0, "RTX 3060 Laptop", 6 * GIB, int(5.6 * GIB), 300 << 20),), llamacpp_gpu=True,
)
WORKSTATION_24GB_GPU = Hardware(
    total_ram=64 * GIB, available_ram=56 * GIB, physical_cores=16, simd=AVX2,
    gpus=(GPU(0, "RTX 4090", 24 * GIB, int(23.5 * GIB), 400 << 20),), llamacpp_gpu=True,
)
H100_80GB = Hardware(
    total_ram=256 * GIB, available_ram=240 * GIB, physical_cores=32, simd=AVX2 | {"avx512f"},
    gpus=(GPU(0, "H100 80GB", 80 * GIB, 79 * GIB, 500 << 20),), llamacpp_gpu=True,
)


def test_shapes_match_published_file_sizes() -> None:
    assert llama_8b("Q4_K_M").weight_bytes == pytest.approx(4.92e9, rel=0.01)
    assert llama_8b("Q8_0").weight_bytes == pytest.approx(8.54e9, rel=0.01)
    assert qwen2_7b("Q4_K_M").weight_bytes == pytest.approx(4.68e9, rel=0.01)
    assert llama_70b("Q4_K_M").weight_bytes == pytest.approx(42.5e9, rel=0.01)
    assert smollm2().weight_bytes == 96_576_768  # the bundled starter file's tensor bytes, to the byte


def _reasons(choice) -> str:
    return "\n".join(choice.reasons)


def test_laptop_runs_the_starter_on_llamacpp_at_its_full_context() -> None:
    c = choose([smollm2()], LAPTOP_8GB)
    assert (c.plan.backend, c.plan.device, c.plan.gpu_layers, c.plan.n_ctx, c.chosen.quant) == ("llamacpp", "cpu", 0, 8192, "Q4_1")
    assert c.plan.kv_dtype == "f16"
    assert "no GPU found" in _reasons(c) and "context 8192: the model's maximum" in _reasons(c)
    # the paged engine fits too, and loses on the backend preference only
    assert c.alternatives[0].plan.backend == "paged"
    assert "runner-up: paged on the CPU" in _reasons(c) and "lost on the backend not preferred" in _reasons(c)


def test_on_avx2_the_disk_kv_cache_tips_the_starter_to_the_paged_engine_and_says_why(tmp_path) -> None:
    """On AVX2 the native kernels decode at parity with llama.cpp: with the prefix cache's disk
    tier on (what chat, run and serve keep by default), `auto` takes the paged engine, whose
    cache saves whole prefills; with --no-kv-cache llama.cpp, which loads sooner."""
    cached = choose([smollm2()], LAPTOP_8GB, base=Plan(kv_cache_dir=str(tmp_path)))
    assert (cached.plan.backend, cached.plan.device) == ("paged", "cpu")
    assert "paged: on AVX2 llmlocal's own kernels decode this file at least as fast as llama.cpp" in _reasons(cached)
    assert "never prefilled twice" in _reasons(cached) and "--no-kv-cache" in _reasons(cached)
    off = choose([smollm2()], LAPTOP_8GB, base=Plan(kv_cache_dir=None))
    assert off.plan.backend == "llamacpp" and "the disk KV cache that makes them worth it is off" in _reasons(off)
    # without AVX2 (FMA, F16C) the kernels' portable path decodes slower: llama.cpp either way
    old = Hardware(total_ram=8 * GIB, available_ram=int(5.5 * GIB), physical_cores=4, simd=frozenset({"sse3", "ssse3", "avx"}))
    slow = choose([smollm2()], old, base=Plan(kv_cache_dir=str(tmp_path)))
    assert slow.plan.backend == "llamacpp" and "decode this file slower" in _reasons(slow)
    # a type the native kernels do not read keeps llama.cpp
    f16 = model("SmolLM2-135M", 30, 576, 9, 3, 1536, 49152, 8192, "F16", tied=True)
    assert choose([f16], LAPTOP_8GB, base=Plan(kv_cache_dir=str(tmp_path))).plan.backend == "llamacpp"


def test_a_cpu_with_avx512_vnni_runs_the_starter_in_the_paged_engine_and_says_why() -> None:
    """Where llmlocal's native kernels were measured faster than llama.cpp (AVX512-VNNI), a file
    they run whole goes to the paged engine; on AVX2 alone (above) to llama.cpp, with the reason."""
    vnni = Hardware(total_ram=8 * GIB, available_ram=int(5.5 * GIB), physical_cores=4,
                    simd=AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"})
    c = choose([smollm2()], vnni)
    assert (c.plan.backend, c.plan.device, c.plan.n_ctx) == ("paged", "cpu", 8192)
    assert "paged: llmlocal's own kernels decode this file's types faster than llama.cpp on a CPU with AVX512-VNNI" in _reasons(c)
    assert "runner-up: llamacpp on the CPU" in _reasons(c) and "lost on the backend not preferred" in _reasons(c)
    avx2 = choose([smollm2()], LAPTOP_8GB)
    assert avx2.plan.backend == "llamacpp" and "llamacpp: on a CPU without AVX512-VNNI" in _reasons(avx2)
    # a pinned backend needs no reason; a type the native kernels do not read keeps llama.cpp
    pinned = choose([smollm2()], vnni, Pins(backend="llamacpp"))
    assert pinned.plan.backend == "llamacpp" and "AVX512-VNNI" not in _reasons(pinned)
    f16 = model("SmolLM2-135M", 30, 576, 9, 3, 1536, 49152, 8192, "F16", tied=True)
    assert choose([f16], vnni).plan.backend == "llamacpp"


def test_a_calibrated_file_runs_densely_where_skipping_does_not_pay() -> None:
    """A file with sparsity thresholds runs on the dense engines, at full quality: on every CPU
    measured the dense int8 kernels decode it faster than the sparse backend (native_support.
    sparse_pays), a 4-bit file and a K-quant mix alike: the paged engine where its kernels are
    faster than llama.cpp (AVX512-VNNI), else llama.cpp. `--backend sparse` still runs it."""
    import dataclasses

    from llmlocal.engine.planning.plan_search import BACKENDS
    from llmlocal.models.spec import SPARSITY_PROJECTIONS, SparsitySpec

    sparsity = SparsitySpec(level=0.6, thresholds={p: (0.1,) * 32 for p in SPARSITY_PROJECTIONS}, calibration_tokens=100)
    vnni = Hardware(total_ram=8 * GIB, available_ram=int(5.5 * GIB), physical_cores=4,
                    simd=AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"})
    backends = (*BACKENDS, "sparse")
    four_bit = dataclasses.replace(smollm2(), sparsity=sparsity)
    mix = dataclasses.replace(model("SmolLM2-135M", 30, 576, 9, 3, 1536, 49152, 8192, "Q4_K_M", tied=True), sparsity=sparsity)
    for spec in (four_bit, mix):
        assert choose([spec], vnni, backends=backends).plan.backend == "paged"
        assert choose([spec], LAPTOP_8GB, backends=backends).plan.backend == "llamacpp"
        avx512 = dataclasses.replace(vnni, simd=AVX2 | {"avx512f", "avx512bw", "avx512vl"})
        assert choose([spec], avx512, backends=backends).plan.backend != "sparse"


def test_laptop_takes_q4_k_m_of_llama_8b_and_shortens_the_context() -> None:
    c = choose([llama_8b("Q4_K_M"), llama_8b("Q8_0")], LAPTOP_8GB)
    # Q8_0 (8.5 GB) cannot fit 5.5 GB; Q4_K_M fits at 4096, not at 8192: in the paged engine with
    # an f16 KV cache (its prefill's activations are small since the MLP's activation is made
    # inside the gate/up projection), in llama.cpp only with a q8_0 one
    assert (c.plan.backend, c.plan.gpu_layers, c.plan.n_ctx, c.chosen.quant, c.plan.kv_dtype) == ("paged", 0, 4096, "Q4_K_M", "auto")
    assert "context 4096: the longest that fits (the default 8192 does not)" in _reasons(c)
    assert "runner-up: llamacpp on the CPU, Q4_K_M, context 4096, KV q8_0" in _reasons(c)
    assert "quant Q4_K_M" in _reasons(c)
    (cpu,) = c.chosen.devices
    assert cpu.need <= usable_budget(LAPTOP_8GB.available_ram)
    # the paged engine keeps the file's bytes in its own layout: nothing of it is reclaimable
    assert cpu.reclaimable == 0 and cpu.total == cpu.need
    llamacpp = choose([llama_8b("Q4_K_M")], LAPTOP_8GB, backends=("llamacpp",))
    # Q4_K is repacked on AVX2: the second copy is counted, the cold mapped pages are not needed
    (cpu,) = llamacpp.chosen.devices
    assert llamacpp.plan.kv_dtype == "q8_0" and cpu.reclaimable > 3 * GIB and cpu.total - cpu.reclaimable == cpu.need


def test_laptop_reaches_the_default_context_with_qwen2_thanks_to_its_4_kv_heads() -> None:
    c = choose([qwen2_7b("Q4_K_M")], LAPTOP_8GB)
    # the paged engine keeps the file's bytes (int8 activations for a Q4_K_M mix): its f16 KV
    # fits beside them, where llama.cpp's plan of the same context needs q8_0
    assert (c.plan.backend, c.plan.n_ctx, c.plan.kv_dtype) == ("paged", 8192, "auto")
    assert "the default (the model takes up to 32768: pass --ctx for more)" in _reasons(c)
    assert "runner-up: llamacpp on the CPU, Q4_K_M, context 8192, KV q8_0" in _reasons(c)


def test_nothing_fits_is_one_sentence_with_the_numbers_and_a_fix() -> None:
    with pytest.raises(NothingFitsError) as e:
        choose([llama_70b("Q4_K_M")], LAPTOP_8GB)
    msg = str(e.value)
    assert msg.count(". ") == 0 and msg.endswith(".")
    # the closest configuration: either engine at context 512 with its smallest KV cache
    smallest = min(estimate(llama_70b("Q4_K_M"), Plan(backend=b, device="cpu", n_ctx=512, kv_dtype="q8_0", kv_blocks=32), AVX2)[0].need
                   for b in ("llamacpp", "paged"))
    assert f"needs {format_size(smallest)} on cpu at context 512" in msg and "5.5 GiB is free" in msg
    assert "use a smaller model, or a smaller quant than Q4_K_M" in msg
    with pytest.raises(NothingFitsError, match="use a smaller quant such as q4_k_m"):
        choose([llama_70b("Q8_0")], LAPTOP_8GB)


def test_a_pinned_context_that_does_not_fit_names_the_context_that_does() -> None:
    with pytest.raises(NothingFitsError) as e:
        choose([llama_8b("Q4_K_M")], LAPTOP_8GB, Pins(n_ctx=32768))
    assert "at context 32768" in str(e.value) and str(e.value).endswith("use --ctx 4096.")


def test_6gb_gpu_holds_every_layer_of_llama_8b_at_a_shorter_context() -> None:
    c = choose([llama_8b("Q4_K_M"), llama_8b("Q8_0")], DESKTOP_6GB_GPU)
    # every layer on the GPU outranks the default context: 4096 with a q8_0 cache
    assert (c.plan.backend, c.plan.device, c.plan.gpu_layers, c.plan.n_ctx, c.chosen.quant) == ("llamacpp", "cuda", 33, 4096, "Q4_K_M")
    assert "every layer fits on the GPU" in _reasons(c)
    cpu, gpu = c.chosen.devices
    assert gpu.device == "cuda:0" and gpu.need <= usable_budget(DESKTOP_6GB_GPU.gpus[0].free_bytes)
    assert cpu.need < 1 * GIB  # the embedding stays on the CPU; offloaded layers are cold mapped pages
    # the paged engine cannot hold this model on 6 GB: its Q6_K tensors become bf16
    assert all(a.plan.backend == "llamacpp" for a in c.alternatives)


def test_6gb_gpu_with_pinned_gpu_layers_keeps_the_context_at_the_default() -> None:
    c = choose([llama_8b("Q4_K_M")], DESKTOP_6GB_GPU, Pins(gpu_layers=20))
    assert (c.plan.backend, c.plan.gpu_layers, c.plan.n_ctx) == ("llamacpp", 20, 8192)
    assert "20 of 32 layers on the GPU: as asked with --gpu-layers" in _reasons(c)
    cpu, gpu = c.chosen.devices
    assert cpu.kv > 0 and gpu.kv > 0  # 12 layers' KV in RAM, 20 on the GPU


def test_partial_offload_when_the_model_does_not_fit_the_gpu() -> None:
    small_gpu = Hardware(
        total_ram=32 * GIB, available_ram=24 * GIB, physical_cores=8, simd=AVX2,
        gpus=(GPU(0, "GTX 1650", 4 * GIB, int(3.8 * GIB), 0),), llamacpp_gpu=True,
    )
    c = choose([llama_8b("Q8_0")], small_gpu)
    assert c.plan.backend == "llamacpp" and 0 < c.plan.gpu_layers < 32
    assert c.plan.n_ctx == 8192
    assert f"only {c.plan.gpu_layers} of 32 layers fit on the GPU" in _reasons(c)
    # the most that fit: one more layer would not
    _, gpu = estimate(llama_8b("Q8_0"), c.plan.replace(gpu_layers=c.plan.gpu_layers + 1), AVX2)
    assert gpu.need > usable_budget(small_gpu.gpus[0].free_bytes) >= c.chosen.devices[1].need


def test_24gb_gpu_takes_the_f16_model_and_a_long_context() -> None:
    c = choose([llama_8b("Q4_K_M"), llama_8b("Q8_0"), llama_8b("F16")], WORKSTATION_24GB_GPU)
    assert (c.plan.backend, c.plan.gpu_layers, c.chosen.quant) == ("llamacpp", 33, "F16")
    assert c.plan.n_ctx == 65536 and c.plan.kv_dtype == "q8_0"
    assert "quant F16 (16.0 bits/weight): the highest quality that fits" in _reasons(c)
    assert "context 65536: the longest that fits" in _reasons(c)


def test_24gb_gpu_runs_qwen2_q8_0_in_the_paged_engine_at_its_maximum_context() -> None:
    c = choose([qwen2_7b("Q4_K_M"), qwen2_7b("Q8_0")], WORKSTATION_24GB_GPU)
    assert (c.plan.backend, c.plan.device, c.chosen.quant, c.plan.n_ctx) == ("paged", "cuda", "Q8_0", 32768)
    assert "context 32768: the model's maximum" in _reasons(c)
    assert "runner-up: llamacpp all layers on the GPU, Q8_0, context 32768" in _reasons(c)


def test_80gb_gpu_holds_llama_70b_q8_0() -> None:
    c = choose([llama_70b("Q4_K_M"), llama_70b("Q8_0")], H100_80GB)
    assert (c.plan.backend, c.plan.gpu_layers, c.chosen.quant, c.plan.n_ctx, c.plan.kv_dtype) == ("llamacpp", 81, "Q8_0", 32768, "q8_0")
    _, gpu = c.chosen.devices
    spec = c.chosen.spec
    embedding = next(t.n_bytes for t in spec.tensors if t.name == "token_embd.weight")
    assert gpu.weights == spec.weight_bytes - embedding  # the embedding lookup stays on the CPU


def test_80gb_gpu_gives_llama_8b_its_whole_context_in_the_paged_engine() -> None:
    c = choose([llama_8b("Q4_K_M"), llama_8b("F16")], H100_80GB)
    assert (c.plan.backend, c.plan.device, c.chosen.quant, c.plan.n_ctx) == ("paged", "cuda", "F16", 131072)
    assert c.plan.kv_blocks == 131072 // 16  # one full window


def test_pinned_backend_and_device_are_kept() -> None:
    c = choose([smollm2()], WORKSTATION_24GB_GPU, Pins(backend="llamacpp"))
    assert (c.plan.backend, c.plan.device, c.plan.gpu_layers) == ("llamacpp", "cuda", 31)
    c = choose([smollm2()], WORKSTATION_24GB_GPU, Pins(device="cpu"))
    assert (c.plan.backend, c.plan.device) == ("llamacpp", "cpu")
    c = choose([smollm2()], LAPTOP_8GB, Pins(backend="paged", n_ctx=2048))
    assert (c.plan.backend, c.plan.n_ctx, c.plan.kv_blocks) == ("paged", 2048, 4 * 2048 // 16)


def test_a_draft_model_is_counted_and_chosen_when_it_fits() -> None:
    draft = model("Llama-3.2-1B", 16, 2048, 32, 8, 8192, 128256, 131072, "Q8_0", tied=True)
    base = Plan(model="llama-8b")
    without = choose([llama_8b("Q4_K_M")], H100_80GB, Pins(backend="paged", n_ctx=8192), base)
    with_draft = choose([llama_8b("Q4_K_M")], H100_80GB, Pins(backend="paged", n_ctx=8192), base, draft=draft)
    assert with_draft.plan.draft == draft.path and without.plan.draft is None
    extra = with_draft.chosen.devices[1].weights - without.chosen.devices[1].weights
    assert 1.5 * GIB < extra < 2.5 * GIB  # the draft's bf16 weights and INT8 head


def test_a_cpu_draft_is_counted_as_it_loads_its_wider_tensors_as_q4_0() -> None:
    # its Q8_0 projections and head (34 bytes a 32 weights) as Q4_0 (18), unless kept as stored
    draft = model("Llama-3.2-1B", 16, 2048, 32, 8, 8192, 128256, 131072, "Q8_0", tied=False)
    pins = Pins(backend="paged", device="cpu", n_ctx=2048)
    weights = {}
    for mode in ("auto", "file"):
        c = choose([llama_8b("Q4_K_M")], WORKSTATION_24GB_GPU, pins, Plan(model="llama-8b", draft_weights=mode), draft=draft)
        assert c.plan.draft == draft.path and c.plan.draft_weights == mode
        weights[mode] = c.chosen.devices[0].weights
    projections = sum(t.n_elements for t in draft.tensors if t.name.endswith(".weight") and t.name != "token_embd.weight"
                      and len(t.shape) == 2)
    assert weights["file"] - weights["auto"] == pytest.approx(projections // 32 * 16, rel=0.01)


def test_json_has_the_documented_keys() -> None:
    c = choose([llama_8b("Q4_K_M")], DESKTOP_6GB_GPU)
    out = json.loads(json.dumps(c.to_dict()))
    for key in ("backend", "device", "gpu_layers", "n_ctx", "kv_dtype", "quant", "draft", "predicted_bytes", "budget_bytes", "reasons", "alternatives"):
        assert key in out
    assert set(out["predicted_bytes"]) == {"cpu", "cuda:0"}
    for part in ("weights", "kv", "compute", "overhead", "total"):
        assert out["predicted_bytes"]["cuda:0"][part] >= 0
    assert out["budget_bytes"]["cuda:0"] == DESKTOP_6GB_GPU.gpus[0].free_bytes
    one = choose([smollm2()], LAPTOP_8GB).to_dict()
    assert isinstance(one["predicted_bytes"]["total"], int) and one["budget_bytes"] == LAPTOP_8GB.available_ram


# ---- the memory model's arithmetic ----------------------------------------------------------
def test_kv_cache_bytes() -> None:
    spec = llama_8b("Q4_K_M")
    (cpu,) = estimate(spec, Plan(backend="llamacpp", device="cpu", n_ctx=8192, kv_dtype="f16"), AVX2)
    assert cpu.kv == 2 * 32 * 8 * 128 * 2 * 8192 == GIB  # K and V, layers, KV heads, head dim, f16
    (q8,) = estimate(spec, Plan(backend="llamacpp", device="cpu", n_ctx=8192, kv_dtype="q8_0"), AVX2)
    assert q8.kv == GIB * 34 // 64  # 34 bytes per 32 values
    (padded,) = estimate(spec, Plan(backend="llamacpp", device="cpu", n_ctx=1000, kv_dtype="f16"), AVX2)
    assert padded.kv == 1024 * 131072  # llama.cpp pads the context to a multiple of 256
    (paged,) = estimate(spec, Plan(backend="paged", device="cpu", n_ctx=1000, kv_blocks=100), AVX2)
    assert paged.kv == 100 * 16 * 2 * 32 * 8 * 128 * 2  # the pool, fp16 on a CPU by default
    (f32,) = estimate(spec, Plan(backend="paged", device="cpu", n_ctx=1000, kv_blocks=100, kv_dtype="f32"), AVX2)
    assert f32.kv == 2 * paged.kv
    # int8 values and an fp16 scale per 32: 136 bytes a head row instead of 256
    (q8,) = estimate(spec, Plan(backend="paged", device="cpu", n_ctx=1000, kv_blocks=100, kv_dtype="q8_0"), AVX2)
    assert q8.kv == 100 * 16 * 2 * 32 * 8 * (128 + 8)


def test_paged_q8_0_fits_twice_the_context_of_f16_in_the_same_memory_and_says_so() -> None:
    """Qwen2.5-Coder-1.5B's shape in the paged engine on a machine whose memory holds its f16 KV
    cache for 4096 tokens and not for 8192: the planner keeps the default 8192 with q8_0."""
    spec = model("Qwen2.5-Coder-1.5B", 28, 1536, 12, 2, 8960, 151936, 32768, "Q4_K_M", tied=True, bias=True, arch="qwen2")
    one_slot = lambda n, kv: Plan(backend="paged", device="cpu", n_ctx=n, kv_blocks=n // 16, kv_dtype=kv)  # noqa: E731
    (f16_8k,) = estimate(spec, one_slot(8192, "auto"), AVX2)
    (q8_8k,) = estimate(spec, one_slot(8192, "q8_0"), AVX2)
    (q8_16k,) = estimate(spec, one_slot(16384, "q8_0"), AVX2)
    assert q8_16k.kv == f16_8k.kv * 136 // 128  # twice the tokens in 6% more bytes
    available = q8_8k.need
    while usable_budget(available) < q8_8k.need:
        available += 1 << 20
    assert usable_budget(available) < f16_8k.need
    hw = Hardware(total_ram=8 * GIB, available_ram=available, physical_cores=4, simd=AVX2)
    c = choose([spec], hw, Pins(backend="paged"))
    assert (c.plan.backend, c.plan.n_ctx, c.plan.kv_dtype, c.plan.kv_blocks) == ("paged", 8192, "q8_0", 8192 // 16)
    assert "KV cache in q8_0 (int8 with a scale per 32 values: 1.88x the tokens of f16 in the same memory): " \
           "f16 fits a context of 4096 at most" in _reasons(c)
    # where f16 fits, it is kept
    roomy = Hardware(total_ram=8 * GIB, available_ram=available + 2 * GIB, physical_cores=4, simd=AVX2)
    assert choose([spec], roomy, Pins(backend="paged")).plan.kv_dtype == "auto"


def test_llamacpp_repacked_weights_count_twice_in_rss_once_in_the_need() -> None:
    spec = llama_8b("Q4_K_M")
    plan = Plan(backend="llamacpp", device="cpu", n_ctx=4096, kv_dtype="f16")
    (avx2,) = estimate(spec, plan, AVX2)
    (plain,) = estimate(spec, plan, frozenset())  # no AVX2: nothing is repacked
    q4k_in_layers = sum(t.n_bytes for t in spec.tensors if t.ggml_type == 12 and t.name.startswith("blk."))
    assert plain.weights == spec.weight_bytes and plain.reclaimable == 0
    assert avx2.weights == spec.weight_bytes + q4k_in_layers  # the interleaved copy of every Q4_K matmul
    assert avx2.reclaimable == q4k_in_layers  # their mapped pages go cold
    assert avx2.need == plain.need


@pytest.mark.parametrize("acts", ["int8", "fp32"])
def test_paged_keeps_the_file_bytes_or_fuses_into_int4_by_activations(acts: str, monkeypatch) -> None:
    """On a CPU with int8 activations (a Q4_K_M mix's default) every projection keeps the file's
    bytes (the native kernels read each type as it is); with fp32 activations a projection
    whose parts are all 4-bit runs as INT4 (codes and fp32 scales) and one with a Q6_K part
    keeps the file's bytes. The Q6_K head and the Q4_K embedding keep theirs either way (token
    rows are read from the mapped file)."""
    monkeypatch.setenv("LLMLOCAL_NATIVE_ACTIVATIONS", acts)
    spec = llama_8b("Q4_K_M")  # layer 0: attn_v and ffn_down are Q6_K (use_more_bits)
    plan = Plan(backend="paged", device="cpu", n_ctx=512, kv_blocks=32)
    (m,) = estimate(spec, plan)
    t = {x.name: x.n_bytes for x in spec.tensors}
    d, kv, ffn = 4096, 1024, 14336
    if acts == "int8":
        layers = sum(n for name, n in t.items() if name.startswith("blk.") and not name.endswith("norm.weight"))
        layers += 32 * 2 * d * 4
    else:
        int4 = lambda n, k: n * k // 2 + (k // 32) * n * 4
        layers = sum(
            (int4(d + 2 * kv, d) if not _more_bits(i, 32) else sum(t[f"blk.{i}.attn_{p}.weight"] for p in "qkv"))  # q|k|v
            + int4(d, d) + int4(2 * ffn, d)  # o, gate|up
            + (int4(d, ffn) if not _more_bits(i, 32) else t[f"blk.{i}.ffn_down.weight"])  # down
            + 2 * d * 4
            for i in range(32)
        )
    head = t["output.weight"]  # Q6_K, as in the file
    # untied: rows read from the file's Q4_K bytes, resident only as a context touches them
    # (the loader lets the file's pages go: GGUFTensors.release_pages), two pages a token at most
    embed = min(t["token_embd.weight"], 512 * 8192)
    rope = 512 * 64 * 8
    assert m.weights == layers + d * 4 + head + embed + rope
    assert _more_bits(0, 32) and t["blk.0.attn_v.weight"] > t["blk.0.attn_k.weight"]  # the Q6_K part is in layer 0


def test_partial_offload_moves_bytes_from_cpu_to_gpu() -> None:
    spec = qwen2_7b("Q8_0")
    needs = []
    for g in (0, 10, 28, 29):
        plan = Plan(backend="llamacpp", device="cuda", n_ctx=4096, kv_dtype="f16", gpu_layers=g)
        devices = estimate(spec, plan, AVX2)
        needs.append((devices[0].need, devices[1].need if len(devices) > 1 else 0))
    cpu, gpu = zip(*needs)
    assert list(cpu) == sorted(cpu, reverse=True) and list(gpu) == sorted(gpu)
    assert gpu[0] == 0 and cpu[-1] < 0.1 * cpu[0]


def test_a_load_that_maps_packed_weights_is_planned_without_the_files_pages(tmp_path, monkeypatch) -> None:
    """Once a load has kept the starter's packed weights (int8 activations: they are packed),
    the paged plan's load peak leaves out the file pages packing holds; another directory, or
    none, keeps them in."""
    from llmlocal.engine import Engine
    from llmlocal.models import resolve
    from llmlocal.native.cpu import runtime
    from llmlocal.native.cpu.packed_cache import wait_for_writers

    if not runtime.built():
        pytest.skip("the native extension is not built")
    monkeypatch.setenv("LLMLOCAL_NATIVE_ACTIVATIONS", "int8")
    spec = resolve().spec
    plan = Plan(backend="paged", device="cpu", n_ctx=512, threads=2)

    def peak(directory) -> int:
        [cpu] = estimate(spec, plan.replace(packed_cache_dir=str(directory) if directory else None))
        return cpu.load_peak

    before = peak(tmp_path)
    with Engine.load(plan.replace(packed_cache_dir=str(tmp_path))):
        pass
    wait_for_writers()
    assert any(tmp_path.iterdir())
    assert peak(None) == before == peak(tmp_path / "other") > peak(tmp_path) > 0
