"""K-quant formats through llama.cpp's own quantizer, `llama_model_quantize`, in a child process.

The quantizer is one long C call. Run in our process it could not be interrupted (Python
sees Ctrl-C only when the call returns) and its memory map of the whole input would count
against our resident memory; a child process can be killed at once and keeps its memory to
itself. The child reports llama.cpp's log on stderr; lines of the form
``[  12/ 272]  blk.0.attn_q.weight - ...`` drive our progress bar.

Run as ``python -m llmlocal.quant.llama_quantize IN OUT FTYPE THREADS ALLOW_REQUANTIZE``.
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
from pathlib import Path

from .errors import QuantizeError
from .formats import Format
from .progress import Progress

_TENSOR_LINE = re.compile(r"\[\s*(\d+)\s*/\s*(\d+)\s*\]")
# Rows of a tensor the quantizer converts at a time. Left at its default (8 GiB), llama.cpp
# widens a whole tensor to float32 first: 1 GB for Llama 3's 128k x 2048 embedding matrix.
# At 128 MB its working memory stays near that, at no measurable cost in speed.
BUFFER_BYTES = 128 * 1024 * 1024


def quantize_with_llama_cpp(
    src: Path, dst: Path, fmt: Format, *, threads: int, allow_requantize: bool, progress: Progress | None = None
) -> None:
    """Write ``dst`` (which the caller treats as temporary) from the GGUF ``src`` in ``fmt``."""
    cmd = [
        sys.executable, "-m", "llmlocal.quant.llama_quantize",
        os.fspath(src), os.fspath(dst), str(int(fmt.llama_file_type)), str(threads), str(int(allow_requantize)),
    ]
    tail: collections.deque[str] = collections.deque(maxlen=20)
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, errors="replace")
    try:
        assert proc.stderr is not None
        for line in proc.stderr:
            line = line.rstrip()
            if line:
                tail.append(line)
            m = _TENSOR_LINE.search(line)
            if m and progress is not None:  # "[ i/ n]" starts tensor i: i - 1 are done
                progress.total = max(int(m.group(2)), 1)
                progress.update(int(m.group(1)) - 1)
        code = proc.wait()
    finally:
        if proc.poll() is None:  # interrupted: stop the quantizer now, not when it finishes
            proc.kill()
            proc.wait()
    if code != 0:
        reason = next((l for l in reversed(tail) if "error" in l.lower() or "failed" in l.lower()), tail[-1] if tail else "")
        raise QuantizeError(
            f"llama.cpp could not quantize {src.name} to {fmt.name} ({reason.strip()[:200] or f'exit code {code}'}): "
            "check the free disk space and that the source loads with `llmlocal run`."
        )
    if progress is not None:
        progress.update(progress.total)


def _main(argv: list[str]) -> int:
    import ctypes

    import llama_cpp

    src, dst, ftype, threads, allow_requantize = argv

    @llama_cpp.llama_log_callback
    def log(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
        sys.stderr.write(text.decode("utf-8", errors="replace"))
        sys.stderr.flush()

    llama_cpp.llama_log_set(log, ctypes.c_void_p(0))
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = int(ftype)
    params.nthread = int(threads)
    params.allow_requantize = bool(int(allow_requantize))
    params.max_buf_size = BUFFER_BYTES
    return 0 if llama_cpp.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(params)) == 0 else 1


if __name__ == "__main__":
    raise SystemExit(_main(sys.argv[1:]))
