"""Benchmark scenarios behind `llmlocal bench`. Each returns one JSON-ready dict.

* decode  batch-1 TTFT, decode tok/s, ITL p50/p95 and memory-bandwidth utilisation (MBU) per
          backend: MBU = bytes read per token (weights + KV of the context) x tok/s / the
          measured read bandwidth of the memory the weights are in (main memory, or the GPU's); the backends take turns, round by round, and
          each reports its speed relative to the first backend per round and the median.
          After a short prompt, or after one of about N tokens (long-context decode), and per
          KV cache type when several are asked for.
* batch   N concurrent requests of mixed prompt and output lengths: aggregate output tok/s of
          `paged` serving them together vs `llamacpp` serving them one after another, and KV
          waste (allocated-but-unfilled slots / allocated slots) sampled during the run.
* prefix  TTFT of a follow-up chat turn on a long history, with the history's KV cached vs
          computed from scratch (paged backend).
* prefill TTFT of a long prompt, cold, per backend, each in its own process, taking turns.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import random
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from typing import Any

from llmlocal.engine.engine import Engine
from llmlocal.engine.openmp import fastest_when_idle
from llmlocal.engine.plan import Plan
from llmlocal.engine.types import DoneEvent, Request, SamplingParams, Stats
from llmlocal.native.cpu.bench import measure_bandwidth_gb_s

WORDS = (
    "river stone light garden window morning paper music harbour bridge winter orange "
    "market kitchen forest letter engine silver cloud village summer story island road"
).split()


def _prompt(n_words: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def _run(engine: Engine, messages: list[dict[str, str]], max_tokens: int, ignore_eos: bool = False) -> DoneEvent:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=ignore_eos)
    done = None
    for event in engine.generate(Request.chat(messages, params)):
        if isinstance(event, DoneEvent):
            done = event
    assert done is not None
    return done


def all_at_once(one: Callable[[int], None], n: int) -> float:
    """Call ``one(0)`` .. ``one(n - 1)`` each in a thread of its own, all started together (the
    requests of a batch arriving at once); the seconds until the last returns."""
    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    t = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return time.perf_counter() - t


def _weight_bytes(engine: Engine) -> int:
    runner = getattr(engine.backend, "runner", None)
    if runner is not None:
        return int(runner.model.weight_bytes())
    return engine.model.spec.weight_bytes


def _weights_device(engine: Engine) -> str:
    """Where the weights a decode step reads live: ``cuda`` or ``cpu`` (llama.cpp: its CPU
    figure, offloaded layers or not)."""
    runner = getattr(engine.backend, "runner", None)
    return runner.model.device.type if runner is not None else "cpu"


def read_bandwidth_gb_s(device: str) -> float:
    """Read bandwidth of the memory on ``device``: main memory for ``cpu``, the GPU's own for
    ``cuda`` (the median of timed sums over a buffer far larger than its L2 cache)."""
    if device != "cuda":
        return measure_bandwidth_gb_s()
    import torch

    a = torch.ones(1 << 28, dtype=torch.float32, device="cuda")  # 1 GiB
    times = []
    for _ in range(12):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a.sum()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del a
    torch.cuda.empty_cache()
    return (1 << 30) / statistics.median(times[2:]) / 1e9


def _kv_value_bytes(engine: Engine) -> float:
    runner = getattr(engine.backend, "runner", None)
    if runner is not None:  # the pool's bytes per value (q8_0: an int8 and a share of its row's scale)
        cfg = runner.model.cfg
        return runner.block_nbytes / runner.block_size / (2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim)
    kv = engine.plan.kv_dtype if getattr(engine, "plan", None) is not None else "auto"
    return 34 / 32 if kv == "q8_0" else 2.0  # llama.cpp's cache, f16 by default


class _EngineProcess:
    """An engine loaded in a process of its own, asked for one request at a time over a pipe.

    `bench decode` keeps its backends apart: in one process, the paged engine's threads made
    llama.cpp's OpenMP threads wait by sleeping instead of spinning (libgomp stops spinning
    when a process holds more OpenMP threads than it has CPUs), which cost llama.cpp a third
    of its decode speed on a two-core machine. Each backend alone in its process is what a
    user runs."""

    def __init__(self, plan: Plan, warmup: list[dict[str, str]]) -> None:
        ctx = multiprocessing.get_context("spawn")  # no copy of this process's threads or torch state
        self._conn, child = ctx.Pipe()
        # llama.cpp at its fastest on an idle machine: its OpenMP threads spin as long as libgomp's
        # default lets them, not llmlocal's short wait (openmp.py)
        env = fastest_when_idle() if plan.backend == "llamacpp" else {}
        self._proc = ctx.Process(target=_engine_process, args=(child, plan, warmup, env), daemon=True)
        self._proc.start()
        child.close()
        kind, value = self._recv()
        if kind == "error":
            self.close()
            raise value
        self.info: dict[str, float] = value

    def _recv(self) -> tuple[str, Any]:
        try:
            return self._conn.recv()
        except EOFError:
            raise RuntimeError(f"the benchmark's engine process ended (exit code {self._proc.exitcode})") from None

    def run(self, messages: list[dict[str, str]], max_tokens: int, ignore_eos: bool = False) -> Stats:
        return self.reply(messages, max_tokens, ignore_eos)[0]

    def reply(self, messages: list[dict[str, str]], max_tokens: int, ignore_eos: bool = False) -> tuple[Stats, str]:
        """The request's stats and its reply's text."""
        self._conn.send((messages, max_tokens, ignore_eos))
        kind, value = self._recv()
        if kind == "error":
            raise value
        return value

    def close(self) -> None:
        try:
            self._conn.send(None)
        except OSError:
            pass
        self._proc.join(timeout=30)
        if self._proc.is_alive():
            self._proc.kill()
        self._conn.close()


@contextlib.contextmanager
def _engines_apart(
    model: str | None, backends: list[str], n_ctx: int, threads: int | None, warmup: list[dict[str, str]],
    kv_dtypes: dict[str, str] | None = None,
) -> Iterator[dict[str, _EngineProcess]]:
    """Each backend's engine loaded in a process of its own, closed on the way out. ``kv_dtypes``:
    engines by label (``backend`` or ``backend:kv_dtype``) and their KV cache type. Packed
    weights are kept where the CLI keeps them, so a load is timed as a user's second one is."""
    from llmlocal.native.cpu.packed_cache import default_dir

    engines: dict[str, _EngineProcess] = {}
    try:
        for name in backends:
            backend, kv = name.split(":")[0], (kv_dtypes or {}).get(name, "auto")
            plan = Plan(model=model, backend=backend, n_ctx=n_ctx, threads=threads, kv_dtype=kv,
                        packed_cache_dir=str(default_dir()))
            engines[name] = _EngineProcess(plan, warmup)
        yield engines
    finally:
        for engine in engines.values():
            engine.close()


def _engine_process(conn: Connection, plan: Plan, warmup: list[dict[str, str]], env: dict[str, str]) -> None:
    """The child of `_EngineProcess`: load, warm up, then answer requests until told to stop."""
    os.environ.update(env)  # before the backend's libraries load
    t0 = time.perf_counter()
    try:
        engine = Engine.load(plan)
    except Exception as e:  # noqa: BLE001 - handed to the parent, which raises it
        conn.send(("error", e))
        return
    load_s = time.perf_counter() - t0
    with engine:
        if warmup:
            _run(engine, warmup, 8)  # first-call allocations, caches
        kv_value = _kv_value_bytes(engine)
        conn.send(("ready", {"load_s": load_s, "weight_bytes": _weight_bytes(engine), "device": _weights_device(engine),
                             "kv_bytes_per_token": engine.model.spec.kv_bytes_per_token(kv_value)}))
        while (job := conn.recv()) is not None:
            try:
                done = _run(engine, *job)
                conn.send(("stats", (done.stats, done.text)))
            except Exception as e:  # noqa: BLE001
                conn.send(("error", e))


def bench_decode(
    model: str | None, backends: list[str], max_tokens: int = 128, n_ctx: int = 2048, rounds: int = 3,
    threads: int | None = None, prompt_tokens: int | None = None, kv_dtypes: list[str] | None = None,
) -> dict[str, Any]:
    """Every backend loaded at once, each in a process of its own (`_EngineProcess`), then
    `rounds` rounds of one request per backend in turn: a machine whose memory bandwidth
    drifts (shared hosts: a third, here) moves all of them alike, so the per-round ratios to
    the first backend mean something even when the absolute figures drift. Each backend's
    figures are from its median round.

    ``prompt_tokens``: decode after a prompt of about that many tokens (one word a token), the
    context growing to fit it. Every round's prompt is the same long text with the round's
    number at its end, so rounds after the first take the text from the prefix cache (paged)
    or the retained context (llama.cpp): their TTFT is not a cold one, their decode is.
    ``kv_dtypes``: each backend once per KV cache type, labelled ``backend:type`` when there
    are several (``auto`` is the backend's default)."""
    kinds = kv_dtypes or ["auto"]
    labels = {f"{b}:{k}" if len(kinds) > 1 else b: k for b in backends for k in kinds}
    names = list(labels)
    out: dict[str, Any] = {"scenario": "decode", "bandwidth_gb_s": 0.0, "backends": {}}
    messages = [{"role": "user", "content": "Write a long story about a lighthouse keeper and the sea."}]
    if prompt_tokens:
        text = "Here is a list of words. " + _prompt(prompt_tokens, 7) + "\nNow write a long story using these words."
        messages = [{"role": "user", "content": text}]
        n_ctx = max(n_ctx, -(-(prompt_tokens + max_tokens + 512) // 1024) * 1024)
    warmup = [{"role": "user", "content": "Say hello."}]
    with _engines_apart(model, names, n_ctx, threads, warmup, labels) as engines:
        backends = names
        bandwidth = {d: read_bandwidth_gb_s(d) for d in sorted({str(e.info["device"]) for e in engines.values()})}
        out["bandwidth_gb_s"] = round(bandwidth[str(engines[names[0]].info["device"])], 2)  # the first backend's
        runs: dict[str, list[Stats]] = {name: [] for name in backends}
        for i in range(rounds):
            prompt = [{"role": "user", "content": m["content"] + f" ({i})"} for m in messages]
            for name in backends:
                runs[name].append(engines[name].run(prompt, max_tokens, ignore_eos=True))
        first = backends[0]
        for name in backends:
            info = engines[name].info
            s = _median_stats(runs[name])
            context = s.prompt_tokens + s.completion_tokens / 2  # mean context while decoding
            per_token = info["weight_bytes"] + info["kv_bytes_per_token"] * context
            ratios = [(a.decode_tok_s or 0) / (b.decode_tok_s or 1) for a, b in zip(runs[name], runs[first])]
            out["backends"][name] = {
                "load_s": round(info["load_s"], 3),  # Engine.load in a fresh process, the others idle
                "ttft_s": s.ttft_s,
                "decode_tok_s": s.decode_tok_s,
                "itl_ms_p50": s.itl_ms_p50,
                "itl_ms_p95": s.itl_ms_p95,
                "bytes_per_token": int(per_token),
                "device": info["device"],
                "bandwidth_gb_s": round(bandwidth[str(info["device"])], 2),
                "mbu": per_token * (s.decode_tok_s or 0) / (bandwidth[str(info["device"])] * 1e9),
                "prompt_tokens": s.prompt_tokens,
                "completion_tokens": s.completion_tokens,
                f"decode_vs_{first}_per_round": [round(r, 3) for r in ratios],
                f"decode_vs_{first}": round(statistics.median(ratios), 3),
            }
    out["model"] = model or "smollm2-135m"
    return out


def bench_prefill(
    model: str | None, backends: list[str], prompt_tokens: int = 1000, rounds: int = 3, threads: int | None = None,
) -> dict[str, Any]:
    """Time to first token on a long prompt, cold: every backend in a process of its own, taking
    turns for `rounds` rounds, each round a prompt of its own (nothing for the prefix cache to
    find but the chat template's first tokens). Per backend: the median round's TTFT and prompt
    tokens per second, and per round the first backend's TTFT over this one's (above 1: faster)."""
    out: dict[str, Any] = {"scenario": "prefill", "backends": {}}
    n_ctx = max(2048, 2 * prompt_tokens)
    warmup = [{"role": "user", "content": "Say hello."}]
    with _engines_apart(model, backends, n_ctx, threads, warmup) as engines:
        runs: dict[str, list[Stats]] = {name: [] for name in backends}
        for i in range(rounds):
            # about one token per word; a different text each round
            prompt = [{"role": "user", "content": "Summarise this list of words: " + _prompt(prompt_tokens, 100 + i)}]
            for name in backends:
                # ignore_eos: a first token even where the reply would end at once (the starter's)
                runs[name].append(engines[name].run(prompt, 1, ignore_eos=True))
        first = backends[0]
        for name in backends:
            s = _median_stats(runs[name], by="ttft_s")
            ratios = [(b.ttft_s or 0) / (a.ttft_s or 1) for a, b in zip(runs[name], runs[first])]
            out["backends"][name] = {
                "prompt_tokens": s.prompt_tokens,
                "ttft_s": s.ttft_s,
                "prefill_tok_s": s.prompt_tokens / s.ttft_s if s.ttft_s else None,
                f"speed_vs_{first}_per_round": [round(r, 3) for r in ratios],
                f"speed_vs_{first}": round(statistics.median(ratios), 3),
            }
    out["model"] = model or "smollm2-135m"
    return out


def _median_stats(stats: list[Stats], by: str = "decode_tok_s") -> Stats:
    """The run with the median figure ``by`` (keeps each figure from one real run)."""
    ordered = sorted(stats, key=lambda s: getattr(s, by) or 0.0)
    return ordered[len(ordered) // 2]


def _batch_requests(n: int, seed: int = 0, text_seed: int = 0) -> list[tuple[str, int]]:
    """n (prompt, max_tokens): lengths from ``seed``; the words from ``text_seed`` too (the same
    lengths, another text)."""
    rng = random.Random(seed)
    return [(_prompt(rng.randint(10, 200), seed + i + 1000 * text_seed), rng.choice([16, 32, 64, 128]))
            for i in range(n)]


def bench_batch(model: str | None, requests: int = 16, n_ctx: int = 2048, baseline: str = "llamacpp",
                rounds: int = 1) -> dict[str, Any]:
    """The paged engine serving N requests at once against ``baseline`` serving them one after
    another: llama.cpp, or the paged engine itself (batch N against batch 1, where llama.cpp is
    not installed: the GPU check). Each round the engines take turns, each loaded on its own
    (no two in one process), on requests of the same lengths and a new text, so that no round
    finds its prompts in a cache a run before it filled (the paged baseline's requests and the
    batch's differ in text too: one engine runs both)."""
    if baseline not in ("llamacpp", "paged"):
        raise ValueError(f"baseline must be llamacpp or paged, not {baseline!r}")
    total_out = sum(n for _, n in _batch_requests(requests))
    warm = [{"role": "user", "content": "warm up"}]
    paged_plan = Plan(model=model, backend="paged", n_ctx=n_ctx, max_batch=max(requests, 1))

    def one_after_another(engine: Engine, work: list[tuple[str, int]]) -> tuple[int, float]:
        t = time.perf_counter()
        produced = sum(_run(engine, [{"role": "user", "content": p}], n).stats.completion_tokens for p, n in work)
        return produced, time.perf_counter() - t

    def at_once(engine: Engine, work: list[tuple[str, int]], waste: list[float]) -> tuple[int, float]:
        stop = threading.Event()

        def sample_waste() -> None:
            backend = engine.backend
            while not stop.is_set():
                with backend._lock:  # type: ignore[attr-defined]
                    if backend.scheduler.running:  # type: ignore[attr-defined]
                        waste.append(backend.scheduler.kv_waste())  # type: ignore[attr-defined]
                time.sleep(0.02)

        results: list[int] = [0] * len(work)

        def one(i: int) -> None:
            p, n = work[i]
            results[i] = _run(engine, [{"role": "user", "content": p}], n).stats.completion_tokens

        sampler = threading.Thread(target=sample_waste, daemon=True)
        sampler.start()
        elapsed = all_at_once(one, len(work))
        stop.set()
        sampler.join()
        return sum(results), elapsed

    paged_speeds: list[float] = []
    base_speeds: list[float] = []
    waste: list[float] = []
    for r in range(rounds):
        together = _batch_requests(requests, text_seed=2 * r)
        # llama.cpp runs in a process of its own: the same texts; the paged baseline, other texts
        alone = together if baseline == "llamacpp" else _batch_requests(requests, text_seed=2 * r + 1)
        if baseline == "llamacpp":
            with Engine.load(Plan(model=model, backend="llamacpp", n_ctx=n_ctx)) as engine:
                _run(engine, warm, 4)
                produced, seconds = one_after_another(engine, alone)
                base_speeds.append(produced / seconds)
        with Engine.load(paged_plan) as engine:
            _run(engine, warm, 4)
            if baseline == "paged":
                produced, seconds = one_after_another(engine, alone)
                base_speeds.append(produced / seconds)
            produced, seconds = at_once(engine, together, waste)
            paged_speeds.append(produced / seconds)
    ratios = [p / b for p, b in zip(paged_speeds, base_speeds)]
    return {
        "scenario": "batch",
        "model": model or "smollm2-135m",
        "requests": requests,
        "output_tokens": total_out,
        "paged_tok_s": statistics.median(paged_speeds),
        "llamacpp_tok_s" if baseline == "llamacpp" else "paged_batch1_tok_s": statistics.median(base_speeds),
        "speedup": statistics.median(ratios),
        "speedup_per_round": [round(x, 3) for x in ratios],
        "kv_waste": statistics.fmean(waste) if waste else 0.0,
    }


def bench_prefix(model: str | None, history_tokens: int = 1500, n_ctx: int = 4096, together: int = 4) -> dict[str, Any]:
    with Engine.load(Plan(model=model, backend="paged", n_ctx=n_ctx)) as engine:
        history: list[dict[str, str]] = []
        words = 60
        while not history or engine.count_tokens(history) < history_tokens:
            history += [
                {"role": "user", "content": _prompt(words, len(history))},
                {"role": "assistant", "content": _prompt(words, len(history) + 1)},
            ]
        follow = history + [{"role": "user", "content": "Summarise our conversation."}]
        # Cold: nothing cached (a fresh engine state for this text).
        cold = _run(engine, follow, 1, ignore_eos=True).stats
        # Cached: the history was served before (the previous turn), the follow-up extends it.
        engine_turn = history + [{"role": "user", "content": "Now list the words you remember."}]
        _run(engine, engine_turn, 1)
        cached = _run(engine, engine_turn[:-1] + [{"role": "user", "content": "Now list the words you remember!"}], 1,
                      ignore_eos=True).stats
        return {
            "scenario": "prefix",
            "model": model or "smollm2-135m",
            "history_tokens": engine.count_tokens(history),
            "ttft_cold_s": cold.ttft_s,
            "ttft_cached_s": cached.ttft_s,
            "cached_prompt_tokens": cached.cached_prompt_tokens,
            "ratio": (cached.ttft_s or 0) / (cold.ttft_s or 1),
            **_shared_history(engine, together),
        }


def _shared_history(engine: Engine, n: int) -> dict[str, Any]:
    """``n`` questions on a fresh history of about 400 tokens (as a long system prompt would be),
    sent together, cold: the prompt rows they computed between them (every prompt's rows less
    its hits: the shared ones once, ideally), and the last first token."""
    history: list[dict[str, str]] = []
    while not history or engine.count_tokens(history) < 400:  # words not served before: nothing cached
        history += [{"role": "user", "content": _prompt(60, 10_000 + len(history))},
                    {"role": "assistant", "content": _prompt(60, 10_001 + len(history))}]
    out: list[Stats | None] = [None] * n

    def ask(i: int) -> None:
        out[i] = _run(engine, history + [{"role": "user", "content": f"Question {i + 1}: which word came {i + 2}th?"}],
                      1, ignore_eos=True).stats

    wall = all_at_once(ask, n)
    stats = [s for s in out if s is not None]
    return {
        "together_requests": n,
        "together_shared_tokens": engine.count_tokens(history),
        "together_prompt_tokens": sum(s.prompt_tokens for s in stats),
        "together_computed_tokens": sum(s.prompt_tokens - (s.cached_prompt_tokens or 0) for s in stats),
        "together_last_ttft_s": max(s.ttft_s or 0.0 for s in stats),
        "together_wall_s": wall,
    }
