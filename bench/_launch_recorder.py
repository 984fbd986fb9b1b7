"""A pytest plugin for bench/triton_compile_matrix.py: records every Triton launch the interpreter runs (kernel, each
argument's type, the constexprs, warps and stages) and writes them, with how often each was launched, to
``$ATTNCHECKER_LAUNCHES.<pid>`` as JSON when the session ends. It changes nothing a test sees: the launch runs as
before. Loaded with ``-p _launch_recorder`` (bench/ on PYTHONPATH)."""
from __future__ import annotations

import inspect
import json
import os
from typing import Any

import torch

_DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64",
           torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8",
           torch.bool: "i1"}
_seen: dict[str, int] = {}


def _type(value: Any) -> Any:
    """The argument's type as triton.compile's signature names it (None: a constexpr None)."""
    if isinstance(value, torch.Tensor):
        return "*" + _DTYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -2**31 <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    if isinstance(value, tuple):
        return [_type(v) for v in value]
    if value is None:
        return None
    raise TypeError(f"a launch argument of type {type(value).__name__}")


def pytest_configure() -> None:
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import _normalize_ty

    run = InterpretedFunction.run

    def recorded(self: Any, *args: Any, grid: Any, warmup: Any, **kwargs: Any) -> Any:
        if not warmup:
            fn = self.fn
            kinds = {n: _normalize_ty(t) for n, t in inspect.get_annotations(fn).items()}
            bound = inspect.signature(fn).bind_partial(
                *args, **{k: v for k, v in kwargs.items() if k in self.arg_names})
            bound.apply_defaults()
            signature: dict[str, Any] = {}
            constexprs: dict[str, Any] = {}
            for name in self.arg_names:
                value = bound.arguments.get(name)
                if kinds.get(name) == "constexpr":
                    constexprs[name] = value
                else:
                    signature[name] = _type(value)
            options = {k: kwargs[k] for k in ("num_warps", "num_stages") if k in kwargs}
            key = json.dumps({"module": fn.__module__, "kernel": fn.__name__, "signature": signature,
                              "constexprs": constexprs, "options": options}, sort_keys=True)
            _seen[key] = _seen.get(key, 0) + 1
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = recorded


def pytest_unconfigure() -> None:
    out = os.environ.get("ATTNCHECKER_LAUNCHES")
    if out:
        # One file per process: a pytest that itself runs inside an xdist worker (the suite's test of this tool)
        # inherits PYTEST_XDIST_WORKER, and its controller, which launched nothing, would overwrite its own worker's
        # file of the same name.
        with open(f"{out}.{os.getpid()}", "w") as f:
            json.dump(_seen, f)
