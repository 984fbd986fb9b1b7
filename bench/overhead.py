"""Training-step overhead of ABFT protection, against an unprotected SDPA baseline and cheaper or costlier checkers.

One training step = forward + backward + AdamW step on a transformers GPT-2, Llama or Mixtral (Llama's layers with 8
experts of its MLP width, 2 per token) built from a config (random weights, random tokens: the cost does not depend
on the values; Mixtral's routing does, a little). Every variant runs on one shared model and the same
batch, protection attached before its step and closed after it (Variant says why; the adaptive variants and
baseline_copy keep copies of their own); rounds interleave the variants in a shuffled order (bench/_common.py says
why).

Variants:
  baseline   unprotected, attn_implementation="sdpa" (the fused kernel)
  baseline_copy  unprotected on a copy of its own (own weights, own AdamW), never protected: baseline_copy /
             baseline is this design's A/A control, and tells whether the protected variants' steps on the shared
             model (attached and closed around each) leave the shared baseline slower or faster than a model no
             guard ever touched (issue 32's harness gap)
  baseline_eager_experts  unprotected, a MoE model's expert banks on transformers' eager loop (one GEMM pair per
             expert hit) instead of its default grouped GEMM: the loop scope="all" runs them through on the steps it
             checks (integrations/moe_experts.py), priced apart from the checks themselves (Mixtral only)
  full       attnchecker.protect(model, optimizer=opt, policy=Policy.full()): every op, every step (every
             variant is protected with the optimizer, as the README has it: its gradient net counts)
  adaptive   Policy() (the default: tier 1 on every step, full checks on the adaptive schedule), warmed up on tiny
             inputs until the scheduler reaches its steady state, then measured directly: rounds that are a
             multiple of 8 hold checked and tier-1-only steps in their steady-state proportion
  tier1      the tripwire alone: protected with the default policy, no op fully checked on the timed steps (what
             every step the schedule leaves unchecked costs)
  paper      Policy.paper(): extreme thresholds, checksum passing, no source repair
  skip       protected, but no op due on the timed steps (what an adaptive step that checks nothing costs)
  finite     torch.isfinite on every attention GEMM output the model exposes (q/k/v/out projections, the attention
             core's output): detects INF/NaN only, corrects nothing; one flag read per step
  dmr        duplicate-and-compare: every projection and the attention core recomputed under no_grad and compared
  floor      read each protected output once (q/k/v/out, AS as a tensor of its shape, CL): the memory-traffic
             lower bound of any checker that looks at every output
  all_full   protect(scope="all") with Policy.full(): also every Linear/Conv1D GEMM forward and backward (dX, dW)
  all_adaptive  protect(scope="all") with Policy(), warmed up like adaptive
  all_tier1  protect(scope="all") with Policy(), no full check on the timed steps: tier 1 on every output, the
             whole-step GEMMs' (Linear forward, dX, dW, the fused attention backward's dQ/dK/dV) included
  all_full_eager  all_full with the one-pass checksum kernel off (attnchecker/fused_pass.py): every check on its
             eager path, what all_full costs where the kernel cannot be built
  all_full_rules  all_full with the clean row checks' bounds evaluated eagerly (attnchecker/row_verify.py off):
             what the native verdict saves, side by side
  all_full_products  all_full with the attention backward's full check on the checked products
             (attention.backward.checked) instead of the fused kernel on encoded operands
             (attention/backward/encoded.py)
  full_unfused, all_full_unfused  full and all_full with the checked attention forward on the unfused path, not
             the native pass (kernels/fused_attention.py): what the native pass saves, side by side

    python bench/overhead.py [--models gpt2,llama,mixtral] [--rounds 16] [--tiny]
"""
from __future__ import annotations

import argparse
import copy
import functools
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common

_common.setup_path()

import torch
import torch.nn.functional as F
from torch import nn

import attnchecker
from attnchecker import Policy
from attnchecker.attention import pipeline as attention
from attnchecker.attention.backends import unfused
from attnchecker.attention.backward import encoded
from attnchecker.kernels import fused_attention, fused_pass, row_verify

VARIANTS = ("baseline", "baseline_copy", "baseline_eager_experts", "full", "adaptive", "tier1", "paper", "skip",
            "finite", "dmr", "floor", "all_full", "all_adaptive", "all_tier1", "all_full_eager", "all_full_rules",
            "all_full_products", "full_unfused", "all_full_unfused", "full_softmax_ops", "all_tier1_sdpa")
MOE_ONLY = ("baseline_eager_experts",)
"""Variants that differ from baseline only on a mixture-of-experts model (--models mixtral): not in the default set."""
SIZES = {
    # The issue's sizes; vocab 8192 (not GPT-2's 50257) keeps the LM head from dwarfing the layers the checks are
    # in, which makes the measured overhead larger, not smaller.
    "full": {"hidden": 512, "heads": 8, "layers": 6, "seq": 256, "batch": 4, "vocab": 8192},
    # The smoke test's size: seconds, not minutes.
    "tiny": {"hidden": 64, "heads": 4, "layers": 2, "seq": 32, "batch": 2, "vocab": 128},
}


def build_model(arch: str, size: dict[str, int], attn_dropout: float = 0.0) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    if arch == "gpt2":
        cfg = GPT2Config(vocab_size=size["vocab"], n_positions=size["seq"], n_embd=size["hidden"],
                         n_layer=size["layers"], n_head=size["heads"], attn_pdrop=attn_dropout, resid_pdrop=0.0,
                         embd_pdrop=0.0, bos_token_id=0, eos_token_id=0)
        model = GPT2LMHeadModel(cfg)
    elif arch == "llama":
        # Llama's SwiGLU width for this hidden size (8/3 h rounded to 32), full multi-head attention.
        inter = (8 * size["hidden"] // 3 + 31) // 32 * 32
        cfg = LlamaConfig(vocab_size=size["vocab"], hidden_size=size["hidden"], intermediate_size=inter,
                          num_hidden_layers=size["layers"], num_attention_heads=size["heads"],
                          num_key_value_heads=size["heads"], max_position_embeddings=size["seq"],
                          attention_dropout=attn_dropout, bos_token_id=0, eos_token_id=0, pad_token_id=0)
        model = LlamaForCausalLM(cfg)
    elif arch == "mixtral":
        # Llama's layers with a mixture of 8 experts of that SwiGLU width, 2 per token: transformers keeps them as
        # 3-D parameters, which scope="all" checks through integrations/moe_experts.py.
        from transformers import MixtralConfig, MixtralForCausalLM

        inter = (8 * size["hidden"] // 3 + 31) // 32 * 32
        cfg = MixtralConfig(vocab_size=size["vocab"], hidden_size=size["hidden"], intermediate_size=inter,
                            num_hidden_layers=size["layers"], num_attention_heads=size["heads"],
                            num_key_value_heads=size["heads"], max_position_embeddings=size["seq"],
                            num_local_experts=8, num_experts_per_tok=2, attention_dropout=attn_dropout,
                            bos_token_id=0, eos_token_id=0, pad_token_id=0)
        model = MixtralForCausalLM(cfg)
    else:
        raise ValueError(f"unknown model {arch!r}: gpt2, llama or mixtral")
    model.set_attn_implementation("sdpa")
    return model.train()


# --------------------------------------------------------------------------------------------- baseline checkers


def _projections(model: nn.Module) -> list[nn.Module]:
    """The attention projections of a GPT-2 / Llama model: GPT-2's c_attn and attention c_proj, Llama's q/k/v/o."""
    from transformers.pytorch_utils import Conv1D

    out = []
    for name, m in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        in_attn = ".attn." in f".{name}." or ".self_attn." in f".{name}."
        if in_attn and leaf in ("c_attn", "c_proj", "q_proj", "k_proj", "v_proj", "o_proj") and isinstance(
                m, (nn.Linear, Conv1D)):
            out.append(m)
    return out


def _linear_again(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    from transformers.pytorch_utils import Conv1D

    if isinstance(m, Conv1D):
        return torch.addmm(m.bias, x.reshape(-1, x.shape[-1]), m.weight).view(*x.shape[:-1], -1)
    return F.linear(x, m.weight, m.bias)


class HookChecker:
    """finite / dmr / floor: forward hooks on the projections plus an AttentionInterface function around SDPA.

    State is a device flag, read once per step (``end_step``), like a real checker that must act on it.
    """

    def __init__(self, kind: str, model: nn.Module) -> None:
        from transformers import AttentionInterface
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

        self.kind = kind
        self.flag = torch.zeros((), dtype=torch.bool)
        self._scratch: dict[tuple[int, ...], torch.Tensor] = {}
        self._sdpa = sdpa_attention_forward
        self._model = model
        self._handles = [m.register_forward_hook(self._proj_hook) for m in _projections(model)]
        name = f"bench_{kind}"
        AttentionInterface.register(name, self._attention)
        AttentionMaskInterface.register(name, sdpa_mask)
        model.set_attn_implementation(name)

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._model.set_attn_implementation("sdpa")

    @torch.no_grad()
    def _look(self, y: torch.Tensor) -> None:
        if self.kind == "finite":
            self.flag |= ~torch.isfinite(y).all()
        else:  # floor: one read of the output
            self.flag |= y.sum() == 12345.0

    @torch.no_grad()
    def _proj_hook(self, m: nn.Module, args: tuple[Any, ...], y: torch.Tensor) -> None:
        if self.kind == "dmr":
            self.flag |= (_linear_again(m, args[0].detach()) != y.detach()).any()
        else:
            self._look(y.detach())

    def _attention(self, module: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: Any,
                   **kwargs: Any) -> tuple[torch.Tensor, None]:
        out, w = self._sdpa(module, q, k, v, *args, **kwargs)
        with torch.no_grad():
            if self.kind == "dmr":
                again, _ = self._sdpa(module, q.detach(), k.detach(), v.detach(), *args, **kwargs)
                self.flag |= (again != out.detach()).any()
            else:
                self._look(out.detach())
                if self.kind == "floor":
                    # AS = QKᵀ is never materialised by the fused kernel: read a tensor of its shape instead.
                    shape = (*q.shape[:-1], k.shape[-2])
                    if shape not in self._scratch:
                        self._scratch[shape] = torch.ones(shape, dtype=q.dtype, device=q.device)
                    self._look(self._scratch[shape])
        return out, w

    def end_step(self) -> None:
        if bool(self.flag):  # sync: once per step, as a checker that acts on its flag must
            raise RuntimeError(f"{self.kind}: mismatch or non-finite value in a clean step")


# ----------------------------------------------------------------------------------------------------- the runner


POLICIES = {"full": Policy.full, "paper": Policy.paper, "adaptive": Policy,
            # A fresh guard checks everything on its first step: "nothing due" is mode off, which takes the same
            # path through the engine as a step the scheduler skips.
            "skip": functools.partial(Policy, mode="off"),
            # Attached fresh each step (on the shared model), then the step's config is set to check no op in full:
            # exactly the engine path of a step the scheduler leaves to tier 1.
            "tier1": Policy,
            "all_full": Policy.full, "all_adaptive": Policy, "all_tier1": Policy, "all_full_eager": Policy.full,
            "all_full_rules": Policy.full, "all_full_products": Policy.full, "full_unfused": Policy.full,
            "all_full_unfused": Policy.full, "full_softmax_ops": Policy.full, "all_tier1_sdpa": Policy}
SCOPE = {"all_full": "all", "all_adaptive": "all", "all_tier1": "all", "all_full_eager": "all",
         "all_full_rules": "all", "all_full_products": "all", "all_full_unfused": "all", "all_tier1_sdpa": "all"}
"""protect(scope=...) per variant; "attention" when absent."""
EAGER = ("all_full_eager",)
"""Variants whose steps run with the one-pass checksum kernel off."""
RULES = ("all_full_rules",)
"""Variants whose clean row checks evaluate their bound eagerly, not in the native verifier."""
PRODUCTS = ("all_full_products",)
"""Variants whose attention backward is checked through its products, not the encoded fused kernel."""
UNFUSED = ("full_unfused", "all_full_unfused")
"""Variants whose checked attention forward runs without the native pass (kernels/fused_attention.py): the
unfused path."""
SOFTMAX_OPS = ("full_softmax_ops",)
"""Variants whose unfused attention (attention dropout) differentiates softmax and dropout op by op, not through
attention.backends.unfused._SoftmaxDropout."""
SDPA_TIER1 = ("all_tier1_sdpa",)
"""Variants whose tier-1 steps run a dropout attention on SDPA, not on the unfused path
(attention.pipeline._tier1_loses_backward)."""
TIER1 = ("tier1", "all_tier1", "all_tier1_sdpa")
"""Variants on tier 1 only: attached fresh each step, nothing checked in full."""
ADAPTIVE = ("adaptive", "all_adaptive")


class Variant:
    """A variant on the shared model: protection attached before each timed step and taken off after it, so every
    variant runs on the same tensors in the same memory (separate deep copies differed by several percent from
    each other, an A/A bias no interleaving removes). ``adaptive`` needs its scheduler's history, so it keeps its own
    copy and guard (its figure carries that copy-to-copy spread; the steady-state estimate below does not)."""

    def __init__(self, name: str, shared: tuple[nn.Module, torch.optim.Optimizer], batch: torch.Tensor, *,
                 tiny_batch: torch.Tensor) -> None:
        self.name = name
        self.batch = batch
        self.own = name in ADAPTIVE or name == "baseline_copy"
        if self.own:
            self.model = copy.deepcopy(shared[0])
            self.opt: torch.optim.Optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-5)
        else:
            self.model, self.opt = shared
        self.guard: attnchecker.Guard | None = None
        self.hooks: HookChecker | None = None
        self.check_seconds: dict[str, list[float]] = {}
        self.checked: list[bool] = []
        self.tier1_checks: list[int] = []
        self.tier1_s: list[float] = []
        self.cpu_s: list[float] = []
        self.faults: list[int] = []
        self.sys_s: list[float] = []
        if name in ADAPTIVE:
            self._attach()
            # Period 1 -> 8 takes 8 quiet checks at each of 1, 2 and 4 (docs/adaptive.md): 56 steps, on tiny input
            # so the warm-up costs seconds. The scheduler only sees steps and outcomes, not sizes.
            for _ in range(64):
                self.step(tiny_batch, record=False)

    def _attach(self) -> None:
        if self.name in POLICIES:
            # With the optimizer, as the README has it: its last net (a finite check of every gradient before each
            # optimizer step) is part of what protection costs.
            self.guard = attnchecker.protect(self.model, optimizer=self.opt, policy=POLICIES[self.name](),
                                             scope=SCOPE.get(self.name, "attention"))
            if self.name in TIER1:
                self.guard.tripwire_only_this_step()
        elif self.name in ("finite", "dmr", "floor"):
            self.hooks = HookChecker(self.name, self.model)

    def _detach(self) -> None:
        if self.guard is not None:
            self.guard.close()
            self.guard = None
        if self.hooks is not None:
            self.hooks.close()
            self.hooks = None

    def step(self, batch: torch.Tensor | None = None, *, record: bool = True) -> float:
        """One training step; returns its wall time (attaching and detaching protection excluded). With ``record``,
        also keeps its CPU time (this process) and the guard's per-op check time."""
        if not self.own:
            self._attach()
        x = self.batch if batch is None else batch
        fused_pass.enabled = self.name not in EAGER
        row_verify.enabled = self.name not in RULES
        encoded.enabled = self.name not in PRODUCTS
        fused_attention.enabled = self.name not in UNFUSED
        unfused.softmax_function = self.name not in SOFTMAX_OPS
        attention.unfused_tier1 = self.name not in SDPA_TIER1
        config = self.model.config
        experts = getattr(config, "_experts_implementation", None)
        if self.name == "baseline_eager_experts":
            config._experts_implementation = "eager"
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        c0, t0 = time.process_time(), time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        loss = self.model(input_ids=x, labels=x).loss
        loss.backward()
        config._experts_implementation = experts
        # The step's counters, taken before the optimizer step: protected with the optimizer, the guard closes its
        # step in the optimizer's post-hook (guard.step()), after the gradient net has run in its pre-hook.
        stats = self.guard.step_stats if self.guard is not None else None
        self.opt.step()
        fused_pass.enabled = encoded.enabled = fused_attention.enabled = row_verify.enabled = True
        unfused.softmax_function = attention.unfused_tier1 = True
        if self.hooks is not None:
            self.hooks.end_step()
        if self.guard is not None:
            self.tier1_checks.append(sum(stats.trip_checks.values()) if stats is not None else 0)
            self.tier1_s.append(stats.trip_seconds if stats is not None else 0.0)
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        if not self.own:
            self._detach()
        if record:
            self.cpu_s.append(dc)
            # Minor page faults and system time of the step: glibc's malloc hands big blocks back to the kernel and
            # takes them again, at tens of thousands of faults a step, a cost of the process, protected or not
            # (docs/performance.md, "Page faults").
            self.faults.append(r1.ru_minflt - r0.ru_minflt)
            self.sys_s.append(r1.ru_stime - r0.ru_stime)
            if stats is not None:
                self.checked.append(any(stats.checks.values()))
                # Whole-step ops appear only on the steps that check them: 0 s on the others, so every op's list
                # lines up with the steps.
                before = len(self.cpu_s) - 1
                for op in set(self.check_seconds) | set(stats.check_seconds):
                    self.check_seconds.setdefault(op, [0.0] * before).append(stats.check_seconds.get(op, 0.0))
        return dt

    def close(self) -> None:
        self._detach()


def run_model(arch: str, size: dict[str, int], rounds: int, variants: tuple[str, ...], seed: int,
              attn_dropout: float = 0.0) -> dict[str, Any]:
    base = build_model(arch, size, attn_dropout)
    g = torch.Generator().manual_seed(seed)
    batch = torch.randint(0, size["vocab"], (size["batch"], size["seq"]), generator=g)
    tiny = batch[:1, :8]
    t0 = time.perf_counter()
    shared = (base, torch.optim.AdamW(base.parameters(), lr=1e-5))
    vs = {n: Variant(n, shared, batch, tiny_batch=tiny) for n in variants}
    setup_s = time.perf_counter() - t0
    warmup = 1
    wall = _common.interleaved({n: functools.partial(v.step) for n, v in vs.items()}, rounds=rounds, warmup=warmup,
                               seed=seed)
    for v in vs.values():
        v.close()
    # CPU time of this process per step: on a shared machine, wall time also counts the other tenants' time slices;
    # with one torch thread the process's CPU time is the step's own work (cache and memory-bandwidth contention
    # still leak in). Both are reported; the CPU-time figures are the headline.
    cpu = {n: v.cpu_s[warmup:] for n, v in vs.items()}
    result: dict[str, Any] = {"model": arch, "size": size, "rounds": rounds, "setup_s": setup_s, "variants": {}}
    clocks = {"cpu": cpu, "wall": wall}
    rat = {c: _common.ratios(xs, "baseline") for c, xs in clocks.items()}
    for n, v in vs.items():
        entry: dict[str, Any] = {}
        for c, xs in clocks.items():
            entry[c] = {
                "step_s": _common.summary(xs[n]),
                "ratio_vs_baseline": rat[c][n],
                "ratio_of_means": statistics.fmean(xs[n]) / statistics.fmean(xs["baseline"]),
                "samples_s": xs[n],
            }
        # The headline clock, at the top level too.
        entry.update({k: entry["cpu"][k] for k in ("step_s", "ratio_vs_baseline", "ratio_of_means", "samples_s")})
        entry["minor_faults_per_step"] = _common.summary(v.faults[warmup:])
        entry["sys_s_per_step"] = _common.summary(v.sys_s[warmup:])
        entry["minor_faults_samples"] = v.faults[warmup:]
        if v.name in POLICIES:
            checked = v.checked[warmup:]
            entry["checked_step_fraction"] = sum(checked) / max(len(checked), 1)
            # Host time inside the checks per step (OpStats.check_seconds); CPU kernels are synchronous, so on
            # this machine it is the checks' compute time too.
            entry["check_s_per_step"] = {op: statistics.fmean(xs[warmup:]) for op, xs in v.check_seconds.items()}
            entry["tier1_checks_per_step"] = statistics.fmean(v.tier1_checks[-len(checked):]) if checked else 0.0
            # Host time inside tier 1 (OpStats.trip_seconds), per step.
            entry["tier1_s_per_step"] = statistics.fmean(v.tier1_s[-len(checked):]) if checked else 0.0
            if v.name in ADAPTIVE:
                # Steady state: one step in max_period checks everything, the others run tier 1 only. Besides the
                # direct measurement (this variant's own figure, over whole cycles), an estimate from what a
                # checked step (full) and a tier-1 step (tier1) cost on the shared model, free of copy-to-copy bias.
                f = 1 / Policy().max_period
                full, tier1 = ("full", "tier1") if v.name == "adaptive" else ("all_full", "all_tier1")
                other = tier1 if tier1 in vs else "skip"
                if full in vs and other in vs:
                    entry["steady_state_ratio"] = {c: f * rat[c][full]["median"] + (1 - f) * rat[c][other]["median"]
                                                   for c in clocks}
        result["variants"][n] = entry
    if "floor" in vs and "full" in vs:
        result["full_over_floor"] = {}
        for c in clocks:
            floor_extra = rat[c]["floor"]["median"] - 1
            full_extra = rat[c]["full"]["median"] - 1
            result["full_over_floor"][c] = full_extra / floor_extra if floor_extra > 0 else None
    return result


def print_model(res: dict[str, Any]) -> None:
    rows = []
    for n, e in res["variants"].items():
        r, w = e["cpu"]["ratio_vs_baseline"], e["wall"]["ratio_vs_baseline"]
        chk = e.get("check_s_per_step")
        rows.append([
            n, e["cpu"]["step_s"]["median"] * 1e3, _common.pct(r["median"]),
            f"[{_common.pct(r['p25'])}, {_common.pct(r['p75'])}]", e["wall"]["step_s"]["median"] * 1e3,
            _common.pct(w["median"]), f"[{_common.pct(w['p25'])}, {_common.pct(w['p75'])}]",
            "" if chk is None else f"{sum(chk.values()) * 1e3:.1f}",
            "" if "tier1_s_per_step" not in e else f"{e['tier1_s_per_step'] * 1e3:.1f}",
            "" if "checked_step_fraction" not in e else f"{e['checked_step_fraction']:.2f}",
            f"{e['minor_faults_per_step']['median']:.0f}", e["sys_s_per_step"]["median"] * 1e3,
        ])
    size = res["size"]
    print(f"\n{res['model']}: hidden {size['hidden']}, {size['heads']} heads, {size['layers']} layers, seq "
          f"{size['seq']}, batch {size['batch']}, vocab {size['vocab']}, attention dropout "
          f"{res.get('attn_dropout', 0.0)}; {res['rounds']} interleaved rounds; "
          "overhead = median of per-round ratios to the baseline [IQR]")
    print(_common.table(rows, ["variant", "CPU ms/step", "overhead (CPU)", "IQR (CPU)", "wall ms/step",
                               "overhead (wall)", "IQR (wall)", "check ms/step", "tier-1 ms/step",
                               "checked steps", "page faults/step", "sys ms/step"]))
    ops = {n: e["check_s_per_step"] for n, e in res["variants"].items() if e.get("check_s_per_step")}
    if ops:
        names = sorted({op for d in ops.values() for op in d})
        print(_common.table([[n, *(d.get(op, 0.0) * 1e3 for op in names)] for n, d in ops.items()],
                            ["check ms/step", *names]))
    for name in ADAPTIVE:
        steady = res["variants"].get(name, {}).get("steady_state_ratio")
        if steady:
            full, tier1 = ("all_full", "all_tier1") if name != "adaptive" else ("full", "tier1")
            print(f"{name} steady state, estimated (1/max_period {full} + rest {tier1}): "
                  f"CPU {_common.pct(steady['cpu'])}, wall {_common.pct(steady['wall'])}")
    ff = res.get("full_over_floor")
    if ff:
        print("full / floor (extra time over baseline): " + ", ".join(
            f"{c} {v:.2f}x" if v is not None else f"{c} n/a (floor within noise)" for c, v in ff.items()))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="gpt2,llama", help="comma-separated: gpt2, llama, mixtral")
    p.add_argument("--rounds", type=int, default=16, help="interleaved timed rounds (a multiple of 8 covers whole "
                                                          "adaptive cycles)")
    p.add_argument("--variants", default=",".join(v for v in VARIANTS if v not in MOE_ONLY),
                   help=f"comma-separated (default: all but {', '.join(MOE_ONLY)}, which only a MoE model tells apart "
                        "from baseline)")
    p.add_argument("--tiny", action="store_true", help="the smoke-test size (seconds)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (default 1: on a shared machine an OpenMP team waiting for a busy core makes "
                        "every small op erratic; 0 = torch's choice)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--attn-dropout", type=float, default=0.0,
                   help="attention dropout of the models (GPT-2's and BERT's library default is 0.1): the protected "
                        "attention then runs its unfused path, whose backward scope=all checks through its own GEMMs")
    p.add_argument("--out", default=None, help="JSON path (default bench/results/overhead.json)")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    variants = tuple(v for v in a.variants.split(",") if v)
    if "baseline" not in variants:
        variants = ("baseline", *variants)
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        p.error(f"unknown variant(s) {sorted(unknown)}; known: {', '.join(VARIANTS)}")
    size = SIZES["tiny" if a.tiny else "full"]
    results = []
    for arch in a.models.split(","):
        res = run_model(arch, size, a.rounds, variants, a.seed, a.attn_dropout)
        res["attn_dropout"] = a.attn_dropout
        print_model(res)
        results.append(res)
    path = _common.write_result("overhead", {"size_name": "tiny" if a.tiny else "full", "models": results}, a.out)
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
