"""What the Triton kernels' launchers ask of the device: whether triton.jit now wraps kernels for
its CPU interpreter, and how many SMs there are to fill. Importing this module imports triton."""

from __future__ import annotations

import functools

import torch
import triton

# Stand-in for the SM count when kernels run in the CPU interpreter, so that the launchers'
# split logic behaves as it would on a mid-size GPU.
INTERPRETER_SMS = 16


def interpreting() -> bool:
    """True when triton.jit would now wrap kernels for its CPU interpreter (TRITON_INTERPRET)."""
    return bool(triton.knobs.runtime.interpret)


@functools.lru_cache(maxsize=None)
def _cuda_sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """The device's SM count, or INTERPRETER_SMS off CUDA."""
    if device.type != "cuda":
        return INTERPRETER_SMS
    return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())
