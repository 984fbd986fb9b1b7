"""What share of a training step's GEMM work each protection scope verifies (issue 17).

One forward + backward of a transformers GPT-2 or Llama (bench/overhead.py's sizes), attention run unfused ("eager")
so that every matrix product of the step is an aten mm / addmm / bmm that a TorchDispatchMode sees; FLOPs = 2·M·N·K
per product (times the batch for bmm). Each product is classed by phase (forward / backward) and by where it runs:
an attention projection that protect() hooks (q/k/v/out, GPT-2's c_attn), another Linear/Conv1D (MLP, LM head), or
the attention core (bmm: QKᵀ and AP·V forward; dV, dAP, dQ, dK backward), or another product (an mm outside any
Linear, or an outer product with reduction length 1; none in these two models). Then, per scope:

  attention  projections forward + attention core forward
  all        every Linear/Conv1D forward and backward (dX, dW) + attention core forward and backward (its backward
             checked where the fused-backward path applies: CPU, no dropout, no return_probs;
             attention.backward.encoded)

    python bench/gemm_coverage.py [--models gpt2,llama] [--tiny]
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common

_common.setup_path()

import torch
from overhead import SIZES, build_model
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import attnchecker
from attnchecker.gemm.linear import linear_layout

aten = torch.ops.aten
CLASSES = ("projection", "other_linear", "attention_core", "other")
COVERED = {
    "attention": {("forward", "projection"), ("forward", "attention_core")},
    "all": {(phase, cls) for phase in ("forward", "backward") for cls in ("projection", "other_linear",
                                                                           "attention_core")},
}


class _GemmFlops(TorchDispatchMode):
    """Sums 2·M·N·K per (phase, class); the class of an mm/addmm is the Linear module running it (forward) or, in
    backward, the module whose output gradient it consumes (told by full backward pre-hooks)."""

    def __init__(self) -> None:
        super().__init__()
        self.phase = "forward"
        self.linear: str | None = None
        self.flops: dict[tuple[str, str], int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func in (aten.mm.default, aten.addmm.default, aten.bmm.default):
            a = args[1] if func is aten.addmm.default else args[0]
            k = int(a.shape[-1])
            flops = 2 * math.prod(out.shape) * k
            if func is aten.bmm.default:
                cls = "attention_core" if k > 1 else "other"
            else:
                cls = self.linear or "other"
            self.flops[(self.phase, cls)] = self.flops.get((self.phase, cls), 0) + flops
        return out


def _projections(model: nn.Module) -> set[nn.Module]:
    """The Linear/Conv1D modules whose output protect(scope="attention") verifies: found by protecting once."""
    from attnchecker.integrations._common import _projection_hook

    guard = attnchecker.protect(model)
    try:
        return {m for m in model.modules()
                if any(getattr(h, "func", None) is _projection_hook for h in m._forward_hooks.values())}
    finally:
        guard.close()


def measure(arch: str, size: dict[str, int]) -> dict[str, Any]:
    model = build_model(arch, size)
    projections = _projections(model)
    model.set_attn_implementation("eager")
    counter = _GemmFlops()
    handles = []
    for m in model.modules():
        if linear_layout(m) is None:
            continue
        cls = "projection" if m in projections else "other_linear"

        def enter(_mod: nn.Module, *_: Any, cls: str = cls) -> None:
            counter.linear = cls

        def leave(_mod: nn.Module, *_: Any) -> None:
            counter.linear = None

        handles += [m.register_forward_pre_hook(enter), m.register_forward_hook(leave),
                    m.register_full_backward_pre_hook(enter), m.register_full_backward_hook(leave)]
    x = torch.randint(0, size["vocab"], (size["batch"], size["seq"]), generator=torch.Generator().manual_seed(0))
    with counter:
        loss = model(input_ids=x, labels=x).loss
        counter.phase = "backward"
        loss.backward()
    for h in handles:
        h.remove()
    total = sum(counter.flops.values())
    rows = {f"{phase}/{cls}": counter.flops.get((phase, cls), 0)
            for phase in ("forward", "backward") for cls in CLASSES}
    share = {scope: sum(counter.flops.get(k, 0) for k in keys) / total for scope, keys in COVERED.items()}
    return {"model": arch, "size": size, "gflops": {k: v / 1e9 for k, v in rows.items()}, "total_gflops": total / 1e9,
            "covered_share": share}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="gpt2,llama")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--out", default=None, help="JSON path (default bench/results/gemm_coverage.json)")
    a = p.parse_args(argv)
    size = SIZES["tiny" if a.tiny else "full"]
    results = [measure(arch, size) for arch in a.models.split(",")]
    for r in results:
        print(f"\n{r['model']}: GEMM FLOPs of one training step ({r['total_gflops']:.2f} GFLOP)")
        print(_common.table([[k, v, f"{100 * v / r['total_gflops']:.1f} %"] for k, v in r["gflops"].items()],
                            ["phase/class", "GFLOP", "share"]))
        print("covered: " + ", ".join(f"scope={s} {100 * v:.1f} %" for s, v in r["covered_share"].items()))
    path = _common.write_result("gemm_coverage", {"size_name": "tiny" if a.tiny else "full", "models": results}, a.out)
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
