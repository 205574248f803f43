"""The settings file and `llmlocal config`: reading, checked writes, errors, and precedence
(flag > environment > config file > built-in) through real commands."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from llmlocal.app.cli import build_parser, main
from llmlocal.app.config import config_path
from llmlocal.app.options import sampling_from_args

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

LLMLOCAL = [sys.executable, "-m", "llmlocal.app"]


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def llmlocal(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*LLMLOCAL, *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})})


def one_sentence(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


# ---- where the file is --------------------------------------------------------------------
def test_the_file_is_found_from_the_override_then_xdg_then_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("LLMLOCAL_CONFIG", str(tmp_path / "mine.toml"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    assert config_path() == tmp_path / "mine.toml"
    monkeypatch.delenv("LLMLOCAL_CONFIG")
    assert config_path() == tmp_path / "xdg" / "llmlocal" / "config.toml"
    monkeypatch.delenv("XDG_CONFIG_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert config_path() == tmp_path / "home" / ".config" / "llmlocal" / "config.toml"


def test_config_path_prints_it_even_when_the_file_is_broken(isolated_config: Path, capsys: pytest.CaptureFixture[str]) -> None:
    isolated_config.write_text("ctx = [\n")
    code, out, _ = run(capsys, "config", "path")
    assert code == 0 and out.strip() == str(isolated_config)


# ---- set and get ----------------------------------------------------------------------------
def test_set_then_get_round_trips_and_keeps_the_other_keys(isolated_config: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prompt = 'Be "brief" \\ exact.\nSecond line\twith a tab, ünïcode and a \x01 control.'
    for key, value in (("temperature", "0.3"), ("ctx", "4096"), ("backend", "llamacpp"), ("seed", "-7"),
                       ("system_prompts.terse", prompt), ("top_p", "1")):
        code, out, err = run(capsys, "config", "set", key, value)
        assert code == 0, err
        assert str(isolated_config) in out

    written = tomllib.loads(isolated_config.read_text())
    assert written == {"backend": "llamacpp", "ctx": 4096, "temperature": 0.3, "top_p": 1.0, "seed": -7,
                       "system_prompts": {"terse": prompt}}
    for key, shown in (("temperature", "0.3"), ("ctx", "4096"), ("backend", "llamacpp"), ("seed", "-7"), ("top_p", "1.0")):
        code, out, _ = run(capsys, "config", "get", key)
        assert (code, out.strip()) == (0, shown)
    code, out, _ = run(capsys, "config", "get", "system_prompts.terse")
    assert out == prompt + "\n"
    # no temporary file is left beside it
    assert [p.name for p in isolated_config.parent.iterdir()] == [isolated_config.name]


def test_get_of_an_unset_key_gives_the_built_in(isolated_config: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "config", "get", "model")
    assert (code, out.strip()) == (0, "smollm2-135m")
    code, out, err = run(capsys, "config", "get", "ctx")
    assert code == 1 and out == "" and "not set" in err
    assert not isolated_config.exists()  # reading never creates the file


def test_a_bad_value_or_key_leaves_the_file_as_it_was(isolated_config: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(capsys, "config", "set", "ctx", "2048")[0] == 0
    before = isolated_config.read_bytes()
    for key, value, phrase in (
        ("ctx", "big", "ctx must be a whole number of tokens, at least 16, not 'big'"),
        ("ctx", "8", "at least 16"),
        ("temperature", "nan", "temperature must be a number >= 0"),
        ("top_p", "1.5", "top_p must be a number in (0, 1]"),
        ("backend", "fast", "backend must be one of auto, llamacpp, paged, sparse"),
        ("colour", "blue", "Unknown key 'colour'"),
        ("model", "no-such-model", "No model named 'no-such-model'"),
        ("system_prompts.two words", "x", "A preset name uses letters"),
    ):
        code, _, err = run(capsys, "config", "set", key, value)
        assert code == 2, (key, value)
        assert phrase in one_sentence(err)
        assert isolated_config.read_bytes() == before


def test_set_writes_through_a_symlinked_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    real = tmp_path / "dotfiles" / "llmlocal.toml"
    real.parent.mkdir()
    real.write_text("ctx = 1024\n")
    link = tmp_path / "config.toml"
    link.symlink_to(real)
    monkeypatch.setenv("LLMLOCAL_CONFIG", str(link))
    assert run(capsys, "config", "set", "threads", "3")[0] == 0
    assert link.is_symlink()
    assert tomllib.loads(real.read_text()) == {"ctx": 1024, "threads": 3}


def test_unset_removes_a_key_even_an_unknown_one(isolated_config: Path, capsys: pytest.CaptureFixture[str]) -> None:
    isolated_config.write_text('ctx = 1024\ncolour = "blue"\n')
    code, _, err = run(capsys, "config", "list")
    assert code == 2 and "Unknown key 'colour'" in one_sentence(err)
    code, out, _ = run(capsys, "config", "unset", "colour")
    assert code == 0 and "Removed colour" in out
    assert tomllib.loads(isolated_config.read_text()) == {"ctx": 1024}


def test_list_shows_each_value_and_where_it_comes_from(isolated_config: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    isolated_config.write_text(f'temperature = 0.25\ndata_dir = "{tmp_path / "cfg-data"}"\nmodels_dir = "{tmp_path / "cfg-models"}"\n'
                               '[system_prompts]\npirate = "Talk like a pirate."\n')
    monkeypatch.setenv("LLMLOCAL_MODELS_DIR", str(tmp_path / "env-models"))
    code, out, _ = run(capsys, "config", "list", "--json")
    assert code == 0
    got = json.loads(out)
    s = got["settings"]
    assert s["temperature"] == {"value": 0.25, "source": "config file"}
    assert s["top_k"] == {"value": None, "source": "built-in"}
    assert s["data_dir"] == {"value": str(tmp_path / "cfg-data"), "source": "config file"}
    assert s["models_dir"] == {"value": str(tmp_path / "env-models"), "source": "$LLMLOCAL_MODELS_DIR"}
    assert got["system_prompts"] == {"pirate": "Talk like a pirate."} and got["path"] == str(isolated_config)
    code, out, _ = run(capsys, "config", "list")
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.strip()}
    assert rows["temperature"][1:] == ["0.25", "config", "file"]
    assert rows["system_prompts.pirate"][1:4] == ["Talk", "like", "a"]


# ---- a broken file ---------------------------------------------------------------------------
@pytest.mark.parametrize("text, phrase", [
    ("ctx = [\n", "is not valid TOML"),
    ('colour = "blue"\n', "Unknown key 'colour'"),
    ('ctx = "big"\n', "ctx in "),
    ("temperature = true\n", "temperature in "),
    ('system_prompts = "x"\n', "system_prompts in "),
    ("\xff\xfe", "is not UTF-8"),
])
def test_a_broken_file_stops_commands_with_one_sentence(isolated_config: Path, capsys: pytest.CaptureFixture[str], text: str, phrase: str) -> None:
    isolated_config.write_bytes(text.encode("latin-1"))
    for argv in (["run", "hi"], ["plan", "--json"], ["models", "list"], ["config", "get", "ctx"], ["doctor"]):
        code, out, err = run(capsys, *argv)
        assert code == 2, argv
        line = one_sentence(err)
        assert phrase in line and str(isolated_config) in line, argv
        assert out == ""


def test_a_broken_file_in_a_real_process_is_one_sentence_and_exit_2(isolated_config: Path) -> None:
    isolated_config.write_text("ctx = 4096\nctx = 8192\n")  # a duplicate key is invalid TOML
    result = llmlocal("run", "hi")
    assert result.returncode == 2
    line = one_sentence(result.stderr)
    assert line.startswith(f"llmlocal: {isolated_config} is not valid TOML") and "delete the file" in line


# ---- precedence: flag > environment > config file > built-in --------------------------------
def plan_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    code, out, err = run(capsys, "plan", "--json", *argv)
    assert code == 0, err
    return json.loads(out)


def test_plan_takes_model_context_and_backend_from_the_file_unless_a_flag_says_otherwise(
    isolated_config: Path, starter_path: str, starter_cpu_backend: str, make_gguf, capsys: pytest.CaptureFixture[str]
) -> None:
    built_in = plan_json(capsys)
    assert (built_in["model_path"], built_in["n_ctx"], built_in["backend"]) == (starter_path, 8192, starter_cpu_backend)

    mine = make_gguf(name="mine.gguf")
    other = "llamacpp" if starter_cpu_backend == "paged" else "paged"  # not what auto would pick
    isolated_config.write_text(f'model = "{mine}"\nctx = 64\nbackend = "{other}"\n')
    from_file = plan_json(capsys)
    assert (from_file["model_path"], from_file["n_ctx"], from_file["backend"]) == (str(mine), 64, other)

    from_flags = plan_json(capsys, "smollm2-135m", "--ctx", "2048", "--backend", "llamacpp")
    assert (from_flags["model_path"], from_flags["n_ctx"], from_flags["backend"]) == (starter_path, 2048, "llamacpp")
    one_flag = plan_json(capsys, "--ctx", "32")
    assert (one_flag["model_path"], one_flag["n_ctx"], one_flag["backend"]) == (str(mine), 32, other)


def test_a_missing_default_model_names_the_file(isolated_config: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    isolated_config.write_text(f'model = "{tmp_path / "gone.gguf"}"\n')
    code, _, err = run(capsys, "plan")
    assert code == 2
    line = one_sentence(err)
    assert f"The default model '{tmp_path / 'gone.gguf'}' (set in {isolated_config})" in line
    assert "llmlocal models default NAME" in line


def test_sampling_comes_from_flags_then_the_file_then_the_engine_defaults(isolated_config: Path) -> None:
    def sampling(*argv: str):
        return sampling_from_args(build_parser().parse_args(["run", "hi", *argv]))

    built_in = sampling()
    assert (built_in.temperature, built_in.top_k, built_in.top_p, built_in.seed, built_in.max_tokens) == (0.8, 40, 0.95, None, None)

    isolated_config.write_text("temperature = 0.2\ntop_k = 5\ntop_p = 0.5\nmin_p = 0.1\nrepeat_penalty = 1.2\nseed = 11\nmax_tokens = 9\n")
    from_file = sampling()
    assert (from_file.temperature, from_file.top_k, from_file.top_p, from_file.min_p, from_file.repeat_penalty) == (0.2, 5, 0.5, 0.1, 1.2)
    assert (from_file.seed, from_file.max_tokens) == (11, 9)

    from_flags = sampling("-t", "0.9", "--top-k", "0", "--seed", "3", "-n", "4")
    assert (from_flags.temperature, from_flags.top_k, from_flags.seed, from_flags.max_tokens) == (0.9, 0, 3, 4)
    assert from_flags.top_p == 0.5  # a flag pins only its own setting


def test_system_prompt_presets(isolated_config: Path, capsys: pytest.CaptureFixture[str]) -> None:
    isolated_config.write_text('[system_prompts]\nterse = "Answer in one word."\n')
    args = build_parser().parse_args(["run", "hi", "--system-preset", "terse"])
    assert args.system == "Answer in one word."
    code, _, err = run(capsys, "run", "hi", "--system-preset", "chatty")
    assert code == 2
    line = one_sentence(err)
    assert "No system prompt preset 'chatty'" in line and "presets: terse" in line and "config set system_prompts.chatty" in line


def test_the_models_directory_comes_from_the_environment_then_the_file_then_the_default(
    isolated_config: Path, tmp_path: Path, make_gguf
) -> None:
    gguf = make_gguf()
    for name in ("env-models", "cfg-models", "xdg/llmlocal/models"):
        (tmp_path / name).mkdir(parents=True)
        (tmp_path / name / f"{name.split('/')[0]}.gguf").write_bytes(gguf.read_bytes())
    base = {"XDG_DATA_HOME": str(tmp_path / "xdg"), "HF_HOME": str(tmp_path / "hf"), "LLMLOCAL_MODELS_DIR": ""}

    def local_models(**env: str) -> list[str]:
        result = llmlocal("models", "list", "--json", env={**base, **env})
        assert result.returncode == 0, result.stderr
        return [Path(m["name"]).name for m in json.loads(result.stdout) if m["source"] == "local"]

    assert local_models() == ["xdg.gguf"]
    isolated_config.write_text(f'models_dir = "{tmp_path / "cfg-models"}"\n')
    assert local_models() == ["cfg-models.gguf"]
    assert local_models(LLMLOCAL_MODELS_DIR=str(tmp_path / "env-models")) == ["env-models.gguf"]
