#!/usr/bin/env bash
# Build the sdist and wheel, install the wheel into a new empty venv, and answer one prompt
# there offline. Usage: packaging/smoke.sh [WORKDIR]
#
# LLMLOCAL_TORCH_SPEC (default torch==2.13.0) is installed with the wheel so pip does not pull
# a multi-GB CUDA build; set it empty to let pip choose.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
work=${1:-$(mktemp -d)}
torch_spec=${LLMLOCAL_TORCH_SPEC-torch==2.13.0}
python=${PYTHON:-python3}
mkdir -p "$work"

echo "== build sdist and wheel"
"$python" -m build --sdist --wheel --outdir "$work/dist" "$repo" >"$work/build.log" 2>&1 || {
  tail -30 "$work/build.log"; exit 1; }
wheel=$(ls "$work"/dist/llmlocal-*.whl)
sdist=$(ls "$work"/dist/llmlocal-*.tar.gz)
echo "   $wheel"
echo "   $sdist"

echo "== check the wheel's contents"
"$python" - "$wheel" <<'PY'
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
tops = {n.split("/")[0] for n in names}
code = {t for t in tops if not t.endswith((".dist-info", ".data"))}
assert code == {"llmlocal"}, f"the wheel must install only the llmlocal package, found {sorted(code)}"
for pkg in ("app", "engine", "native", "quant", "models"):
    assert f"llmlocal/{pkg}/__init__.py" in names, f"llmlocal/{pkg} is missing from the wheel"
assert "llmlocal/app/tui/chat.tcss" in names, "the TUI stylesheet is missing from the wheel"
print(f"   {len(names)} files, all under llmlocal/")
PY

echo "== install into a new empty venv"
rm -rf "$work/venv"
"$python" -m venv "$work/venv"
"$work/venv/bin/python" -m pip install --quiet --upgrade pip
# shellcheck disable=SC2086
"$work/venv/bin/python" -m pip install --quiet $torch_spec "$wheel"

echo "== answer offline from outside the source tree"
cd "$work"
export LLMLOCAL_KV_CACHE_DIR="$work/kv"  # the paged engine's disk cache: not the user's
out=$(HF_HUB_OFFLINE=1 "$work/venv/bin/llmlocal" run "What color is the sky on a clear day?" \
  --json --temperature 0 --max-tokens 16)
echo "   $out"
planned=$(HF_HUB_OFFLINE=1 "$work/venv/bin/llmlocal" plan --json)
"$python" - "$out" "$planned" <<'PY'
import json, sys
d, plan = json.loads(sys.argv[1]), json.loads(sys.argv[2])
# the backend the planner picks for this CPU (llama.cpp, or the paged engine where it decodes faster)
assert d["backend"] == plan["backend"] in ("llamacpp", "paged"), (d, plan["backend"])
assert d["completion_tokens"] > 0 and d["text"].strip(), d
PY
"$work/venv/bin/llmlocal" --version

echo "== doctor: the installed versions and the native kernels that loaded"
report=$("$work/venv/bin/llmlocal" doctor --json)
"$python" - "$report" <<'PY'
import json, sys
d = json.loads(sys.argv[1])
text = json.dumps(d)
assert "llama-cpp-python" in text and "torch" in text, d
assert any(isa in text for isa in ('"avx512"', '"avx2"', '"scalar"')), "doctor names no kernel ISA"
PY
echo "== smoke test passed"
