"""Instructions per weight of the native kernels, counted by valgrind's callgrind: the same count
for the same build, shapes and inputs however busy the host is, where the timings of
``bench kernels`` and ``ab_kernels`` on a shared machine vary by tens of percent.

    python -m llmlocal.native.cpu.count_instructions --kernel avx2 --types Q4_K,Q6_K --rows 1,4
    python -m llmlocal.native.cpu.count_instructions --base HEAD~1 --kernel avx2   # two builds

Each figure runs one Qwen2.5-1.5B layer of the type (``bench_kernels.layer``: q/k/v, o,
gate/up, down) on one thread in a child process under callgrind, counting only inside the
kernel's function, once with one call of the layer and once with three: the difference, over
two calls' weight-rows, leaves out whatever a first call or the process costs. A count is not a
time (a spill to the stack costs more than an add, a cache miss more than both), but a change
that removes instructions from a kernel bound by its arithmetic shows here exactly.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys

from .ab_kernels import LOAD_BUILD, current_build, resolve
from .bench_kernels import ALL_TYPES, INT4, KERNELS, LAYER_1_5B

# the function each kernel variant runs in (the GGUF types; INT4's rows run si4_kernel_*)
QM_FUNCTION = {"scalar": "qm_kernel_scalar", "avx2": "qm_kernel_avx2", "avxvnni": "qm_kernel_avxvnni",
               "avx512vnni": "qm_kernel_avx512vnni", "avx512vnni-amx": "qm_kernel_amx"}
INT4_FUNCTION = {"scalar": "si4_kernel_scalar", "avx2": "si4_kernel_avx2", "avxvnni": "si4_kernel_avx2",
                 "avx512vnni": "si4_kernel_avx512", "avx512vnni-amx": "si4_kernel_avx512"}

_CHILD = LOAD_BUILD + """
import numpy as np
type_name, kernel, rows, calls = sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
parts = sys.argv[6].split(",")
from {package}.bench_kernels import LAYER_1_5B, kernels, layer, use_kernel
kernels().set_num_threads(1)
use_kernel(kernel)
rng = np.random.default_rng(0)
lay = [lin for lin, (name, _, _) in zip(layer(type_name, rng), LAYER_1_5B) if name in parts]
xs = [rng.standard_normal((rows, lin.in_features), dtype=np.float32) for lin in lay]
ys = [np.empty((rows, lin.out_features), dtype=np.float32) for lin in lay]
for _ in range(calls):
    for lin, x, y in zip(lay, xs, ys):
        lin(x, out=y)
"""


ALL_PARTS = tuple(name for name, _, _ in LAYER_1_5B)


def count(build: str, type_name: str, kernel: str, rows: int, calls: int, parts: tuple[str, ...] = ALL_PARTS) -> int:
    """Instructions callgrind counts inside the kernel's function over ``calls`` calls of the
    layer's projections named in ``parts``."""
    function = (INT4_FUNCTION if type_name == INT4 else QM_FUNCTION)[kernel]
    code = _CHILD.format(package=__package__)
    child = [sys.executable, "-c", code, build, type_name, kernel, str(rows), str(calls), ",".join(parts)]
    done = subprocess.run(["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null",
                           f"--toggle-collect={function}", *child], capture_output=True, text=True)
    for line in done.stderr.splitlines():
        if "Collected :" in line:
            return int(line.rsplit(":", 1)[1])
    raise SystemExit(f"callgrind gave no count for {type_name} ({kernel}):\n{done.stderr[-2000:]}")


def per_weight(build: str, type_name: str, kernel: str, rows: int, parts: tuple[str, ...] = ALL_PARTS) -> float:
    """Instructions per weight-row (a weight times a row of x) of the layer's calls after the first."""
    weights = sum(n * k for name, k, n in LAYER_1_5B if name in parts)
    runs = [count(build, type_name, kernel, rows, calls, parts) for calls in (1, 3)]
    return (runs[1] - runs[0]) / (2 * weights * rows)


def measure(builds: dict[str, str], types: list[str], kernel: str, rows: list[int]) -> dict:
    out: dict = {"kernel": kernel, "rows": rows, "layer": "one Qwen2.5-1.5B layer", "builds": {}}
    for name, path in builds.items():
        out["builds"][name] = {t: [round(per_weight(path, t, kernel, r), 4) for r in rows] for t in types}
    return out


def format_table(res: dict) -> str:
    names = list(res["builds"])
    lines = [f"instructions per weight-row, kernel {res['kernel']}, {res['layer']} (callgrind)",
             "type    build  " + "".join(f"{r:>9}" for r in res["rows"])]
    for t in res["builds"][names[0]]:
        for name in names:
            lines.append(f"{t:<8}{name:<7}" + "".join(f"{v:>9.4f}" for v in res["builds"][name][t]))
        if len(names) == 2:
            base, new = (res["builds"][n][t] for n in names)
            lines.append(f"{'':<8}{'new/base':<7}" + "".join(f"{b and n / b:>9.3f}" for b, n in zip(base, new)))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m llmlocal.native.cpu.count_instructions",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--base", default=None,
                   help="also count a git ref's build (built once, cached) or a built _kernels*.so")
    p.add_argument("--types", default="Q4_K,Q6_K", help=f"comma-separated, of {','.join(ALL_TYPES)}")
    p.add_argument("--rows", default="1,4")
    p.add_argument("--kernel", default="avx2", choices=KERNELS)
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    if shutil.which("valgrind") is None:
        print("valgrind is not installed: install it (Debian: apt install valgrind) to count instructions.",
              file=sys.stderr)
        return 2
    types = [t.strip() for t in a.types.split(",") if t.strip()]
    unknown = [t for t in types if t not in ALL_TYPES]
    if unknown:
        print(f"Unknown type {', '.join(unknown)} for --types: choose from {', '.join(ALL_TYPES)}.", file=sys.stderr)
        return 2
    builds = {"base": resolve(a.base)} if a.base else {}
    builds["new" if a.base else "this"] = current_build()
    res = measure(builds, types, a.kernel, [int(r) for r in a.rows.split(",")])
    print(json.dumps(res) if a.json else format_table(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
