"""The prefix cache's disk tier: files that are whole or absent, checked before they are KV,
bounded, shared between processes; and the paged engine giving the same tokens with it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
from llmlocal.engine import DoneEvent, Engine, Plan, Request, SamplingParams
from llmlocal.engine.core.block_manager import FullBlock, prefix_blocks
from llmlocal.engine.core.kv_disk import HEADER, DiskTier, namespace, scan
from llmlocal.engine.core import kv_disk
from llmlocal.native.cpu import runtime

BS = 4
NBYTES = 256


def tier(root: Path, ns: bytes = b"n" * 16, **kw) -> DiskTier:
    return DiskTier(root, ns, BS, NBYTES, **kw)


def chain(n: int, root_key: int, seed: int = 0) -> list[tuple[int, list[int]]]:
    tokens = np.random.default_rng(seed).integers(0, 50000, size=n * BS + 1).tolist()
    return prefix_blocks(tokens, BS, root_key)


def write(t: DiskTier, blocks: list[tuple[int, list[int]]], seed: int = 1) -> np.ndarray:
    rows = np.random.default_rng(seed).integers(0, 256, size=(len(blocks), NBYTES), dtype=np.uint8)
    t.put([FullBlock(i, key, tuple(tokens)) for i, (key, tokens) in enumerate(blocks)], rows.copy())
    assert t.flush(10)
    return rows


def test_blocks_written_are_read_back_byte_for_byte(tmp_path: Path) -> None:
    t = tier(tmp_path)
    blocks = chain(5, t.root_key)
    rows = write(t, blocks)
    assert t.counts["written"] == 5
    assert t.stage(1, blocks) == 5
    assert all(t.has(key) for key, _ in blocks)
    payloads = t.take([key for key, _ in blocks])
    assert [bytes(p) for p in payloads] == [r.tobytes() for r in rows]
    assert not any(t.has(key) for key, _ in blocks)
    t.close()


def test_the_cache_directories_it_makes_are_its_owners_alone(tmp_path: Path) -> None:
    t = tier(tmp_path / "cache" / "kv")  # the files hold prompts' token ids
    t.close()
    assert [d.stat().st_mode & 0o777 for d in (tmp_path / "cache" / "kv", t.dir)] == [0o700, 0o700]


def test_stage_stops_at_the_first_missing_block_and_release_forgets(tmp_path: Path) -> None:
    t = tier(tmp_path)
    blocks = chain(6, t.root_key)
    write(t, blocks[:2] + blocks[3:])  # block 2 never written
    assert t.stage(7, blocks) == 2
    t.release(7)
    assert not any(t.has(key) for key, _ in blocks)
    t.close()


@pytest.mark.parametrize("damage", ["truncate", "flip_payload", "flip_header", "other_tokens", "foreign"])
def test_a_damaged_or_foreign_file_is_a_miss_and_is_removed(tmp_path: Path, damage: str) -> None:
    t = tier(tmp_path)
    blocks = chain(3, t.root_key)
    write(t, blocks)
    victim = t.dir / f"{blocks[1][0]:032x}.kv"
    data = bytearray(victim.read_bytes())
    if damage == "truncate":
        data = data[: len(data) - 10]
    elif damage == "flip_payload":
        data[HEADER.size + 4 * BS + 17] ^= 0x04
    elif damage == "flip_header":
        data[3] ^= 0x01
    elif damage == "other_tokens":
        blocks = blocks[:1] + [(blocks[1][0], [t + 1 for t in blocks[1][1]])] + blocks[2:]
    elif damage == "foreign":  # another model's block under this name
        other = tier(tmp_path / "other", ns=b"m" * 16)
        okey, _ = chain(1, other.root_key)[0]
        write(other, [(okey, blocks[1][1])])
        data = bytearray((other.dir / f"{okey:032x}.kv").read_bytes())
        other.close()
    victim.write_bytes(bytes(data))
    assert t.stage(1, blocks) == 1  # block 0 only: block 1 fails its check, so the chain ends
    assert t.counts["rejected"] == 1
    assert not victim.exists()
    t.close()


def test_a_trim_on_a_stale_listing_removes_no_more_than_the_bound_needs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two trims over the same listing (two processes sharing the directory, or a writer's and
    another's at once): the files the first removed count as gone for the second, which then
    removes nothing more (it used to go on down the list, removing the newest blocks)."""
    t = tier(tmp_path)
    per_file = t.file_bytes
    blocks = chain(8, t.root_key)
    write(t, blocks)
    for age, (key, _) in enumerate(blocks):  # the first the least recently used
        stamp = time.time() - 100 + age
        os.utime(tmp_path / t.ns.hex() / f"{key:032x}.kv", (stamp, stamp))
    stale = kv_disk.scan(tmp_path)
    t.max_bytes = 5 * per_file
    t._trim()  # to 90% of the bound: the four newest stay
    newest = sorted(f"{k:032x}.kv" for k, _ in blocks[4:])
    assert sorted(f.path.name for f in kv_disk.scan(tmp_path) if not f.is_tmp) == newest
    monkeypatch.setattr(kv_disk, "scan", lambda root: stale)  # the other trim listed before the first removed
    t._trim()
    monkeypatch.undo()
    assert sorted(f.path.name for f in kv_disk.scan(tmp_path) if not f.is_tmp) == newest
    t.close()


def test_the_cache_keeps_its_size_bound_least_recently_used_first(tmp_path: Path) -> None:
    t = tier(tmp_path)
    per_file = t.file_bytes
    old = chain(4, t.root_key, seed=1)
    write(t, old)
    t.close()
    past = time.time() - 100
    for key, _ in old[:2]:  # the first two are the least recently used
        os.utime(tmp_path / t.ns.hex() / f"{key:032x}.kv", (past, past))
    t2 = tier(tmp_path, max_bytes=5 * per_file)
    new = chain(3, t2.root_key, seed=2)
    write(t2, new)
    t2._trim()
    left = {f.path.name for f in scan(tmp_path) if not f.is_tmp}
    assert sum(f.size for f in scan(tmp_path)) <= 5 * per_file
    assert f"{old[0][0]:032x}.kv" not in left and f"{old[1][0]:032x}.kv" not in left
    assert {f"{k:032x}.kv" for k, _ in new} <= left
    t2.close()


def test_a_directory_that_cannot_be_written_gives_one_warning_and_nothing_breaks(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        t = tier(blocker)
        write(t, chain(2, t.root_key))
    assert len([w for w in seen if "KV cache" in str(w.message)]) == 1
    assert t.stage(1, chain(2, t.root_key)) == 0
    t.close()


def test_a_write_that_fails_later_warns_once_and_generation_goes_on(tmp_path: Path) -> None:
    t = tier(tmp_path)
    t.dir.rename(tmp_path / "gone")
    t.dir.write_text("the directory became a file")  # every write now fails
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        write(t, chain(3, t.root_key))
        write(t, chain(3, t.root_key, seed=5))
    assert len([w for w in seen if "KV cache" in str(w.message)]) == 1
    assert t.warning is not None and "--no-kv-cache" in t.warning
    t.close()


WRITER = """
import sys, numpy as np
from pathlib import Path
from llmlocal.engine.core.block_manager import FullBlock, prefix_blocks
from llmlocal.engine.core.kv_disk import DiskTier
t = DiskTier(Path(sys.argv[1]), b"n" * 16, 4, {nbytes})
rng = np.random.default_rng(int(sys.argv[2]))
tokens = np.random.default_rng(0).integers(0, 50000, size={n} * 4 + 1).tolist()
blocks = prefix_blocks(tokens, 4, t.root_key)
print("ready", flush=True)
for i, (key, toks) in enumerate(blocks):
    t.put([FullBlock(i, key, tuple(toks))], rng.integers(0, 256, size=(1, {nbytes}), dtype=np.uint8))
t.close()
"""


def _writer(root: Path, seed: int, n: int, nbytes: int) -> subprocess.Popen:
    code = WRITER.format(n=n, nbytes=nbytes)
    return subprocess.Popen([sys.executable, "-c", code, str(root), str(seed)], stdout=subprocess.PIPE, text=True)


def _all_files_whole(root: Path, nbytes: int) -> tuple[int, int]:
    t = DiskTier(root, b"n" * 16, 4, nbytes)
    names = {f.path.name for f in scan(root) if not f.is_tmp}
    tokens = np.random.default_rng(0).integers(0, 50000, size=2000 * 4 + 1).tolist()
    blocks = [b for b in prefix_blocks(tokens, 4, t.root_key) if f"{b[0]:032x}.kv" in names]
    for i, block in enumerate(blocks):
        t.stage(i, [block])
    t.close()
    return len(blocks), t.counts["rejected"]


def test_two_processes_writing_the_same_prefix_leave_whole_files(tmp_path: Path) -> None:
    procs = [_writer(tmp_path, seed, 200, 4096) for seed in (1, 2)]
    for p in procs:
        assert p.wait(timeout=120) == 0
    found, rejected = _all_files_whole(tmp_path, 4096)
    assert found == 200 and rejected == 0


def test_a_writer_killed_mid_write_leaves_no_file_that_is_read(tmp_path: Path) -> None:
    p = _writer(tmp_path, 1, 2000, 1 << 16)
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    deadline = time.monotonic() + 60
    while not any(not f.is_tmp for f in scan(tmp_path)) and time.monotonic() < deadline:
        time.sleep(0.01)  # until it is writing
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=30)
    found, rejected = _all_files_whole(tmp_path, 1 << 16)
    assert found > 0 and rejected == 0  # every block file present is whole; temporary ones are never read


def test_namespaces_differ_by_model_numerics_and_layout() -> None:
    base = namespace(b"f" * 16, "paged|cpu|float32|kv=float16", 16, (3, 64, 30))
    assert base != namespace(b"g" * 16, "paged|cpu|float32|kv=float16", 16, (3, 64, 30))
    assert base != namespace(b"f" * 16, "paged|cpu|float32|kv=float32", 16, (3, 64, 30))
    assert base != namespace(b"f" * 16, "paged|cpu|float32|kv=float16", 32, (3, 64, 30))
    assert base == namespace(b"f" * 16, "paged|cpu|float32|kv=float16", 16, (3, 64, 30))


# ---- the paged engine with the tier --------------------------------------------------------
PROMPT = ("You are a careful assistant. Here is a list of facts to keep in mind: the sky is blue, "
          "grass is green, water boils at 100 degrees Celsius at sea level, and the moon orbits the "
          "earth about every 27 days. ") * 3


def greedy(engine: Engine, content: str, max_tokens: int = 24) -> DoneEvent:
    done = None
    request = Request.chat([{"role": "user", "content": content}], SamplingParams(temperature=0, max_tokens=max_tokens))
    for event in engine.generate(request):
        if isinstance(event, DoneEvent):
            done = event
    assert done is not None
    return done


def plan(directory: Path | None, **kw) -> Plan:
    return Plan(backend="paged", device="cpu", n_ctx=1024, max_batch=4,
                kv_cache_dir=str(directory) if directory else None, **kw)


@pytest.mark.parametrize("kv_dtype", ["auto", "q8_0"])  # q8_0: int8 rows with their scales in the payload
def test_greedy_tokens_are_the_same_cold_warm_in_memory_and_warm_from_disk(tmp_path: Path, kv_dtype: str) -> None:
    with Engine.load(plan(None, kv_dtype=kv_dtype)) as e:
        without = greedy(e, PROMPT)
    with Engine.load(plan(tmp_path, kv_dtype=kv_dtype)) as e:
        cold = greedy(e, PROMPT)
        warm_memory = greedy(e, PROMPT)
        # whether a resumed prompt's tail is computed as the cold prompt's rows were (the
        # bfloat16 tiles and the GGUF types' kernels, ModelRunner.prompt_tiles) or as decode rows
        runner = e.backend.runner  # type: ignore[attr-defined]
        as_prompt_rows = runner.prompt_tiles and runtime.qmat_tiles()
    with Engine.load(plan(tmp_path, kv_dtype=kv_dtype)) as e:  # a new process's engine: only the disk has the blocks
        warm_disk = greedy(e, PROMPT)
        assert e.backend.disk.counts["read"] > 0  # type: ignore[attr-defined]
    assert cold.stats.cached_prompt_tokens == 0
    assert warm_memory.stats.cached_prompt_tokens > 0
    assert warm_disk.stats.cached_prompt_tokens == warm_memory.stats.cached_prompt_tokens
    assert without.text == cold.text  # two cold runs
    assert warm_memory.text == warm_disk.text  # the same blocks, from memory or from disk
    if cold.text != warm_memory.text and not as_prompt_rows:
        pytest.xfail("a resumed prompt's tail is decode rows here (native attention), the cold prompt's rows "
                     "were prompt rows (torch's attention): a near tie may flip (seen with q8_0 on a Zen 3 host)")
    assert cold.text == warm_memory.text


def test_a_reply_is_kept_too_so_the_next_turn_after_a_restart_starts_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the reply's K/V, decoded a token at a time, and the cold run's, computed as prompt rows,
    # agree to float rounding with fp32 activations (the starter's on AVX-512); with int8 ones a
    # near tie can round the other way and the two replies part
    monkeypatch.setenv("LLMLOCAL_NATIVE_ACTIVATIONS", "fp32")
    with Engine.load(plan(tmp_path)) as e:
        first = greedy(e, PROMPT, max_tokens=48)
    history = [{"role": "user", "content": PROMPT}, {"role": "assistant", "content": first.text},
               {"role": "user", "content": "And what colour is grass?"}]
    request = Request.chat(history, SamplingParams(temperature=0, max_tokens=8))
    with Engine.load(plan(tmp_path)) as e:
        done = [ev for ev in e.generate(request) if isinstance(ev, DoneEvent)][0]
        prompt_tokens = done.stats.prompt_tokens
    with Engine.load(plan(None)) as e:
        reference = [ev for ev in e.generate(request) if isinstance(ev, DoneEvent)][0]
    assert done.text == reference.text
    assert done.stats.cached_prompt_tokens > first.stats.prompt_tokens  # past the first prompt: into the reply
    assert done.stats.cached_prompt_tokens >= prompt_tokens - 64


def test_a_draft_models_blocks_are_kept_too_so_a_reopened_chat_drafts_without_catching_up(tmp_path: Path) -> None:
    # the starter drafting for itself: the draft's tier is its own (another namespace, the same file)
    drafting = plan(tmp_path, draft="smollm2-135m", draft_k=3)
    with Engine.load(drafting) as e:
        first = greedy(e, PROMPT)
        draft_tier = e.backend.drafter.disk  # type: ignore[attr-defined]
        assert draft_tier is not None and draft_tier.ns != e.backend.disk.ns  # type: ignore[attr-defined]
    assert draft_tier.counts["written"] > 0  # closing the engine wrote what was queued
    with Engine.load(drafting) as e:
        again = greedy(e, PROMPT)
        drafter = e.backend.drafter  # type: ignore[attr-defined]
        read = drafter.disk.counts["read"]
        held = drafter.blocks.num_used_blocks
    assert again.stats.cached_prompt_tokens > 0
    # the mirror's history, found on disk: every full block of the prompt but the last (its
    # last token is always recomputed), none computed again
    assert read >= first.stats.prompt_tokens // drafter.runner.block_size - 1
    assert held == 0  # the mirror's blocks freed with the request
    assert again.stats.drafted_tokens and again.stats.accepted_tokens is not None


def test_concurrent_requests_warm_from_disk_equal_each_alone(tmp_path: Path) -> None:
    import threading

    prompts = [PROMPT + f" Question {i}: name one thing that is blue." for i in range(4)]
    with Engine.load(plan(None)) as e:
        alone = [greedy(e, p).text for p in prompts]
    with Engine.load(plan(tmp_path)) as e:
        for p in prompts:
            greedy(e, p)
    results: list[DoneEvent | None] = [None] * 4
    with Engine.load(plan(tmp_path)) as e:
        def work(i: int) -> None:
            results[i] = greedy(e, prompts[i])

        threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
    assert [r.text for r in results if r is not None] == alone
    assert all(r is not None and r.stats.cached_prompt_tokens > 0 for r in results)


def test_blocks_of_another_kv_dtype_are_never_used(tmp_path: Path) -> None:
    with Engine.load(plan(tmp_path, kv_dtype="f32")) as e:
        greedy(e, PROMPT, max_tokens=4)
    with Engine.load(plan(tmp_path, kv_dtype="f16")) as e:
        done = greedy(e, PROMPT, max_tokens=4)
    assert done.stats.cached_prompt_tokens == 0
    assert len([d for d in tmp_path.iterdir() if d.is_dir()]) == 2
