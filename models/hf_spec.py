"""`ModelSpec` of a Hugging Face checkpoint directory, from config.json, the safetensors
headers and the tokenizer files — no weights are read."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

from .errors import ModelFormatError
from .gguf_header import TensorInfo
from .spec import ModelSpec, SpecialTokens
from .tensor_names import text_config, text_tensor_name

# safetensors dtype -> (ggml type id, bytes per element), for the memory arithmetic
_DTYPES = {"F32": (0, 4), "F16": (1, 2), "BF16": (30, 2), "I8": (24, 1), "U8": (24, 1), "F64": (28, 8), "I32": (26, 4), "I64": (27, 8)}


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ModelFormatError(f"{path} is not valid JSON ({e.msg}): restore it from the checkpoint.") from None


def safetensors_header(path: Path) -> dict[str, Any]:
    """The JSON header of a .safetensors file: {name: {dtype, shape, data_offsets}}."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ModelFormatError(f"{path} is too short to be a safetensors file: restore it from the checkpoint.")
        (n,) = struct.unpack("<Q", raw)
        if n > 100_000_000:
            raise ModelFormatError(f"{path} has a corrupt safetensors header: restore it from the checkpoint.")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ModelFormatError(f"{path} has a corrupt safetensors header: restore it from the checkpoint.") from None
    header.pop("__metadata__", None)
    return header


def spec_from_hf(directory: str | Path) -> ModelSpec:
    directory = Path(directory)
    cfg = text_config(_read_json(directory / "config.json"))  # a multimodal checkpoint: its language model
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ModelFormatError(f"{directory} has no .safetensors files: only safetensors checkpoints are supported.")
    tensors: list[TensorInfo] = []
    for f in files:
        for stored, info in safetensors_header(f).items():
            name = text_tensor_name(stored)
            if name is None:  # another tower's (vision): not what the language model reads
                continue
            ggml_type, size = _DTYPES.get(info["dtype"], (0, 4))
            shape = tuple(reversed([int(d) for d in info["shape"]]))  # GGUF order: fastest first
            n = 1
            for d in shape:
                n *= d
            tensors.append(TensorInfo(name, shape, ggml_type, int(info["data_offsets"][0]), n * size))

    tok_cfg_path = directory / "tokenizer_config.json"
    tok_cfg = _read_json(tok_cfg_path) if tok_cfg_path.is_file() else {}
    template = tok_cfg.get("chat_template")
    if isinstance(template, list):  # named templates: take the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    tokens: tuple[str, ...] = ()
    tok_path = directory / "tokenizer.json"
    token_ids: dict[str, int] = {}
    if tok_path.is_file():
        tok = _read_json(tok_path)
        token_ids = dict(tok.get("model", {}).get("vocab", {}))
        for added in tok.get("added_tokens", []):
            token_ids[added["content"]] = added["id"]
        if token_ids:
            by_id = sorted(token_ids.items(), key=lambda kv: kv[1])
            tokens = tuple(t for t, _ in by_id)

    def special(key: str) -> tuple[int | None, str | None]:
        value = tok_cfg.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            return token_ids.get(value), value
        return None, None

    bos_id, bos = special("bos_token")
    eos_id, eos = special("eos_token")
    n_heads = int(cfg.get("num_attention_heads", 0))
    d_model = int(cfg.get("hidden_size", 0))
    return ModelSpec(
        path=str(directory),
        format="hf",
        name=directory.name,
        architecture=str(cfg.get("model_type", "unknown")),
        n_layers=int(cfg.get("num_hidden_layers", 0)),
        d_model=d_model,
        n_heads=n_heads,
        n_kv_heads=int(cfg.get("num_key_value_heads") or n_heads),
        head_dim=int(cfg.get("head_dim") or (d_model // n_heads if n_heads else 0)),
        d_ffn=int(cfg.get("intermediate_size", 0)),
        vocab_size=int(cfg.get("vocab_size", len(tokens))),
        context_length=int(cfg.get("max_position_embeddings", 2048)),
        rope_freq_base=float(cfg.get("rope_theta", 10000.0)),
        norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        file_type=str(cfg.get("torch_dtype", "")).upper() or None,
        tensors=tuple(tensors),
        chat_template=template if isinstance(template, str) else None,
        special=SpecialTokens(
            bos_id=bos_id,
            eos_id=eos_id,
            bos=bos,
            eos=eos,
            add_bos=bool(tok_cfg.get("add_bos_token", False)),
            add_eos=bool(tok_cfg.get("add_eos_token", False)),
        ),
        tokenizer_model="hf",
        tokens=tokens,
        metadata={"config": cfg},
    )
