"""Tokenizers for the engines that run their own model code (paged, sparse).

GGUF models are tokenized by llama.cpp's own vocabulary (a vocab-only llama-cpp-python
model: no weights loaded), so token ids are exactly llama.cpp's. Hugging Face checkpoints use
their `tokenizer.json` through the `tokenizers` library.
"""

from __future__ import annotations

import ctypes
import json
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol

from llmlocal.models.errors import ModelFormatError

from .grammar import TokenMasks


class Tokenizer(Protocol):
    vocab_size: int

    def encode(self, text: str, add_special: bool = True) -> list[int]: ...

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for (UTF-8 may be split across tokens)."""
        ...

    def is_eog(self, token_id: int) -> bool:
        """End of generation: EOS, end-of-turn and similar tokens."""
        ...

    def token_masks(self, n_vocab: int) -> TokenMasks:
        """The vocabulary for constrained decoding, over logits of width ``n_vocab``."""
        ...

    def close(self) -> None: ...


class LlamaCppTokenizer:
    """A GGUF file's vocabulary, loaded alone by llama.cpp's C API (no weights, no context).

    A loader opens it on a thread beside its main thread's import of torch, so every step
    here is one foreign call that runs without the GIL: the vocabulary load (0.4-0.5 s for
    150k tokens) and the scan for end-of-generation tokens (`token_flags`, one native call
    instead of 150k calls from Python)."""

    def __init__(self, path: str) -> None:
        import llama_cpp as lc
        from llama_cpp._utils import suppress_stdout_stderr

        lc.llama_backend_init()
        params = lc.llama_model_default_params()
        params.vocab_only = True
        with suppress_stdout_stderr(disable=False):  # llama.cpp prints the file's metadata at C level
            model = lc.llama_model_load_from_file(path.encode(), params)
        if not model:
            raise ModelFormatError(f"llama.cpp could not read the vocabulary of {path}: the file is damaged "
                                   "or of an architecture this llama.cpp does not know; convert it again.")
        self._lc, self._model = lc, model
        self._vocab = lc.llama_model_get_vocab(model)
        self.vocab_size = int(lc.llama_vocab_n_tokens(self._vocab))
        self._eog = frozenset(self._scan(lc.llama_vocab_is_eog))

    def _scan(self, predicate: Any) -> list[int]:
        """The token ids for which llama.cpp's ``predicate(vocab, id)`` holds."""
        try:
            from llmlocal.native.cpu.runtime import kernels

            address = ctypes.cast(predicate, ctypes.c_void_p).value
            flags = kernels().token_flags(address, self._vocab, self.vocab_size)
            return [t for t, f in enumerate(flags) if f]
        except ImportError:  # no compiled kernels: one call per token
            return [t for t in range(self.vocab_size) if predicate(self._vocab, t)]

    def encode(self, text: str, add_special: bool = True) -> list[int]:
        data = text.encode("utf-8")
        room = len(data) + 8  # a token covers at least one byte, plus the special tokens added
        while True:
            out = (self._lc.llama_token * room)()
            n = self._lc.llama_tokenize(self._vocab, data, len(data), out, room, add_special, True)
            if n >= 0:
                return out[:n]
            room = -n  # llama.cpp says how many it needs

    def token_bytes(self, token_id: int) -> bytes:
        size = 32
        while True:
            buf = ctypes.create_string_buffer(size)
            n = self._lc.llama_token_to_piece(self._vocab, token_id, buf, size, 0, False)
            if n >= 0:
                return buf.raw[:n]
            size = -n

    def is_eog(self, token_id: int) -> bool:
        return token_id in self._eog

    def token_masks(self, n_vocab: int) -> TokenMasks:
        return TokenMasks.for_llama_vocab(self._vocab, n_vocab, sorted(self._eog))

    def close(self) -> None:
        model, self._model = self._model, None
        if model:
            self._lc.llama_model_free(model)


def _byte_decoder() -> dict[str, int]:
    """Byte-level BPE maps each byte to a printable character; this is the inverse map.

    Printable Latin-1 bytes stand for themselves; the other 68 bytes are mapped, in order, to
    code points 256 and up.
    """
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    chars = {b: b for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + extra
            extra += 1
    return {chr(c): b for b, c in chars.items()}


class HFTokenizer:
    def __init__(self, directory: str | Path) -> None:
        from tokenizers import Tokenizer as _Tok

        directory = Path(directory)
        self._json = (directory / "tokenizer.json").read_text()
        self._tok = _Tok.from_str(self._json)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self._decoder = _byte_decoder()
        spec = json.loads(self._json)
        self._byte_level = "ByteLevel" in json.dumps(spec.get("decoder") or {})
        self._special = {t["id"] for t in spec.get("added_tokens", []) if t.get("special")}
        self._eog = set(_eos_ids(directory))

    def encode(self, text: str, add_special: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special).ids

    def token_bytes(self, token_id: int) -> bytes:
        piece = self._tok.id_to_token(token_id) or ""
        if token_id in self._special:
            return b""
        if self._byte_level:
            return bytes(self._decoder.get(ch, ord("?")) for ch in piece)
        # SentencePiece style: '▁' is a space, <0xAB> is a raw byte
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            return bytes([int(piece[3:5], 16)])
        return piece.replace("\u2581", " ").encode("utf-8")

    def is_eog(self, token_id: int) -> bool:
        return token_id in self._eog

    def token_masks(self, n_vocab: int) -> TokenMasks:
        return TokenMasks.for_hf_tokenizer(self._json, n_vocab, sorted(self._eog))

    def close(self) -> None:
        pass


def _eos_ids(directory: Path) -> list[int]:
    ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        path = directory / name
        if path.is_file():
            value = json.loads(path.read_text()).get("eos_token_id")
            if isinstance(value, int):
                ids.append(value)
            elif isinstance(value, list):
                ids.extend(int(v) for v in value)
    return ids


def open_tokenizer(path: str | Path, gguf: bool) -> Tokenizer:
    """The tokenizer of a GGUF file (llama.cpp's vocabulary) or of a checkpoint directory."""
    return LlamaCppTokenizer(str(path)) if gguf else HFTokenizer(path)


def start_tokenizer(path: str | Path, gguf: bool) -> Future[Tokenizer]:
    """`open_tokenizer` on a thread of its own, for a loader to collect when it needs it: the
    vocabulary load runs in llama.cpp, outside the GIL, beside importing torch and packing the
    weights (0.4-0.6 s of the 1.5B's load here)."""
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="llmlocal-tokenizer")
    job = pool.submit(open_tokenizer, path, gguf)
    pool.shutdown(wait=False)
    return job
