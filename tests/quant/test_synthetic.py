"""Random-weight GGUFs of real shapes load in llama.cpp and in llmlocal's header reader."""

from __future__ import annotations

from llmlocal.models import resolve
from llmlocal.quant.synthetic import SHAPES, random_gguf


def test_random_gguf_has_the_shape_and_runs_in_llamacpp(tmp_path):
    path = random_gguf(tmp_path / "small.gguf", shape="smollm2-135m", qtype="q4_0")
    spec = resolve(str(path)).spec
    s = SHAPES["smollm2-135m"]
    assert (spec.n_layers, spec.d_model, spec.n_heads, spec.n_kv_heads, spec.vocab_size) == (
        s.layers, s.dim, s.heads, s.kv_heads, s.vocab)
    assert spec.tensor_types.get("Q4_0", 0) > 0

    from llmlocal.engine.backends.llamacpp import open_llama

    llm = open_llama(model_path=str(path), n_ctx=64, verbose=False)
    out = llm.create_completion("Hello", max_tokens=4, temperature=0.0)
    assert out["usage"]["completion_tokens"] == 4
    llm.close()
