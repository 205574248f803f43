"""The paged engine's GGUF tokenizer (llama.cpp's vocabulary through its C API) against
llama-cpp-python's own high-level tokenizer and llama.cpp's per-token answers, on the starter."""

from __future__ import annotations

import ctypes
from collections.abc import Iterator

import llama_cpp
import pytest
from llama_cpp._utils import suppress_stdout_stderr
from llmlocal.engine.prompt.tokenizer import LlamaCppTokenizer, start_tokenizer

TEXTS = ["", "hello world", "<|im_start|>user\nhi<|im_end|>\n", "ünïcödé 日本語 🎉 " * 20, "x" * 3000,
         "def f(a):\n\treturn a  # ok\n", "\n" + " " * 40 + "return 1\n"]


@pytest.fixture(scope="module")
def ours(starter_path: str) -> Iterator[LlamaCppTokenizer]:
    tok = LlamaCppTokenizer(starter_path)
    yield tok
    tok.close()


@pytest.fixture(scope="module")
def theirs(starter_path: str) -> llama_cpp.Llama:
    with suppress_stdout_stderr(disable=False):
        return llama_cpp.Llama(model_path=starter_path, vocab_only=True, verbose=False)


def test_end_of_generation_tokens_are_llama_cpps(ours: LlamaCppTokenizer, theirs: llama_cpp.Llama) -> None:
    vocab = theirs._model.vocab
    expected = [t for t in range(theirs.n_vocab()) if llama_cpp.llama_vocab_is_eog(vocab, t)]
    assert ours.vocab_size == theirs.n_vocab()
    assert sorted(t for t in range(ours.vocab_size) if ours.is_eog(t)) == expected
    assert expected  # the starter ends its turns


@pytest.mark.parametrize("add_special", [True, False])
def test_encode_is_llama_cpps(ours: LlamaCppTokenizer, theirs: llama_cpp.Llama, add_special: bool) -> None:
    for text in TEXTS:
        assert ours.encode(text, add_special) == theirs.tokenize(text.encode(), add_bos=add_special, special=True)


def test_every_token_decodes_to_its_whole_piece(ours: LlamaCppTokenizer, theirs: llama_cpp.Llama) -> None:
    """Each token's bytes are llama.cpp's piece, read with room to spare: pieces longer than 32
    bytes (runs of indentation) are whole, not dropped."""
    vocab = theirs._model.vocab
    buf = ctypes.create_string_buffer(1024)
    long = 0
    for t in range(ours.vocab_size):
        n = llama_cpp.llama_token_to_piece(vocab, t, buf, len(buf), 0, False)
        assert ours.token_bytes(t) == buf.raw[:n], t
        long += n > 32
    assert long > 0  # the starter has such tokens: the case above is exercised


def test_text_round_trips(ours: LlamaCppTokenizer) -> None:
    """Ordinary text (special tokens decode to nothing) comes back as it went in."""
    for text in (t for t in TEXTS if "<|" not in t):
        assert b"".join(ours.token_bytes(t) for t in ours.encode(text, False)).decode() == text


def test_started_on_a_thread_and_closed_twice(starter_path: str) -> None:
    tok = start_tokenizer(starter_path, gguf=True).result(timeout=60)
    assert tok.encode("hello", False)
    tok.close()
    tok.close()
