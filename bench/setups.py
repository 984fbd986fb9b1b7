"""What the issue-11 setups cost (CPU, one thread, interleaved rounds; ratios within a round, then the median):

* lora:  one projection call, protected / unprotected, for a plain nn.Linear and the same Linear under PEFT LoRA
         (the LoRA check verifies A's output and the effective product [x | s·z]·[W | B]ᵀ).
* fp16:  a checked fp16 attention call (protected_sdpa, no grad) with AS formed in fp32 (now) against AS formed in
         fp16 (before; overflows past 65504), and unprotected SDPA.
* bias:  forward + backward of a checked attention with a learned bias that requires grad (unfused graph) against
         the same bias without grad (fused CPU backward), and unprotected SDPA with the learned bias.

    python bench/setups.py [--rounds 15] [--out PATH]       (or: attnchecker bench setups ...)

Prints a table, writes bench/results/setups.json. Nothing here asserts on a time.
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common

_common.setup_path()

import torch
import torch.nn.functional as F

from attnchecker.attention import pipeline as attention
from attnchecker.attention.backends import unfused
from attnchecker.checks.context import CheckConfig, LayerContext, OpStats, Runtime
from attnchecker.integrations._common import Binder


def _ctx() -> LayerContext:
    return LayerContext(layer=0, runtime=Runtime(step=0, config=CheckConfig(), stats=OpStats()))


def lora_cases(tokens: int, width: int, rank: int) -> dict[str, Callable[[], None]]:
    import peft

    class Proj(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q_proj = torch.nn.Linear(width, width)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.q_proj(x)

    def build(lora: bool) -> torch.nn.Module:
        torch.manual_seed(0)
        model = Proj()
        if lora:
            cfg = peft.LoraConfig(r=rank, target_modules=["q_proj"], init_lora_weights=False)
            model = peft.get_peft_model(model, cfg)
        return model.eval()

    x = torch.randn(4, tokens // 4, width)
    cases: dict[str, Callable[[], None]] = {}
    for name in ("linear", "lora"):
        for protected in (False, True):
            model = build(name == "lora")
            if protected:
                layer = model.base_model.model.q_proj if name == "lora" else model.q_proj
                ctx = _ctx()
                Binder(ctx.runtime).hook_projection(layer, ctx, op="q")

            def run(model: torch.nn.Module = model) -> None:
                with torch.no_grad():
                    model(x)

            cases[f"{name}_{'protected' if protected else 'plain'}"] = run
    return cases


def fp16_cases(heads: int, tokens: int, d: int) -> dict[str, Callable[[], None]]:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, heads, tokens, d, generator=g).half() for _ in range(3))
    ctx = _ctx()
    fp32_product = unfused._scores_product

    def fp16_product(q_: torch.Tensor, k_: torch.Tensor) -> torch.Tensor:
        return q_ @ k_.transpose(-2, -1)

    def checked(product: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Callable[[], None]:
        def run() -> None:
            unfused._scores_product = product
            try:
                with torch.no_grad():
                    attention.protected_sdpa(q, k, v, ctx=ctx, is_causal=True)
            finally:
                unfused._scores_product = fp32_product

        return run

    def sdpa() -> None:
        with torch.no_grad():
            F.scaled_dot_product_attention(q, k, v, is_causal=True)

    return {"fp16_sdpa": sdpa, "fp16_checked_AS_fp16": checked(fp16_product),
            "fp16_checked_AS_fp32": checked(fp32_product)}


def bias_cases(heads: int, tokens: int, d: int) -> dict[str, Callable[[], None]]:
    g = torch.Generator().manual_seed(1)
    q0, k0, v0 = (torch.randn(2, heads, tokens, d, generator=g) for _ in range(3))
    bias0 = torch.randn(heads, tokens, tokens, generator=g) * 0.5
    ctx = _ctx()

    def step(fn: Callable[..., torch.Tensor], bias_grad: bool) -> Callable[[], None]:
        def run() -> None:
            q, k, v = (t.clone().requires_grad_() for t in (q0, k0, v0))
            bias = bias0.clone().requires_grad_(bias_grad)
            fn(q, k, v, attn_mask=bias).square().sum().backward()

        return run

    def checked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor) -> torch.Tensor:
        out = attention.protected_sdpa(q, k, v, ctx=ctx, attn_mask=attn_mask)
        assert isinstance(out, torch.Tensor)
        return out

    return {
        "bias_sdpa_learned": step(F.scaled_dot_product_attention, True),
        "bias_checked_fixed": step(checked, False),
        "bias_checked_learned": step(checked, True),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    groups = {
        "lora": (lora_cases(tokens=512, width=768, rank=16), "linear_plain"),
        "fp16": (fp16_cases(heads=12, tokens=256, d=64), "fp16_sdpa"),
        "bias": (bias_cases(heads=8, tokens=128, d=64), "bias_sdpa_learned"),
    }
    results = {}
    rows = []
    for group, (fns, base) in groups.items():
        samples = _common.interleaved(fns, rounds=args.rounds)
        ratio = _common.ratios(samples, base)
        results[group] = {"baseline": base, "seconds": {n: _common.summary(s) for n, s in samples.items()},
                          "ratio_to_baseline": ratio}
        for n in fns:
            r = ratio[n]
            median_ms = _common.summary(samples[n])["median"] * 1e3
            rows.append((group, n, median_ms, r["median"], f"{r['min']:.3g}-{r['max']:.3g}"))
    print(_common.table(rows, ["group", "variant", "median ms", f"ratio (median of {args.rounds})", "ratio min-max"]))
    lora = results["lora"]["ratio_to_baseline"]
    lora_overhead = lora["lora_protected"]["median"] / lora["lora_plain"]["median"]
    print(f"LoRA check overhead: protected/plain = {lora_overhead:.3g} (plain Linear: "
          f"{lora['linear_protected']['median']:.3g})")
    path = _common.write_result("setups", {"rounds": args.rounds, "results": results}, args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
