"""A/B of two builds of the native kernels: ``bench kernels`` rounds, the builds taking turns.

    python -m llmlocal.native.cpu.ab_kernels --base HEAD~1               # a commit, built once
    python -m llmlocal.native.cpu.ab_kernels --base /path/_kernels.so     # a saved build
    python -m llmlocal.native.cpu.ab_kernels --base HEAD --kernel avx2 --types Q4_K --rows 1,4,16,64

A kernel change is judged against the build before it on the same host, in one run: each round
runs the base build and the current one (this checkout's extension, or ``--new``) in fresh
processes, in alternating order, on the same shapes and seed (``bench_kernels``, each time the
fastest of ``--repeats`` passes, which a noisy neighbour can only slow). The figure
is, per type and row count, the ratio of the base build's time to the new one's (above 1: the
new build is faster), as the median and range over the rounds; a shared or throttled host shows
itself in that range. A git ref is built once into ``~/.cache/llmlocal-dev/ab/<commit>`` (its
C sources only: the Python wrappers are this checkout's, so the builds must share the module's
interface).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from .bench_kernels import ALL_TYPES, KERNELS

ROOT = Path(__file__).resolve().parents[2]
MODULE = f"{__package__}._kernels"
# A child process's first lines: the extension built at sys.argv[1] imported as the module (the
# Python wrappers then use it), for the harnesses that run a build in a process of its own.
LOAD_BUILD = f"""
import importlib.machinery, importlib.util, sys
path = sys.argv[1]
if path:
    loader = importlib.machinery.ExtensionFileLoader({MODULE!r}, path)
    spec = importlib.util.spec_from_file_location({MODULE!r}, path, loader=loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    sys.modules[{MODULE!r}] = mod
"""
_RUNNER = LOAD_BUILD + """
import json
args = json.loads(sys.argv[2])
from {package}.bench_kernels import bench_kernels
print(json.dumps(bench_kernels(args["types"], rows=tuple(args["rows"]), kernel=args["kernel"],
                               threads=args["threads"], working_set_mb=args["mb"], repeats=args["repeats"],
                               stat="min")))
"""


def current_build() -> str:
    """This checkout's built extension."""
    import importlib.util

    spec = importlib.util.find_spec(MODULE)
    if spec is None or not spec.origin:
        raise SystemExit("the native extension is not built here: run `python setup.py build_ext --inplace`")
    return spec.origin


def build_ref(ref: str) -> str:
    """The extension built from git ref ``ref``'s C sources (cached by commit)."""
    found = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}"],
                           capture_output=True, text=True)
    if found.returncode:
        raise SystemExit(f"{ref} is neither a built _kernels*.so nor a commit of this repository: name one of them.")
    sha = found.stdout.strip()
    home = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    out = home / "llmlocal-dev" / "ab" / sha[:12]
    built = sorted(out.glob("build/**/_kernels*.so"))
    if built:
        return str(built[0])
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        csrc = "native/cpu/csrc"
        if subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{sha}:{csrc}"], capture_output=True).returncode:
            csrc = "native/sparse_int4/csrc"  # the kernels' folder before it was named for what it holds
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", sha, "setup.py", csrc],
                                 check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        print(f"building {ref} ({sha[:12]}) ...", file=sys.stderr)
        subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--build-lib", str(out / "build"),
                        "--build-temp", str(out / "temp")], cwd=tmp, check=True)
    built = sorted(out.glob("build/**/_kernels*.so"))
    if not built:
        raise SystemExit(f"building {ref} gave no extension")
    return str(built[0])


def resolve(build: str) -> str:
    return build if build.endswith(".so") and Path(build).is_file() else build_ref(build)


def run_one(path: str, args: dict) -> dict:
    code = _RUNNER.format(package=__package__)
    done = subprocess.run([sys.executable, "-c", code, path, json.dumps(args)], capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"the build at {path} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout)


def ab(base: str, new: str, args: dict, rounds: int) -> dict:
    """Per type and row count: base time / new time over the rounds, builds in alternating order."""
    ratios: dict[str, list[list[float]]] = {}
    ms: dict[str, dict[str, list[list[float]]]] = {"base": {}, "new": {}}
    for r in range(rounds):
        order = (("base", base), ("new", new)) if r % 2 == 0 else (("new", new), ("base", base))
        got = {name: run_one(path, args) for name, path in order}
        for t in args["types"]:
            b, n = got["base"]["kernels"][t]["ms"], got["new"]["kernels"][t]["ms"]
            ratios.setdefault(t, []).append([x / y for x, y in zip(b, n)])
            ms["base"].setdefault(t, []).append(b)
            ms["new"].setdefault(t, []).append(n)
        print(f"round {r + 1}/{rounds} done", file=sys.stderr)
    out: dict = {"rows": args["rows"], "kernel": got["new"]["kernel"], "rounds": rounds, "types": {}}
    for t, rs in ratios.items():
        cols = list(zip(*rs))
        out["types"][t] = {
            "speedup_median": [round(statistics.median(c), 3) for c in cols],
            "speedup_min": [round(min(c), 3) for c in cols],
            "speedup_max": [round(max(c), 3) for c in cols],
            "base_ms": [round(statistics.median(c), 3) for c in zip(*ms["base"][t])],
            "new_ms": [round(statistics.median(c), 3) for c in zip(*ms["new"][t])],
        }
    return out


def format_table(res: dict) -> str:
    lines = [f"kernel {res['kernel']}, {res['rounds']} rounds, builds taking turns; base time / new time "
             "(median, range)", "type    rows" + "".join(f"{r:>16}" for r in res["rows"])]
    for t, v in res["types"].items():
        cells = "".join(f"{m:>6.2f} ({lo:.2f}-{hi:.2f})" for m, lo, hi in
                        zip(v["speedup_median"], v["speedup_min"], v["speedup_max"]))
        lines.append(f"{t:<12}{cells}")
        lines.append(f"{'':<8}ms  " + "".join(f"{b:>7.2f} -> {n:<7.2f}" for b, n in zip(v["base_ms"], v["new_ms"])))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m llmlocal.native.cpu.ab_kernels",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--base", required=True, help="a git ref (built once, cached) or a built _kernels*.so")
    p.add_argument("--new", default=None, help="the same (default: this checkout's build)")
    p.add_argument("--types", default="Q4_K,Q6_K", help=f"comma-separated, of {','.join(ALL_TYPES)}")
    p.add_argument("--rows", default="1,4,16,64")
    p.add_argument("--kernel", default=None, choices=KERNELS)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--working-set-mb", type=int, default=256)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    args = {"types": [t.strip() for t in a.types.split(",") if t.strip()], "rows": [int(r) for r in a.rows.split(",")],
            "kernel": a.kernel, "threads": a.threads, "mb": a.working_set_mb, "repeats": a.repeats}
    res = ab(resolve(a.base), resolve(a.new) if a.new else current_build(), args, a.rounds)
    print(json.dumps(res) if a.json else format_table(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
