"""A Hugging Face tokenizer (`tokenizer.json`, `tokenizer_config.json`) -> GGUF tokenizer keys.

Two kinds of BPE vocabulary are written:

* ``gpt2`` — byte-level BPE (GPT-2, Llama 3, Qwen2, SmolLM): tokens, merges, token types and
  ``tokenizer.ggml.pre``, the name of the regex split llama.cpp applies before merging.
  We recognise the split from the pre-tokenizer's structure (see `PRE_TOKENIZERS`).
* ``llama`` — SentencePiece-style BPE with byte fallback (Llama 2, Mistral 7B): tokens with
  ``▁`` for spaces, scores and token types. llama.cpp merges the adjacent pair whose result
  has the highest score, Hugging Face the pair with the lowest merge rank; a token's score
  is therefore minus the rank of the merge that makes it, which orders merges identically.

Token types (llama.cpp's): 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte.
Embedding rows past the tokenizer's last id become ``[PAD<id>]`` tokens of type unused.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gguf import GGUFValueType, Keys

from .errors import CheckpointError
from .gguf_writer import KV

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# The regexes of `Split` pre-tokenizers, as tokenizer.json spells them.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Pre-tokenizer structure -> llama.cpp's `tokenizer.ggml.pre`. ("ByteLevel", True) is a
# byte-level step that also applies GPT-2's split regex; ("Digits", True) splits every digit.
PRE_TOKENIZERS: dict[tuple[tuple[Any, ...], ...], str] = {
    (("ByteLevel", True),): "gpt-2",
    (("Digits", True), ("ByteLevel", True)): "starcoder",
    (("Split", _LLAMA3_SPLIT), ("ByteLevel", False)): "llama-bpe",
    (("Split", _QWEN2_SPLIT), ("ByteLevel", False)): "qwen2",
}


@dataclass
class TokenizerKeys:
    """What the tokenizer adds to the GGUF header, and notes for the user."""

    metadata: list[KV]
    warnings: list[str] = field(default_factory=list)


def _load_json(path: Path, required: bool) -> dict[str, Any] | None:
    if not path.is_file():
        if required:
            raise CheckpointError(
                f"{path.parent} has no {path.name}: llmlocal needs the Hugging Face fast tokenizer "
                "file; save it with transformers' tokenizer.save_pretrained()."
            )
        return None
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise CheckpointError(f"{path} is not valid JSON: download it again.") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path} does not hold a JSON object: download it again.")
    return value


def _steps(node: dict[str, Any] | None) -> list[dict[str, Any]]:
    if not node:
        return []
    if node.get("type") == "Sequence":
        inner = (node.get("pretokenizers") or node.get("normalizers") or node.get("decoders")
                 or node.get("processors") or [])
        return [s for s in inner if isinstance(s, dict)]
    return [node]


def _signature(pre_tokenizer: dict[str, Any] | None) -> tuple[tuple[Any, ...], ...]:
    sig: list[tuple[Any, ...]] = []
    for step in _steps(pre_tokenizer):
        kind = step.get("type")
        if kind == "ByteLevel":
            sig.append(("ByteLevel", bool(step.get("use_regex", True))))
        elif kind == "Digits":
            sig.append(("Digits", bool(step.get("individual_digits", False))))
        elif kind == "Split":
            pattern = step.get("pattern") or {}
            sig.append(("Split", pattern.get("Regex", pattern.get("String"))))
        else:
            sig.append((kind,))
    return tuple(sig)


def _is_byte_level(tj: dict[str, Any]) -> bool:
    return any(s.get("type") == "ByteLevel" for s in _steps(tj.get("pre_tokenizer")) + _steps(tj.get("decoder")))


def _looks_special(text: str) -> bool:
    # Chat markers such as <|im_start|> are control tokens even when a tokenizer forgets to
    # flag them special; otherwise llama.cpp would split them into characters.
    return (text.startswith("<|") and text.endswith("|>")) or (text.startswith("<｜") and text.endswith("｜>"))


def _token_text(entry: Any) -> str | None:
    if isinstance(entry, str):
        return entry
    if isinstance(entry, dict) and isinstance(entry.get("content"), str):
        return entry["content"]
    return None


def _merge_string(merge: Any) -> str:
    if isinstance(merge, str):
        return merge
    # transformers >= 4.45 stores pairs; a space inside a part is written as U+0120 ('Ġ'),
    # the byte-level stand-in for a space, so "a b" stays splittable at its one space.
    left, right = (part.replace(" ", "\u0120") for part in merge)
    return f"{left} {right}"


def tokenizer_keys(directory: Path, config: dict[str, Any], vocab_size: int) -> TokenizerKeys:
    """Read the tokenizer files in ``directory``; ``vocab_size`` is the embedding row count."""
    tj = _load_json(directory / "tokenizer.json", required=True)
    assert tj is not None
    tc = _load_json(directory / "tokenizer_config.json", required=False) or {}
    gen = _load_json(directory / "generation_config.json", required=False) or {}
    model = tj.get("model") or {}
    if model.get("type") != "BPE":
        raise CheckpointError(
            f"{directory / 'tokenizer.json'} is a {model.get('type')} tokenizer; llmlocal converts BPE "
            "tokenizers (GPT-2 style or SentencePiece BPE) only."
        )
    byte_level = _is_byte_level(tj)
    if not byte_level and not model.get("byte_fallback"):
        raise CheckpointError(
            f"{directory / 'tokenizer.json'} is neither byte-level nor byte-fallback BPE, which llama.cpp "
            "cannot reproduce: this tokenizer is not supported."
        )
    out = TokenizerKeys(metadata=[])
    vocab: dict[str, int] = model.get("vocab") or {}
    added = [a for a in tj.get("added_tokens") or [] if isinstance(a, dict) and "id" in a]
    all_ids = list(vocab.values()) + [int(a["id"]) for a in added]
    if all_ids and max(all_ids) >= vocab_size:
        raise CheckpointError(
            f"The tokenizer in {directory} has token id {max(all_ids)} but the model has only {vocab_size} "
            "embedding rows: tokenizer.json does not belong to these weights."
        )

    tokens, types = _vocabulary(vocab, added, vocab_size, byte_level, model.get("unk_token"))
    if len(set(all_ids)) < vocab_size:
        out.warnings.append(
            f"the tokenizer has fewer tokens than the {vocab_size} embedding rows; the rest are written as unused [PAD] tokens"
        )

    md = out.metadata
    merges = [_merge_string(m) for m in model.get("merges") or []]
    if byte_level:
        md.append(KV.string(Keys.Tokenizer.MODEL, "gpt2"))
        md.append(KV.string(Keys.Tokenizer.PRE, _pre_name(tj, tc, out.warnings)))
    else:
        md.append(KV.string(Keys.Tokenizer.MODEL, "llama"))
        md.append(KV.string(Keys.Tokenizer.PRE, "default"))
    md.append(KV.array(Keys.Tokenizer.LIST, tokens, GGUFValueType.STRING))
    if not byte_level:
        md.append(KV.array(Keys.Tokenizer.SCORES, _spm_scores(tokens, types, merges), GGUFValueType.FLOAT32))
    md.append(KV.array(Keys.Tokenizer.TOKEN_TYPE, types, GGUFValueType.INT32))
    if byte_level and merges:
        md.append(KV.array(Keys.Tokenizer.MERGES, merges, GGUFValueType.STRING))
    md.extend(_special_ids(tj, tc, config, gen, tokens, vocab_size))
    add_bos, add_eos = _adds_bos_eos(tj, tc)
    md.append(KV.boolean(Keys.Tokenizer.ADD_BOS, add_bos))
    md.append(KV.boolean(Keys.Tokenizer.ADD_EOS, add_eos))
    if not byte_level:
        md.append(KV.boolean(Keys.Tokenizer.ADD_PREFIX, _adds_space_prefix(tj)))
    md.extend(_chat_templates(directory, tc))
    return out


def _vocabulary(
    vocab: dict[str, int], added: list[dict[str, Any]], vocab_size: int, byte_level: bool, unk: Any
) -> tuple[list[str], list[int]]:
    """Token strings and llama.cpp token types, indexed by id, one per embedding row."""
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    types = [UNUSED] * vocab_size
    for text, i in vocab.items():
        tokens[i] = text
        types[i] = NORMAL
    if not byte_level:
        for i, text in enumerate(tokens):
            if types[i] == NORMAL and re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", text):
                types[i] = BYTE
        if isinstance(unk, str) and unk in vocab:
            types[vocab[unk]] = UNKNOWN
    for a in added:
        i, text = int(a["id"]), str(a.get("content", ""))
        if types[i] == BYTE:
            continue  # byte-fallback pieces listed as added tokens are still bytes, not controls
        if a.get("special") or _looks_special(text):
            types[i] = CONTROL
        else:
            # llama.cpp matches user-defined tokens against raw text, so spaces must be spaces.
            text = text.replace("\u2581", " ") if not byte_level else text
            types[i] = USER_DEFINED
        tokens[i] = text
    return tokens, types


def _pre_name(tj: dict[str, Any], tc: dict[str, Any], warnings: list[str]) -> str:
    sig = _signature(tj.get("pre_tokenizer"))
    name = PRE_TOKENIZERS.get(sig)
    if name == "starcoder" and tc.get("clean_up_tokenization_spaces") is False:
        name = "smollm"  # the same split, and llama.cpp then leaves spaces alone when decoding, as asked
    if name is None:
        warnings.append(
            "the tokenizer's pre-tokenizer is not one llmlocal recognises; llama.cpp will split text "
            "with GPT-2's default rule, so tokenization may differ slightly from the original"
        )
        return "default"
    return name


def _spm_scores(tokens: list[str], types: list[int], merges: list[str]) -> list[float]:
    rank = {}
    for r, merge in enumerate(merges):
        left, _, right = merge.partition(" ")
        rank.setdefault(left + right, r)
    scores = []
    for text, kind in zip(tokens, types):
        if kind == NORMAL and text in rank:
            scores.append(-float(rank[text]))
        elif kind == NORMAL and len(text) > 1:
            scores.append(-float(len(merges)))  # made by no merge: never preferred
        else:
            scores.append(0.0)
    return scores


def _special_ids(
    tj: dict[str, Any], tc: dict[str, Any], config: dict[str, Any], gen: dict[str, Any], tokens: list[str], vocab_size: int
) -> list[KV]:
    ids = {text: i for i, text in enumerate(tokens)}
    for a in tj.get("added_tokens") or []:
        if isinstance(a, dict) and "id" in a:
            ids[str(a.get("content"))] = int(a["id"])
    keys = {"bos": Keys.Tokenizer.BOS_ID, "eos": Keys.Tokenizer.EOS_ID, "unk": Keys.Tokenizer.UNK_ID, "pad": Keys.Tokenizer.PAD_ID}
    out = []
    for kind, key in keys.items():
        found: int | None = None
        text = _token_text(tc.get(f"{kind}_token"))
        if text is not None and text in ids:
            found = ids[text]
        for source in (config, gen):
            if found is None:
                value = source.get(f"{kind}_token_id")
                value = value[0] if isinstance(value, list) and value else value
                if isinstance(value, int) and 0 <= value < vocab_size:
                    found = value
        if found is None and kind == "unk" and isinstance((tj.get("model") or {}).get("unk_token"), str):
            found = ids.get(tj["model"]["unk_token"])
        if found is not None:
            out.append(KV.u32(key, found))
    return out


def _adds_bos_eos(tj: dict[str, Any], tc: dict[str, Any]) -> tuple[bool, bool]:
    """tokenizer_config.json's add_bos_token/add_eos_token, else what the post-processor's
    single-sequence template puts around the text."""
    bos_text = _token_text(tc.get("bos_token"))
    eos_text = _token_text(tc.get("eos_token"))
    add_bos = add_eos = False
    for step in _steps(tj.get("post_processor")):
        if step.get("type") != "TemplateProcessing":
            continue
        single = step.get("single") or []
        first = (single[0].get("SpecialToken") or {}).get("id") if single else None
        last = (single[-1].get("SpecialToken") or {}).get("id") if len(single) > 1 else None
        add_bos = add_bos or (first is not None and (bos_text is None or first == bos_text))
        add_eos = add_eos or (last is not None and (eos_text is None or last == eos_text))
    if isinstance(tc.get("add_bos_token"), bool):
        add_bos = tc["add_bos_token"]
    if isinstance(tc.get("add_eos_token"), bool):
        add_eos = tc["add_eos_token"]
    return add_bos, add_eos


def _adds_space_prefix(tj: dict[str, Any]) -> bool:
    for step in _steps(tj.get("normalizer")):
        if step.get("type") == "Prepend" and step.get("prepend") == "\u2581":
            return True
    for step in _steps(tj.get("pre_tokenizer")):
        if step.get("type") == "Metaspace":
            return step.get("prepend_scheme", "always") in ("first", "always") and step.get("add_prefix_space", True)
    return False


def _chat_templates(directory: Path, tc: dict[str, Any]) -> list[KV]:
    template: Any = tc.get("chat_template")
    if template is None and (directory / "chat_template.jinja").is_file():
        template = (directory / "chat_template.jinja").read_text(encoding="utf-8")
    if template is None:
        template = (_load_json(directory / "chat_template.json", required=False) or {}).get("chat_template")
    if isinstance(template, str):
        return [KV.string(Keys.Tokenizer.CHAT_TEMPLATE, template)]
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t["name"]: t["template"] for t in template if isinstance(t, dict) and "name" in t and "template" in t}
        out = []
        if "default" in named:
            out.append(KV.string(Keys.Tokenizer.CHAT_TEMPLATE, named.pop("default")))
        for name, text in named.items():
            out.append(KV.string(Keys.Tokenizer.CHAT_TEMPLATE_N.format(name=name), text))
        if named:
            out.append(KV.array(Keys.Tokenizer.CHAT_TEMPLATES, list(named), GGUFValueType.STRING))
        return out
    return []
