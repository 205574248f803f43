"""Predicted vs measured memory: does the memory model match what loading really costs?

Each configuration is measured in a fresh subprocess (a process's RSS never shrinks
reliably, so configurations measured one after another in one process would read each
other's leftovers):

    1. import the backend's libraries (llama_cpp; torch for the paged engine), read the
       baseline RSS and reset the peak counter (``echo 5 > /proc/self/clear_refs`` sets
       VmHWM to the current RSS);
    2. load the model through `Engine.load` with the configuration's `Plan`;
    3. run the worst case the plan allows: one prompt that fills the context window (less the
       few tokens generated after it), prefilled in n_batch chunks, then a short generation;
    4. report VmHWM - baseline (the peak, loading included), VmRSS - baseline, and the RSS of
       the model file's mappings.

llama.cpp memory-maps the weights and populates the mapping at load, so the weight pages are
resident (and in the delta) before any forward pass; the workload's generation touches them
anyway. The prediction compared with the measured peak is the memory model's ``peak``
(its ``total``, or the paged loader's transient when that is higher), file pages included.

    python -m llmlocal.app.bench.memory_check              # the validation table (15 configurations)
    python -m llmlocal.app.bench.memory_check --long       # and the 1B shape at 8192 (hours on 2 busy cores)
    python -m llmlocal.app.bench.memory_check --quick      # starter, llamacpp, context 512
    python -m llmlocal.app.bench.memory_check --model M.gguf --ctx 512,4096 --threads 2   # your files
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field, fields
from typing import Any

_STATUS_KEYS = ("VmRSS", "VmHWM", "RssAnon", "RssFile")


@dataclass(frozen=True)
class CheckConfig:
    """One configuration to measure: a model, a backend and the plan fields that size memory."""

    model: str  # name or path
    backend: str  # "llamacpp" | "paged"
    n_ctx: int
    kv_dtype: str = "auto"  # llamacpp: "f16" or "q8_0" (with flash attention, as the backend runs it)
    plan: dict[str, Any] = field(default_factory=dict)  # other Plan fields (threads, kv_blocks, ...)
    fill: float = 1.0  # the prompt fills this fraction of the context window
    gen: int = 4  # tokens generated after the prompt
    label: str = ""

    def to_plan(self) -> Any:
        from llmlocal.engine.plan import Plan

        return Plan(model=self.model, backend=self.backend, device="cpu", n_ctx=self.n_ctx, kv_dtype=self.kv_dtype, **self.plan)


@dataclass(frozen=True)
class Measurement:
    peak: int  # VmHWM - baseline over loading and the workload, bytes
    load_peak: int  # VmHWM - baseline while loading
    serve_peak: int  # VmHWM - baseline during the workload
    after: int  # VmRSS - baseline after the workload
    loaded: int  # VmRSS - baseline right after loading
    anon_after: int  # RssAnon - baseline RssAnon, after the workload
    anon_loaded: int  # the same right after loading
    file_rss: int  # resident bytes of the model file's mappings
    prompt_tokens: int
    n_ctx: int


@dataclass(frozen=True)
class Row:
    config: CheckConfig
    predicted: int  # the memory model's peak, bytes
    measured: Measurement

    @property
    def error(self) -> float:
        """|predicted - measured| / measured, on the peak."""
        return abs(self.predicted - self.measured.peak) / self.measured.peak


# ---- the subprocess -----------------------------------------------------------------------
def _status() -> dict[str, int]:
    out: dict[str, int] = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in _STATUS_KEYS:
                out[key] = int(value.split()[0]) * 1024  # kB
    return out


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS


def _file_rss(path: str) -> int:
    """Resident bytes of every mapping of ``path`` (from /proc/self/smaps)."""
    real = os.path.realpath(path)
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(maxsplit=5)
            if len(head) >= 5 and "-" in head[0] and not head[0].endswith(":"):
                inside = len(head) == 6 and head[5].strip() == real
            elif inside and line.startswith("Rss:"):
                total += int(line.split()[1]) * 1024
    return total


def _child(config: CheckConfig) -> dict[str, Any]:
    """Runs in the subprocess: load, fill the context, generate; report the RSS deltas."""
    import llama_cpp  # noqa: F401  (the baseline holds the libraries, not the model)

    if config.backend == "paged":
        import torch  # noqa: F401
        from llmlocal.engine.backends import paged  # noqa: F401
    from llmlocal.engine import DoneEvent, Engine, Request, SamplingParams
    from llmlocal.models import resolve

    path = resolve(config.model).path
    base = _status()
    _reset_peak()
    engine = Engine.load(config.to_plan())
    loaded = _status()
    _reset_peak()
    # The worst case for the embedding rows read from the file: every prompt token another one
    # (the pieces of tokens spread over the vocabulary), trimmed to fit.
    target = max(8, int(config.fill * engine.n_ctx) - config.gen - 1)
    vocab = engine.model.spec.vocab_size
    pieces = [engine.token_bytes(t).decode("utf-8", "ignore") for t in range(vocab // 7, vocab, 7)]
    pieces = [p for p in pieces if p.strip()] * (1 + target // max(1, len(pieces)))
    n = target
    while True:
        request = Request(prompt="".join(pieces[:n]), sampling=SamplingParams(temperature=0, max_tokens=config.gen))
        count = len(engine.prompt_ids(request))
        if count <= target:
            break
        n -= max(1, (count - target) * n // count)
    done = None
    for event in engine.generate(request):
        if isinstance(event, DoneEvent):
            done = event
    after = _status()
    result = {
        "peak": max(loaded["VmHWM"], after["VmHWM"]) - base["VmRSS"],
        "load_peak": loaded["VmHWM"] - base["VmRSS"],
        "serve_peak": after["VmHWM"] - base["VmRSS"],
        "after": after["VmRSS"] - base["VmRSS"],
        "loaded": loaded["VmRSS"] - base["VmRSS"],
        "anon_after": after["RssAnon"] - base["RssAnon"],
        "anon_loaded": loaded["RssAnon"] - base["RssAnon"],
        "file_rss": _file_rss(path),
        "prompt_tokens": done.stats.prompt_tokens if done else 0,
        "n_ctx": engine.n_ctx,
    }
    engine.close()
    return result


# ---- the parent ---------------------------------------------------------------------------
def measure(config: CheckConfig, timeout: float = 3600.0) -> Measurement:
    """Measure one configuration in a fresh Python process."""
    proc = subprocess.run(
        [sys.executable, "-m", "llmlocal.app.bench.memory_check", "--child", json.dumps(asdict(config))],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"measuring {config} failed:\n{proc.stderr[-3000:]}")
    return Measurement(**json.loads(proc.stdout.strip().splitlines()[-1]))


def predict(config: CheckConfig) -> int:
    """The memory model's peak for ``config`` on this machine, bytes."""
    from llmlocal.engine.planning.hardware import simd_features
    from llmlocal.engine.planning.memory_model import estimate
    from llmlocal.models import resolve

    spec = resolve(config.model).spec
    return sum(d.peak for d in estimate(spec, config.to_plan(), simd_features()))


def validate(configs: list[CheckConfig], log: Any = None) -> list[Row]:
    """Predict and measure every configuration (one subprocess each)."""
    rows = []
    for config in configs:
        row = Row(config, predict(config), measure(config))
        rows.append(row)
        if log is not None:
            print(format_row(row), file=log, flush=True)
    return rows


def format_row(row: Row) -> str:
    c, m = row.config, row.measured
    if c.backend == "llamacpp":
        kv = c.kv_dtype
    else:
        from llmlocal.engine.plan import paged_kv_dtype

        kv = paged_kv_dtype(c.to_plan(), "fp32", on_gpu=False)
    mib = 1 << 20
    return (
        f"| {c.label or c.model:<14} | {c.backend:<8} | {c.n_ctx:>5} | {kv:<4} | {row.predicted / mib:>8.1f} "
        f"| {m.peak / mib:>8.1f} | {row.error * 100:>5.1f}% |"
    )


def format_table(rows: list[Row]) -> str:
    head = [
        "| model          | backend  |   ctx | KV   | pred MiB | meas MiB | error  |",
        "|----------------|----------|-------|------|----------|----------|--------|",
    ]
    errors = [r.error for r in rows]
    tail = [f"max error {max(errors) * 100:.1f}%, median {statistics.median(errors) * 100:.1f}%"] if rows else []
    return "\n".join(head + [format_row(r) for r in rows] + tail)


def model_configs(models: list[str], contexts: list[int], backends: list[str], threads: int = 1) -> list[CheckConfig]:
    """Each model in each backend at each context: the paged engine with one slot of the whole
    window, llama.cpp with its f16 cache."""
    out = []
    for model in models:
        label = os.path.basename(model)[:14]
        for n_ctx in contexts:
            for backend in backends:
                plan: dict[str, Any] = {"threads": threads}
                if backend == "paged":
                    plan.update(kv_blocks=-(-n_ctx // 16), max_batch=1)
                out.append(CheckConfig(model, backend, n_ctx, "f16" if backend == "llamacpp" else "auto", plan, label=label))
    return out


def default_configs(workdir: str, quick: bool = False, long: bool = False) -> list[CheckConfig]:
    """The starter and a random-weight Llama-3.2-1B (Q4_0) in both backends at several contexts
    (``long``: the 1B at 8192 too, which prefills for a long time on a small CPU)."""
    one = {"threads": 1}  # a busy machine: one thread keeps llama.cpp from spinning on a shared core
    starter = [CheckConfig("smollm2-135m", "llamacpp", 512, "f16", one, label="smollm2-135m")]
    if quick:
        return starter
    from llmlocal.quant.synthetic import random_gguf

    big = str(random_gguf(os.path.join(workdir, "llama-3.2-1b-q4_0.gguf"), shape="llama-3.2-1b", qtype="q4_0"))
    out: list[CheckConfig] = []
    big_contexts = (512, 2048, 8192) if long else (512, 2048)
    for model, label, contexts in (("smollm2-135m", "smollm2-135m", (512, 2048, 8192)), (big, "llama-1b-shape", big_contexts)):
        for n_ctx in contexts:
            paged = {**one, "kv_blocks": -(-n_ctx // 16), "max_batch": 1}
            out += [
                CheckConfig(model, "llamacpp", n_ctx, "f16", one, label=label),
                CheckConfig(model, "llamacpp", n_ctx, "q8_0", one, label=label),
                CheckConfig(model, "paged", n_ctx, "auto", paged, label=label),
            ]
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        known = {f.name for f in fields(CheckConfig)}  # the parent may be an older copy of this module
        print(json.dumps(_child(CheckConfig(**{k: v for k, v in json.loads(argv[1]).items() if k in known}))))
        return 0
    p = argparse.ArgumentParser(prog="python -m llmlocal.app.bench.memory_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="one cheap configuration: starter, llamacpp, context 512")
    p.add_argument("--long", action="store_true", help="also the 1B shape at context 8192 (slow)")
    p.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "llmlocal-memory-check"),
                   help="where the random-weight 1B GGUF is written (700 MB, reused)")
    p.add_argument("--model", action="append", default=None, metavar="M",
                   help="measure these models instead (name or path; repeat the option), at --ctx, in --backends")
    p.add_argument("--ctx", default="512,4096", help="contexts for --model (comma-separated; default 512,4096)")
    p.add_argument("--backends", default="paged", help="backends for --model (comma-separated; default paged)")
    p.add_argument("--threads", type=int, default=1, help="threads for --model's engines (default 1)")
    args = p.parse_args(argv)
    os.makedirs(args.workdir, exist_ok=True)
    if args.model:
        contexts = [int(c) for c in args.ctx.split(",")]
        configs = model_configs(args.model, contexts, args.backends.split(","), args.threads)
    else:
        configs = default_configs(args.workdir, args.quick, args.long)
    rows = validate(configs, log=sys.stderr)
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
