"""The `llmlocal` command, run as users run it: in a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

LLMLOCAL = [sys.executable, "-m", "llmlocal.app"]


def llmlocal(*args: str, stdin: str | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    return subprocess.run([*LLMLOCAL, *args], capture_output=True, text=True, input=stdin, timeout=timeout, env=env)


def assert_user_error(result: subprocess.CompletedProcess[str], *phrases: str) -> None:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    for phrase in phrases:
        assert phrase in lines[0]


def test_version() -> None:
    result = llmlocal("--version")
    assert result.returncode == 0
    assert result.stdout.strip() == "llmlocal 0.1.0"


def test_help_is_fast_and_does_not_import_torch() -> None:
    """Fast by construction, not by a clock: `--help` imports nothing but the standard library
    and llmlocal's own light modules (no torch, numpy, llama_cpp, textual; no engine, no
    kernels), whatever the machine's speed."""
    code = (
        "import sys\n"
        "before = set(sys.modules)\n"
        "from llmlocal.app.cli import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "for m in ('torch', 'llama_cpp', 'textual', 'numpy'):\n    assert m not in sys.modules, m\n"
        "new = set(sys.modules) - before\n"
        "print(' '.join(sorted({m.split('.')[0] for m in new} - set(sys.stdlib_module_names) - {'llmlocal'})), file=sys.stderr)\n"
        "print(' '.join(sorted(m for m in new if m.startswith(('llmlocal.engine', 'llmlocal.native')))), file=sys.stderr)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "chat" in result.stdout and "run" in result.stdout
    third_party, heavy = result.stderr.split("\n")[:2]
    assert third_party == "", f"--help imports third-party packages: {third_party}"
    assert heavy == "", f"--help imports the engine or the kernels: {heavy}"


def test_run_json_prints_one_object_with_the_contract_keys() -> None:
    result = llmlocal("run", "What color is the sky on a clear day?", "--json", "--temperature", "0", "--max-tokens", "16")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)  # exactly one JSON document, nothing else on stdout
    for key in ("text", "model", "backend", "prompt_tokens", "completion_tokens", "ttft_s", "decode_tok_s", "finish_reason"):
        assert key in data, key
    planned = json.loads(llmlocal("plan", "--json").stdout)  # `run` loads what `plan` chose
    assert data["model"] == "smollm2-135m" and data["backend"] == planned["backend"]
    assert data["completion_tokens"] == 16 and data["finish_reason"] == "length"
    assert data["text"] and data["ttft_s"] > 0 and data["decode_tok_s"] > 0


def test_run_streams_text_and_reads_stdin() -> None:
    streamed = llmlocal("run", "-", "-t", "0", "-n", "12", stdin="What color is the sky on a clear day?")
    as_json = llmlocal("run", "What color is the sky on a clear day?", "-t", "0", "-n", "12", "--json")
    assert streamed.returncode == 0
    assert streamed.stdout.strip() == json.loads(as_json.stdout)["text"].strip()


def test_run_reads_a_pipe_without_a_dash_and_refuses_text_that_is_not_utf8() -> None:
    piped = llmlocal("run", "-t", "0", "-n", "4", stdin="What color is the sky on a clear day?")
    dashed = llmlocal("run", "-", "-t", "0", "-n", "4", stdin="What color is the sky on a clear day?")
    assert piped.returncode == 0, piped.stderr
    assert piped.stdout == dashed.stdout and piped.stdout.strip()
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    latin1 = subprocess.run([*LLMLOCAL, "run", "-"], input="caf\xe9".encode("latin-1"), capture_output=True, env=env, timeout=120)
    assert latin1.returncode == 2
    err = latin1.stderr.decode()
    assert "Traceback" not in err and "not UTF-8 (byte 0xe9 at offset 3)" in err and "iconv" in err


def test_missing_model() -> None:
    assert_user_error(llmlocal("run", "hi", "--model", "no-such-model"), "No model named 'no-such-model'", ".gguf")


def test_missing_model_in_chat_is_reported_before_the_screen_opens() -> None:
    assert_user_error(llmlocal("chat", "--model", "/nowhere/model.gguf"), "No model named")


def test_not_a_gguf(tmp_path: Path) -> None:
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"PK\x03\x04" + b"\0" * 100)
    assert_user_error(llmlocal("run", "hi", "--model", str(bad)), "not a GGUF file")


def test_truncated_gguf(tmp_path: Path, starter_path: str) -> None:
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(Path(starter_path).read_bytes()[:40_000_000])
    assert_user_error(llmlocal("run", "hi", "--model", str(cut)), "truncated", "again")


def test_architecture_llama_cpp_cannot_load(make_gguf) -> None:
    path = make_gguf(arch="notamodel")
    assert_user_error(llmlocal("run", "hi", "--model", str(path)), "llama.cpp could not load", "notamodel")


def test_prompt_longer_than_the_context() -> None:
    result = llmlocal("run", "word " * 300, "--ctx", "128")
    assert_user_error(result, "context window is 128", "--ctx")


def test_invalid_sampling_value() -> None:
    assert_user_error(llmlocal("run", "hi", "--top-p", "0"), "top_p")


def test_empty_prompt() -> None:
    assert_user_error(llmlocal("run", "   "), "prompt is empty")


def test_run_with_ngram_drafting_reports_the_acceptance() -> None:
    prompt = "Repeat exactly: one two three four five six seven eight nine ten."
    args = ("run", prompt, "--backend", "paged", "--temperature", "0", "--max-tokens", "24", "--json", "--ctx", "512")
    plain = llmlocal(*args, timeout=300)
    spec = llmlocal(*args, "--draft", "ngram", "--draft-k", "4", timeout=300)
    assert plain.returncode == 0 and spec.returncode == 0, spec.stderr
    a, b = json.loads(plain.stdout), json.loads(spec.stdout)
    assert b["text"] == a["text"]  # greedy: speculation changes the speed, never the text
    assert b["drafted_tokens"] > 0 and 0.0 <= b["acceptance_rate"] <= 1.0 and b["tokens_per_step"] >= 1.0
    assert "acceptance_rate" not in a


def test_draft_with_another_tokenizer_is_one_sentence(make_gguf) -> None:
    other = make_gguf(arch="llama", name="other.gguf")
    result = llmlocal("run", "hi", "--backend", "paged", "--draft", str(other), "--ctx", "256", timeout=300)
    assert_user_error(result, "different tokenizer", "--draft ngram")


def test_run_structured_output_flags(tmp_path: Path) -> None:
    schema = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}, "count": {"type": "integer"}},
              "required": ["colour", "count"], "additionalProperties": False}
    (tmp_path / "s.json").write_text(json.dumps(schema))
    result = llmlocal("run", "Pick a colour and a count.", "--json-schema", str(tmp_path / "s.json"), "-t", "1", "--seed", "4",
                      "--backend", "paged", "--json")
    assert result.returncode == 0, result.stderr
    reply = json.loads(json.loads(result.stdout)["text"])
    assert set(reply) == {"colour", "count"} and reply["colour"] in ("red", "green", "blue") and isinstance(reply["count"], int)
    result = llmlocal("run", "Is the sky green?", "--choice", "yes", "--choice", "no", "-t", "0")
    assert result.returncode == 0 and result.stdout.strip() in ("yes", "no"), result.stderr


def test_run_structured_output_errors_are_one_sentence(tmp_path: Path) -> None:
    assert_user_error(llmlocal("run", "Hi", "--json-schema", str(tmp_path / "missing.json")), "Cannot read the JSON schema", "--json-schema")
    (tmp_path / "bad.json").write_text("{not json")
    assert_user_error(llmlocal("run", "Hi", "--json-schema", str(tmp_path / "bad.json")), "not valid JSON")
    assert_user_error(llmlocal("run", "Hi", "--regex", "[a-"), "regex grammar does not compile")


def complete(line: str, tmp_path: Path) -> list[str]:
    """What the shell would offer after ``line``, asked of llmlocal as the completion script asks."""
    out = tmp_path / "completions"
    env = dict(os.environ, _ARGCOMPLETE="1", _ARGCOMPLETE_IFS="\n", COMP_LINE=line, COMP_POINT=str(len(line)),
               _ARGCOMPLETE_STDOUT_FILENAME=str(out))
    result = subprocess.run(LLMLOCAL, capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode == 0, result.stderr
    return out.read_text().split("\n")


def test_shell_completion_scripts_and_completions(tmp_path: Path) -> None:
    for shell, marker in (("bash", "complete "), ("zsh", "#compdef llmlocal"), ("fish", "complete --command llmlocal")):
        result = llmlocal("completion", shell)
        assert result.returncode == 0 and marker in result.stdout, (shell, result.stdout[:200])
    assert [c.strip() for c in complete("llmlocal ru", tmp_path)] == ["run"]
    assert {c.strip() for c in complete("llmlocal run --backend ", tmp_path)} == {"auto", "llamacpp", "paged", "sparse"}
    assert "--json-schema" in [c.strip() for c in complete("llmlocal run --json-", tmp_path)]


def test_run_with_a_chat_template_file(tmp_path: Path) -> None:
    template = tmp_path / "plain.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}Answer:{% endif %}")
    own = json.loads(llmlocal("run", "Hi", "-t", "0", "-n", "4", "--json").stdout)
    chosen = json.loads(llmlocal("run", "Hi", "-t", "0", "-n", "4", "--json", "--chat-template", str(template)).stdout)
    assert chosen["prompt_tokens"] < own["prompt_tokens"]  # no system prompt, no role markers
    assert_user_error(llmlocal("run", "Hi", "--chat-template", str(tmp_path / "none.jinja")), "neither a template name")


def test_cache_lists_and_clears_packed_weights(tmp_path: Path) -> None:
    """`llmlocal cache` shows the packed weights kept for a model beside the KV blocks, and
    `cache clear MODEL` removes them; a model with nothing kept is one sentence, exit code 2."""
    import numpy as np
    from llmlocal.native.cpu.bench_kernels import random_rows
    from llmlocal.native.cpu.packed_cache import PackedCache, wait_for_writers
    from llmlocal.native.cpu.qlayout import Q4_K, pack_rows

    packed = pack_rows([random_rows(Q4_K, 32, 256, np.random.default_rng(0))])
    if packed is None:
        return  # no kernels: nothing is ever packed
    cache = PackedCache(tmp_path / "packed")
    cache.save_behind(bytes(16), {"run": packed}, {"model": "Tiny Coder", "path": "/models/tiny-coder.gguf"})
    wait_for_writers()
    dirs = ("--kv-cache-dir", str(tmp_path / "kv"), "--packed-cache-dir", str(tmp_path / "packed"))
    listed = llmlocal("cache", *dirs)
    assert listed.returncode == 0 and "Tiny Coder" in listed.stdout, listed.stderr
    shown = json.loads(llmlocal("cache", *dirs, "--json").stdout)
    [entry] = shown["packed"]["models"]
    assert entry["model"] == "Tiny Coder" and entry["bytes"] == cache.path(bytes(16)).stat().st_size > 0
    assert_user_error(llmlocal("cache", "clear", "llama", *dirs), "Nothing kept for a model matching 'llama'")
    cleared = llmlocal("cache", "clear", "tiny-coder", *dirs)
    assert cleared.returncode == 0 and "Removed the packed weights of 1 model (" in cleared.stdout
    assert cache.entries() == []
