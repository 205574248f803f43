"""A Hugging Face checkpoint directory -> `ModelSource`, with every check done before writing.

Expected files: ``config.json``; weights as ``model.safetensors`` or shards listed in
``model.safetensors.index.json``; ``tokenizer.json`` (+ ``tokenizer_config.json``,
``generation_config.json`` when present). Only the safetensors headers are read here; the
weights are mapped later, one row range at a time.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import Keys

from llmlocal.models.tensor_names import hf_to_gguf_name, text_config, text_tensor_name

from .encode import decode
from .errors import CheckpointError
from .gguf_writer import KV
from .hf_config import IGNORED_SUFFIXES, LlamaFamilyConfig, parse_config
from .hf_tokenizer import tokenizer_keys
from .safetensors_file import DTYPES, SafetensorsFile, TensorEntry
from .source import ArrayRows, ModelSource, SourceTensor

INDEX = "model.safetensors.index.json"
# GGUF tensors in the order llama.cpp's converter writes them, per block.
_BLOCK_ORDER = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_qkv", "attn_q_norm", "attn_k_norm", "attn_output",
                "post_attention_norm", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down", "post_ffw_norm")


@dataclass(frozen=True)
class _SafetensorsRows:
    file: SafetensorsFile
    entry: TensorEntry

    def rows(self, start: int, stop: int) -> np.ndarray:
        return self.file.rows(self.entry, start, stop)

    def release(self, start: int, stop: int) -> None:
        self.file.release(self.entry, start, stop)


@dataclass(frozen=True)
class _OffsetRows:
    """Rows of a float tensor plus a constant, as float32 (Gemma's norm weights: ``1 + w``)."""

    inner: _SafetensorsRows
    ggml_type: str
    offset: float

    def rows(self, start: int, stop: int) -> np.ndarray:
        return decode(self.inner.rows(start, stop), self.ggml_type) + np.float32(self.offset)

    def release(self, start: int, stop: int) -> None:
        self.inner.release(start, stop)


def _gguf_name(hf_name: str, arch: str = "llama") -> str | None:
    name = hf_to_gguf_name(hf_name, arch)
    if name is None and hf_name.startswith("model.layers.") and hf_name.endswith(".self_attn.o_proj.bias"):
        name = f"blk.{hf_name.split('.')[2]}.attn_output.bias"  # llama's attention_bias=True
    return name


def _weight_files(directory: Path) -> dict[str, list[str]]:
    """Shard file name -> tensor names the index promises in it ([] when there is no index)."""
    index = directory / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            assert isinstance(weight_map, dict)
        except (ValueError, KeyError, TypeError, AssertionError):
            raise CheckpointError(f"{index} is not a valid safetensors index: download it again.") from None
        files: dict[str, list[str]] = {}
        for name, file in weight_map.items():
            files.setdefault(str(file), []).append(name)
        missing = sorted(f for f in files if not (directory / f).is_file())
        if missing:
            raise CheckpointError(
                f"{directory} is missing {missing[0]}"
                + (f" and {len(missing) - 1} more shard(s)" if len(missing) > 1 else "")
                + f" listed in {INDEX}: download the checkpoint completely."
            )
        return files
    if (directory / "model.safetensors").is_file():
        return {"model.safetensors": []}
    # consolidated*.safetensors are Mistral's original-format weights, with other tensor names.
    shards = sorted(p.name for p in directory.glob("*.safetensors") if not p.name.startswith("consolidated"))
    if shards:
        return {name: [] for name in shards}
    if any(directory.glob("*.bin")) or any(directory.glob("*.pt")) or any(directory.glob("*.pth")):
        raise CheckpointError(
            f"{directory} has PyTorch pickle weights only; llmlocal loads safetensors (pickles can run code): "
            "re-save the model with save_pretrained(safe_serialization=True)."
        )
    raise CheckpointError(f"{directory} has no *.safetensors weights: download the model's weight files too.")


def _shape_text(shape: tuple[int, ...]) -> str:
    return "x".join(str(d) for d in shape)


def open_checkpoint(directory: Path, name: str | None = None) -> ModelSource:
    """Open and validate the checkpoint in ``directory``; the caller closes the result."""
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise CheckpointError(
            f"{directory} has no config.json: pass a Hugging Face checkpoint directory (config.json, "
            "*.safetensors, tokenizer.json) or a .gguf file."
        )
    try:
        config: dict[str, Any] = json.loads(config_path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise CheckpointError(f"{config_path} is not valid JSON: download it again.") from None
    config = text_config(config)  # a multimodal checkpoint (Gemma 3 4B and up): its language model
    cfg = parse_config(config, str(directory))
    source = ModelSource(
        kind="checkpoint",
        path=str(directory),
        name=name or directory.name,
        architecture=cfg.architecture,
        metadata=[],
        tensors=[],
        storage_type="F32",
    )
    try:
        _fill(source, directory, config, cfg)
    except BaseException:
        source.close()
        raise
    return source


def _fill(source: ModelSource, directory: Path, config: dict[str, Any], cfg: LlamaFamilyConfig) -> None:
    entries: dict[str, tuple[SafetensorsFile, TensorEntry]] = {}
    skipped = 0
    for file_name, promised in _weight_files(directory).items():
        st = SafetensorsFile(directory / file_name)
        source.on_close(st.close)
        for tensor_name in promised:
            if tensor_name not in st.entries:
                raise CheckpointError(
                    f"{st.path} lacks tensor '{tensor_name}' that {INDEX} places there: the shard is "
                    "incomplete; download it again."
                )
        for tensor_name, entry in st.entries.items():
            text_name = text_tensor_name(tensor_name)
            if text_name is None:  # a vision tower's or projector's: not the language model
                skipped += 1
                continue
            entries[text_name] = (st, entry)

    expected = cfg.expected_shapes()
    for hf_name, (st, entry) in entries.items():
        if hf_name.endswith(IGNORED_SUFFIXES):
            continue
        if hf_name not in expected or _gguf_name(hf_name, cfg.architecture) is None:
            raise CheckpointError(
                f"{st.path} holds tensor '{hf_name}', which a {cfg.model_type} model with this config.json "
                "does not have: the weights and config.json disagree (or the model is not a plain "
                f"{cfg.model_type})."
            )
        if entry.shape != expected[hf_name]:
            raise CheckpointError(
                f"Tensor '{hf_name}' is {_shape_text(entry.shape)} in {Path(st.path).name} but config.json "
                f"implies {_shape_text(expected[hf_name])}: config.json does not belong to these weights."
            )
        if entry.dtype not in DTYPES:
            raise CheckpointError(
                f"Tensor '{hf_name}' is stored as {entry.dtype}, which llmlocal does not convert: use the "
                "model's BF16, F16 or F32 release."
            )
    has_head = "lm_head.weight" in entries
    for hf_name in expected:
        if hf_name not in entries and hf_name != "lm_head.weight":
            raise CheckpointError(
                f"{directory} lacks tensor '{hf_name}' (config.json says {cfg.n_layers} layers): the "
                "checkpoint is incomplete; download it again."
            )

    tensors: dict[str, SourceTensor] = {}
    for gguf_name, array in cfg.extra_tensors().items():
        tensors[gguf_name] = SourceTensor(gguf_name, array.shape, "F32", ArrayRows(array))
    for hf_name, (st, entry) in entries.items():
        if hf_name.endswith(IGNORED_SUFFIXES) or (hf_name == "lm_head.weight" and cfg.tie_embeddings):
            continue
        gguf_name = _gguf_name(hf_name, cfg.architecture)
        assert gguf_name is not None
        shape = entry.shape if len(entry.shape) > 1 else (entry.n_elements,)
        stored_type = DTYPES[entry.dtype][1]
        reader: _SafetensorsRows | _OffsetRows = _SafetensorsRows(st, entry)
        if cfg.adds_to(gguf_name):
            reader, stored_type = _OffsetRows(reader, stored_type, cfg.adds_to(gguf_name)), "F32"
        tensors[gguf_name] = SourceTensor(gguf_name, shape, stored_type, reader, cfg.permute_heads(gguf_name))
    source.tensors = sorted(tensors.values(), key=lambda t: _order(t.name))
    weights = Counter()
    for t in source.tensors:
        if len(t.shape) > 1:
            weights[t.ggml_type] += t.n_elements
    source.storage_type = weights.most_common(1)[0][0] if weights else "F32"

    tok = tokenizer_keys(directory, config, cfg.vocab_size)
    source.metadata = [
        KV.string(Keys.General.ARCHITECTURE, cfg.architecture),
        KV.string(Keys.General.TYPE, "model"),
        KV.string(Keys.General.NAME, source.name),
        KV.string(Keys.General.SIZE_LABEL, _size_label(sum(t.n_elements for t in source.tensors))),
        *_model_card_keys(directory),
        *cfg.metadata(),
        *tok.metadata,
    ]
    source.warnings = tok.warnings
    if skipped:
        source.warnings.append(
            f"the checkpoint's vision tower and projector ({skipped} tensors) are left out: the output is its "
            "language model, which reads text only"
        )
    if cfg.model_type in ("mistral", "phi3") and cfg.sliding_window and cfg.sliding_window < cfg.context_length:
        # The key is written (as llama.cpp's converter does), but llama.cpp's llama and phi3
        # architectures attend to the whole context whatever it says.
        source.warnings.append(
            f"llama.cpp runs {cfg.model_type} without its {cfg.sliding_window}-token sliding window: with more "
            "context than that, its output differs from the original model's"
        )
    if not has_head and not cfg.tie_embeddings:
        source.warnings.append("the checkpoint has no lm_head.weight; the output layer will reuse the token embeddings")


def _size_label(n_params: int) -> str:
    """135M, 1.2B, 7B: the rounded parameter count model names use."""
    if n_params >= 1e9:
        return f"{n_params / 1e9:.1f}".rstrip("0").rstrip(".") + "B"
    return f"{max(1, round(n_params / 1e6))}M"


def _model_card_keys(directory: Path) -> list[KV]:
    """general.license from the model card's front matter (a README.md opening with ---)."""
    readme = directory / "README.md"
    if not readme.is_file():
        return []
    lines = readme.read_text(encoding="utf-8", errors="replace").splitlines()
    if not lines or lines[0].strip() != "---":
        return []
    for line in lines[1:200]:
        if line.strip() == "---":
            break
        key, _, value = line.partition(":")
        if key.strip() == "license" and value.strip():
            return [KV.string(Keys.General.LICENSE, value.strip().strip("'\""))]
    return []


def _order(gguf_name: str) -> tuple[int, int, str]:
    """rope_freqs / rope_factors_*, token_embd, blocks in order (each in `_BLOCK_ORDER`), output_norm, output."""
    if gguf_name.startswith("blk."):
        _, layer, kind, _ = gguf_name.split(".", 3)
        rank = _BLOCK_ORDER.index(kind) if kind in _BLOCK_ORDER else len(_BLOCK_ORDER)
        return (1, int(layer) * 100 + rank, gguf_name)
    head = {"rope_freqs.weight": -4, "rope_factors_long.weight": -3, "rope_factors_short.weight": -2,
            "token_embd.weight": -1}
    if gguf_name in head:
        return (0, head[gguf_name], gguf_name)
    return (2, 0, gguf_name)
