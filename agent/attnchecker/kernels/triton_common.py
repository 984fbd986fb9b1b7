"""What the Triton kernels share: triton imported where it is installed (the library runs without it), whether the
interpreter runs them, ``device_function``, and ``host_table`` (the emulated-fault tables' copy to the device).

Under ``TRITON_INTERPRET=1`` (read when the kernel modules are imported, as triton.jit reads it then) kernels run
on CPU tensors, one program at a time, in numpy: how the suite runs them without a GPU. The interpreter patches
``triton.language`` again on every call of a ``@triton.jit`` helper from a kernel (about a millisecond each,
thousands per backward call), so under it ``device_function`` leaves helpers as the plain Python functions they are,
which the interpreter runs the same way inside the kernel; compiled for a GPU they are ``@triton.jit`` functions,
inlined into the kernels.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch

try:
    import triton
    from triton import knobs
except ImportError:  # no triton: available() says so, and nothing here is called
    triton = None
    knobs = None

# Read once, when the kernels are decorated (triton.jit reads it then too): kernels built for the interpreter stay
# interpreted, whatever the environment says later.
_INTERPRET = knobs is not None and bool(knobs.runtime.interpret)

__all__ = ["SMALL_SHARED_MEMORY", "cdiv", "device_function", "host_table", "interpreting", "next_power_of_2",
           "shared_per_block", "triton"]

F = TypeVar("F", bound=Callable[..., Any])


def interpreting() -> bool:
    """TRITON_INTERPRET=1 was set when the kernels were built (this module imported): they run on CPU tensors."""
    return _INTERPRET


def cdiv(a: int, b: int) -> int:
    """⌈a / b⌉ for the launchers' grids and tiles, on the host. ``triton.cdiv`` is a ConstexprFunction, which costs
    about 2 µs a call from Python against a few dozen nanoseconds here, several times a launch."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The least power of 2 ≥ n ≥ 1, on the host: ``triton.next_power_of_2`` is a ConstexprFunction too."""
    return 1 << (n - 1).bit_length()


SMALL_SHARED_MEMORY = 160 * 1024
"""Shared memory per block (opted in) under which the attention kernels take smaller tiles or fewer pipeline stages
past head dim 64: sm_86 and sm_89 (A10, A40, L4, L40S, RTX 30 and 40) give 99 KB; A100 163 KB, H100 and H200 227 KB."""


def shared_per_block(device: torch.device) -> int | None:
    """The most shared memory a block may use on ``device``, as Triton reads it for the limit it holds a launch to
    (a driver query, once per device; no sync). None off CUDA, under the interpreter, or where this Triton does not
    say."""
    if device.type != "cuda" or interpreting():
        return None
    return _shared_per_block(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _shared_per_block(index: int) -> int | None:
    try:
        from triton.compiler.compiler import max_shared_mem

        return int(max_shared_mem(index))
    except Exception:  # an internal of Triton's: where it moved, the full-size tiles, as before
        return None


def device_function(fn: F) -> F:
    """@triton.jit for a helper that kernels call (module doc)."""
    if triton is None or interpreting():
        return fn
    jitted: F = triton.jit(fn)
    return jitted


def host_table(rows: list[Any], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host-made table (an emulated-fault plan: tests, attnchecker.inject) on ``device`` without a host-device
    sync. On CUDA it goes through pinned memory, copied without blocking: from pageable memory the copy waits for the
    device's queue, and a fault plan must not make the call it tests block (tests/agent/test_triton_gpu.py runs that
    call under CUDA's sync detector). The pinned buffer comes from the caching host allocator, which keeps it until
    the copy has run."""
    cuda = device.type == "cuda"
    return torch.tensor(rows, dtype=dtype, pin_memory=cuda).to(device, non_blocking=cuda)
