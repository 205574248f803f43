"""`quantize(job)`: SRC -> OUT.gguf in the requested format, then the quality report.

    source (checkpoint dir | GGUF | repo id in the cache)
      |-- llmlocal formats:  stream tensors -> OUT            (+ lossless reference, for the report)
      '-- llama.cpp formats: stream tensors -> reference.gguf -> llama_model_quantize -> OUT
    evaluate(reference, OUT) -> OUT.quality.json

With --sparsity S the finished output is run through llmlocal's torch model on calibration
text, and a copy with per-layer activation thresholds under `llmlocal.sparsity.*` (tensors
byte for byte) becomes OUT (`sparsity.py`); the report then also measures the sparse model
against the dense one on held-out text (`sparsity_quality.py`). A 4-bit GGUF source with
--sparsity and no --type is only calibrated: nothing is requantized.

Every file is written under a temporary name in OUT's directory and renamed when complete,
so an interruption, an error or a full disk leaves nothing at OUT; temporaries are removed
on the way out. The output is renamed into place before the evaluation starts: it is
finished by then, and the report is about it.
"""

from __future__ import annotations

import dataclasses
import os
import re
import secrets
import shutil
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from gguf import GGUFValueType, Keys, LlamaFileType
from llmlocal.models import read_gguf_header, spec_from_gguf
from llmlocal.models.errors import LLMLocalError
from llmlocal.models.sizes import format_size
from llmlocal.models.spec import SparsitySpec, describe_levels

from . import tensor_types
from .convert import write_gguf_file
from .errors import QuantizeError
from .evaluate import (
    BUILTIN_TEXT,
    QualityReport,
    builtin_eval_text,
    evaluate_quality,
    read_eval_text,
)
from .formats import DEFAULT_FORMAT, Format, get_format
from .gguf_source import open_gguf
from .gguf_writer import KV, tensor_nbytes
from .llama_quantize import quantize_with_llama_cpp
from .open_source import open_source
from .progress import Listener, Progress
from .source import ModelSource, SourceTensor
from .sparsity import (
    DEFAULT_REQUEST,
    INT4_STORAGE,
    SPARSE_FORMATS,
    SparsityRequest,
    check_sparsity,
    default_sparsity,
    read_calibration_text,
)
from .sparsity_quality import SparsityQuality

QUANTIZATION_VERSION = 2  # ggml's block layout version, written by every converter
_REFERENCE_FILE_TYPES = {"F32": "ALL_F32", "F16": "MOSTLY_F16", "BF16": "MOSTLY_BF16"}


@dataclass(frozen=True)
class QuantizeJob:
    """Everything `llmlocal quantize` was asked to do."""

    src: str
    out: str | None = None  # None: ./<name>-<TYPE>.gguf
    type: str | None = None  # None: DEFAULT_FORMAT, or the source's own tensors when only calibrating
    evaluate: bool = True
    eval_text: str | None = None  # a text file; None: the built-in text
    eval_ctx: int = 512
    eval_tokens: int | None = None  # evaluate at most this many tokens of the text
    allow_requantize: bool = False
    threads: int | None = None  # None: all cores
    sparsity: SparsityRequest | str | None = None  # calibrate thresholds that zero this fraction (or a profile's,
    # or DEFAULT_REQUEST: `default_sparsity` of the output)
    calib_text: str | None = None  # a text file for the calibration; None: half of the built-in text

    def __post_init__(self) -> None:
        if self.type is not None:
            get_format(self.type)
        if self.sparsity is not None:
            if self.sparsity != DEFAULT_REQUEST:
                check_sparsity(self.sparsity)  # type: ignore[arg-type]
            if self.type is not None and self.type.lower() not in SPARSE_FORMATS:
                raise LLMLocalError(
                    f"--sparsity needs a 4-bit type, not {self.type}: the sparse engine reads INT4 weights, "
                    f"so choose one of {', '.join(SPARSE_FORMATS)}."
                )
        elif self.calib_text is not None:
            raise LLMLocalError("--calib gives the text for --sparsity: add --sparsity S, or leave --calib out.")
        if self.eval_ctx < 16:
            raise LLMLocalError(f"The evaluation window must be at least 16 tokens, got {self.eval_ctx}.")
        if self.eval_tokens is not None and self.eval_tokens < 2:
            raise LLMLocalError(f"--eval-tokens must be at least 2, got {self.eval_tokens}.")
        if self.threads is not None and self.threads < 1:
            raise LLMLocalError(f"threads must be at least 1, got {self.threads}.")


@dataclass(frozen=True)
class QuantizeResult:
    output: str
    type: str  # "Q4_K_M"
    output_bytes: int
    n_params: int
    seconds: float  # conversion only, not the evaluation
    tensor_types: dict[str, int]  # GGML type -> number of tensors in the output
    warnings: tuple[str, ...] = ()
    quality: QualityReport | None = None
    quality_path: str | None = None
    sparsity: SparsitySpec | None = None  # the thresholds written, with --sparsity
    sparsity_quality: SparsityQuality | None = None
    sparsity_path: str | None = None  # where sparsity_quality was saved

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.output_bytes / max(self.n_params, 1)


@dataclass
class _Session:
    job: QuantizeJob
    fmt: Format
    stream: TextIO | None
    listener: Listener | None
    threads: int
    calib_text: str | None = None  # with --sparsity: the text to calibrate on
    temporaries: list[Path] = field(default_factory=list)
    sparsity: SparsitySpec | None = None  # set once the output is calibrated

    def note(self, message: str) -> None:
        if self.stream is not None:
            self.stream.write(f"llmlocal: note: {message}\n")
            self.stream.flush()

    def progress(self, label: str, unit: str = "bytes") -> Progress:
        return Progress(label, 1, unit=unit, stream=self.stream, enabled=self.stream is not None, listener=self.listener)

    def temporary(self, out: Path, purpose: str) -> Path:
        """A new empty file beside ``out``, hidden, removed when the job ends unless renamed.
        Created with mode 0o666 minus the umask, like any file the user writes (mkstemp's
        0o600 would survive the rename)."""
        while True:
            path = out.with_name(f".{out.name}.{purpose}.{secrets.token_hex(4)}.partial")
            try:
                os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            except FileExistsError:
                continue
            self.temporaries.append(path)
            return path

    def cleanup(self) -> None:
        for path in self.temporaries:
            try:
                path.unlink(missing_ok=True)
            except OSError:
                pass


def quantize(job: QuantizeJob, *, stream: TextIO | None = None, listener: Listener | None = None) -> QuantizeResult:
    """Run ``job``; progress and notes go to ``stream`` (the CLI passes stderr; None is silent).
    ``listener`` is called with (phase, done, total) on every progress update — raising from it
    aborts the job, which then cleans up like any interrupted one."""
    fmt = get_format(job.type or DEFAULT_FORMAT)
    text = None
    if job.evaluate:  # read the texts first: a bad --eval path should not cost a conversion
        text = read_eval_text(job.eval_text) if job.eval_text else builtin_eval_text()
    calib = read_calibration_text(job.calib_text) if job.sparsity is not None else None
    session = _Session(job, fmt, stream, listener, job.threads or _usable_cpus(), calib)
    try:
        with open_source(job.src) as source:
            return _run(session, source, text)
    finally:
        session.cleanup()


def _run(session: _Session, source: ModelSource, text: str | None) -> QuantizeResult:
    job, fmt = session.job, session.fmt
    if source.is_quantized and job.sparsity is not None and job.type is None:
        return _calibrate_only(session, source, text)
    out = _output_path(job.out, source, fmt)
    _check_output(out, source)
    for message in source.warnings:
        session.note(message)
    if source.is_quantized:
        if not job.allow_requantize:
            raise QuantizeError(
                f"{source.path} is already quantized ({source.storage_type}); quantizing it again compounds the "
                "error: convert the original F16/BF16 model, or pass --allow-requantize to do it anyway"
                + (" (or drop --type to only add the sparsity calibration)." if job.sparsity is not None else ".")
            )
        session.note(
            f"requantizing {source.storage_type} weights compounds their rounding error; the report compares "
            f"against the {source.storage_type} file, not the original model"
        )

    started = time.monotonic()
    if fmt.writer == "llmlocal":
        reference = _convert_ourselves(session, source, out)
    else:
        reference = _convert_with_llama_cpp(session, source, out)
    seconds = time.monotonic() - started

    header = read_gguf_header(out)
    counts = Counter(t.type_name for t in header.tensors)
    result = QuantizeResult(
        output=str(out),
        type=fmt.label,
        output_bytes=header.file_size,
        n_params=sum(t.n_elements for t in header.tensors),
        seconds=round(seconds, 2),
        tensor_types=dict(counts.most_common()),
        warnings=tuple(source.warnings),
        sparsity=session.sparsity,
    )
    if text is None:
        return result
    progress = session.progress("evaluating", unit="tokens")
    quality = evaluate_quality(
        reference, out, text,
        type_name=fmt.label,
        source_type=source.storage_type,
        ctx=job.eval_ctx,
        max_tokens=job.eval_tokens,
        threads=job.threads,
        text_name=job.eval_text or BUILTIN_TEXT,
        source_label=source.path,
        progress=progress,
    )
    progress.close()
    quality_path = f"{out}.quality.json"
    quality.save(quality_path)
    result = dataclasses.replace(result, quality=quality, quality_path=quality_path)
    return _evaluate_sparsity(session, out, result)


def _convert_ourselves(session: _Session, source: ModelSource, out: Path) -> Path:
    """Write OUT tensor by tensor; returns the file to evaluate it against."""
    fmt = session.fmt
    planned = tensor_types.plan(source, fmt)
    fallen = tensor_types.fallbacks(planned, fmt)
    if fallen:
        session.note(
            f"{len(fallen)} weight(s) have rows that are not whole {fmt.tensor_type} blocks and stay F16 "
            f"({', '.join(fallen[:3])}{', ...' if len(fallen) > 3 else ''})"
        )
    # A lossless copy is needed only to evaluate a checkpoint (a GGUF source is its own
    # reference), and not when the output already is that copy (f32 of an F32 checkpoint).
    same_as_reference = source.kind == "checkpoint" and planned == tensor_types.plan(source, None)
    needs_reference = session.job.evaluate and source.kind == "checkpoint" and not same_as_reference
    _check_space(out, _planned_bytes(planned) + (_reference_bytes(source) if needs_reference else 0))
    partial = session.temporary(out, "output")
    _write(session, source, planned, fmt.llama_file_type, partial, f"converting to {fmt.label}", final=True)
    _publish(session, partial, out)
    if source.gguf_path is not None:
        return Path(source.gguf_path)
    if not needs_reference:
        return out
    reference = session.temporary(out, "reference")
    _write_reference(session, source, reference)
    return reference


def _convert_with_llama_cpp(session: _Session, source: ModelSource, out: Path) -> Path:
    """Give llama.cpp's quantizer a GGUF (the source itself, or a lossless copy of a
    checkpoint) and move its output to OUT; returns the GGUF it quantized."""
    fmt = session.fmt
    if source.gguf_path is not None:
        _check_space(out, _estimate_llama_cpp_bytes(source, fmt))
        reference = Path(source.gguf_path)
    else:
        _check_space(out, _reference_bytes(source) + _estimate_llama_cpp_bytes(source, fmt))
        reference = session.temporary(out, "reference")
        _write_reference(session, source, reference)
    partial = session.temporary(out, "output")
    progress = session.progress(f"quantizing to {fmt.label} (llama.cpp)", unit="tensors")
    try:
        quantize_with_llama_cpp(reference, partial, fmt, threads=session.threads,
                                allow_requantize=source.is_quantized, progress=progress)
    finally:
        progress.close()
    _fsync(partial)
    _publish(session, partial, out)
    return reference


# ---- activation sparsity --------------------------------------------------------------------
def _publish(session: _Session, partial: Path, out: Path) -> None:
    """Rename the finished output into place; with --sparsity, calibrate it first and publish
    the copy that carries the thresholds."""
    if session.job.sparsity is None:
        os.replace(partial, out)
        return
    _check_space(out, partial.stat().st_size + 16_000_000)
    session.sparsity = _calibrate(session, partial)
    calibrated = session.temporary(out, "sparse")
    with open_gguf(partial) as quantized:
        _write_calibrated(session, quantized, calibrated, session.sparsity)
    os.replace(calibrated, out)


def _calibrate(session: _Session, gguf: Path) -> SparsitySpec:
    from .sparsity import (
        BUILTIN_CALIBRATION_TEXT,
        calibrate,
        split_builtin_text,
        torch_model,
    )

    job = session.job
    request = _request(job, gguf)
    text = session.calib_text if session.calib_text is not None else split_builtin_text()[0]
    name = job.calib_text or BUILTIN_CALIBRATION_TEXT
    progress = session.progress(f"calibrating {describe_levels(request)} activation sparsity", unit="tokens")
    try:
        with torch_model(gguf, job.eval_ctx, job.threads) as model:
            return calibrate(model, text, request, ctx=job.eval_ctx, text_name=name, progress=progress)
    finally:
        progress.close()


def _request(job: QuantizeJob, gguf: Path) -> SparsityRequest:
    """The job's --sparsity, with no value the default for the GGUF to calibrate."""
    assert job.sparsity is not None
    if job.sparsity == DEFAULT_REQUEST:
        return default_sparsity(spec_from_gguf(gguf))
    return job.sparsity  # type: ignore[return-value]


def _write_calibrated(session: _Session, src: ModelSource, dst: Path, sparsity: SparsitySpec) -> None:
    from .sparsity import write_with_sparsity

    progress = session.progress("writing the thresholds")
    try:
        write_with_sparsity(src, dst, sparsity, workers=session.threads, progress=progress)
    finally:
        progress.close()


def _calibrate_only(session: _Session, source: ModelSource, text: str | None) -> QuantizeResult:
    """A quantized GGUF (a type the native kernels read) + --sparsity, no --type: calibrate it
    and copy it with the thresholds."""
    job = session.job
    if source.storage_type not in INT4_STORAGE:
        raise QuantizeError(
            f"{source.path} stores {source.storage_type} weights, which the sparse engine does not read: pass "
            f"--type q4_k_m (or q4_0) --allow-requantize to requantize it, or start from the F16/BF16 model."
        )
    if job.out is None or Path(job.out).expanduser().is_dir():
        request = _request(job, Path(source.path))
        label = round(100 * (max(request.values()) if isinstance(request, Mapping) else request))
        name = f"{Path(source.path).stem}-sparse{label}.gguf"
        out = (Path(job.out).expanduser() if job.out else Path.cwd()) / name
    else:
        out = Path(job.out).expanduser()
    _check_output(out, source)
    _check_space(out, Path(source.path).stat().st_size + 16_000_000)
    started = time.monotonic()
    session.sparsity = _calibrate(session, Path(source.path))
    partial = session.temporary(out, "output")
    _write_calibrated(session, source, partial, session.sparsity)
    os.replace(partial, out)
    header = read_gguf_header(out)
    result = QuantizeResult(
        output=str(out),
        type=source.storage_type,
        output_bytes=header.file_size,
        n_params=sum(t.n_elements for t in header.tensors),
        seconds=round(time.monotonic() - started, 2),
        tensor_types=dict(Counter(t.type_name for t in header.tensors).most_common()),
        warnings=tuple(source.warnings),
        sparsity=session.sparsity,
    )
    # The tensors are the source's: only the sparse-vs-dense report says something new.
    return _evaluate_sparsity(session, out, result) if text is not None else result


def _evaluate_sparsity(session: _Session, out: Path, result: QuantizeResult) -> QuantizeResult:
    """The sparse output against its dense self on held-out text, saved as OUT.sparsity.json."""
    from .sparsity_quality import evaluate_sparsity

    job = session.job
    if session.sparsity is None:
        return result
    text = read_eval_text(job.eval_text) if job.eval_text else None  # None: the built-in held-out half
    progress = session.progress("evaluating sparsity", unit="tokens")
    try:
        quality = evaluate_sparsity(
            out, (session.sparsity.level,), sparsity=session.sparsity, text=text, text_name=job.eval_text,
            ctx=job.eval_ctx, max_tokens=job.eval_tokens, threads=job.threads, progress=progress,
        )
    finally:
        progress.close()
    path = f"{out}.sparsity.json"
    quality.save(path)
    return dataclasses.replace(result, sparsity_quality=quality, sparsity_path=path)


# ---- paths and space ------------------------------------------------------------------------
def _output_path(requested: str | None, source: ModelSource, fmt: Format) -> Path:
    stem = re.sub(r"[-_.](f32|f16|bf16|fp16|fp32)$", "", source.name, flags=re.IGNORECASE)
    default_name = re.sub(r"[^\w.-]+", "-", stem).strip("-") + f"-{fmt.label}.gguf"
    if requested is None:
        return Path.cwd() / default_name
    path = Path(requested).expanduser()
    return path / default_name if path.is_dir() else path


def _check_output(out: Path, source: ModelSource) -> None:
    if not out.parent.is_dir():
        raise QuantizeError(f"The output directory {out.parent} does not exist: create it or choose another -o.")
    if source.gguf_path is not None and out.exists() and out.samefile(source.gguf_path):
        raise QuantizeError(f"The output {out} is the source file itself: choose another -o.")


def _check_space(out: Path, needed: int) -> None:
    free = shutil.disk_usage(out.parent).free
    if needed > free:
        raise QuantizeError(
            f"The conversion needs about {format_size(needed)} free in {out.parent} but only {format_size(free)} "
            "are: free some space or write the output elsewhere with -o."
        )


def _planned_bytes(planned: list[tuple[SourceTensor, str]]) -> int:
    return sum(tensor_nbytes(t.shape, ggml_type) for t, ggml_type in planned) + 16_000_000  # + header


def _reference_bytes(source: ModelSource) -> int:
    return _planned_bytes(tensor_types.plan(source, None))


def _estimate_llama_cpp_bytes(source: ModelSource, fmt: Format) -> int:
    # A K-quant mix keeps some tensors at 6 bits: allow 15% over the main type's size.
    n = sum(t.n_elements for t in source.tensors)
    return int(n * fmt.bits_per_weight / 8 * 1.15) + 16_000_000


# ---- writing --------------------------------------------------------------------------------
def _metadata(source: ModelSource, file_type: LlamaFileType) -> list[KV]:
    return [
        *source.metadata,
        KV(Keys.General.FILE_TYPE, int(file_type), GGUFValueType.UINT32),
        KV(Keys.General.QUANTIZATION_VERSION, QUANTIZATION_VERSION, GGUFValueType.UINT32),
    ]


def _write(
    session: _Session, source: ModelSource, planned: list[tuple[SourceTensor, str]],
    file_type: LlamaFileType, path: Path, label: str, *, final: bool,
) -> None:
    progress = session.progress(label)
    try:
        write_gguf_file(path, _metadata(source, file_type), planned, workers=session.threads, progress=progress,
                        durable=final)
    finally:
        progress.close()


def _write_reference(session: _Session, source: ModelSource, path: Path) -> None:
    file_type = LlamaFileType[_REFERENCE_FILE_TYPES[source.storage_type]]
    _write(session, source, tensor_types.plan(source, None), file_type, path,
           f"writing the {source.storage_type} reference", final=False)


def _usable_cpus() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))  # respects taskset and container limits
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
