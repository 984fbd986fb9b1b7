"""The checked ops as ``torch.library`` custom ops, for models under ``torch.compile``: the protected attention, the
projection check and the whole-step Linear/Conv1D GEMM, each with a fake implementation and a registered backward.
Dynamo keeps each as one opaque call in the graph instead of breaking it; at run time the op's body is the eager engine
(docs/abft.md, "Under torch.compile"). The integrations call these only while Dynamo traces
(``torch.compiler.is_compiling()``); an eager call never comes here."""
from __future__ import annotations

from .attention_op import attention
from .linear_op import linear
from .opaque import kept_count, release
from .projection_op import projection_check

__all__ = ["attention", "kept_count", "linear", "projection_check", "release"]
