"""False positives on real training: models trained through the public ``attnchecker.protect()`` path on real text
(the Python standard library's source, bytes), no fault injected, every check the engine makes counted by the
engine's own counters (``Guard.report().checks``: every op per layer per step, forward, backward and whole-step
GEMMs with ``scope="all"``), every flag from its own records (``Guard.detections``, ``Report.detected``). On clean
data any flag is a false positive. docs/fault-coverage.md quotes the committed run.

What the checks see:
* dtypes: fp32; TF32 (fp32 GEMMs with operands rounded to 10 mantissa bits, ``attnchecker.emulate``, forward and
  backward; ``tf32-trunc``, asked for by name, truncates them as tensor cores may); bf16 and fp16 (CPU autocast: GEMMs
  in the half dtype, LayerNorm/softmax/loss in fp32);
* masks: GPT-2 causal, GPT-2 causal + padding (variable lengths, ``attention_mask`` zeros), BERT bidirectional +
  padding (masked-LM on the same text);
* large activations: AdamW at a learning rate that makes activations grow, and a variant with "massive activations"
  (Sun et al. 2024) planted: a few LayerNorm weight channels scaled by 50-300x, so the GEMM operands carry a few
  channels 100-1000x the rest. Max |activation| and the massive-channel ratio are reported per run;
* long sequences: a few steps at T = 512 per dtype on the unfused path (grouped checksums, g = 2 over the keys) and
  on the tiled path, counted apart.

Per run (dtype x model x mask x variant): checks, flags, the worst clean residual/bound per op (``OpStats.
residual_max``, on the device), max |activation|.

    attnchecker bench clean [...]   (or: python bench/clean_campaign.py [...])
    python bench/clean_campaign.py [--checks 100000] [--dtypes fp32,tf32,bf16,fp16,tf32-trunc] [--size small|tiny|wide]
                                   [--tiny] [--long-steps 2] [--jobs 8] [--path auto|unfused|tiled]
                                   [--out docs/perf/clean_campaign.json]
    TRITON_INTERPRET=1 ATTNCHECKER_GEMM=triton python bench/clean_campaign.py --size wide ...
                                   (the GEMM checks' Triton path, a GPU's, on this CPU; the JSON records the setting)
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import logging
import multiprocessing
import os
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common

_common.setup_path()
os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torch
import torch.nn.functional as F
from torch import nn

import attnchecker
from attnchecker.attention.backends.tiled_torch import PATH_ENV
from attnchecker.cli.corpus import Batches, stdlib_corpus
from attnchecker.emulate import emulate_fp32_matmul

DTYPES = ("fp32", "tf32", "bf16", "fp16")
TF32_TRUNCATED = "tf32-trunc"
"""TF32 whose conversion truncates the operands (tensor cores may): not in the default set, --dtypes names it."""
PAD, MASK_TOKEN = 0, 1
"""Byte 0 and byte 1 never occur in Python source: the pad and the masked-LM mask token."""


@dataclass(frozen=True)
class Size:
    d: int
    layers: int
    heads: int
    seq: int
    batch: int
    long_seq: int
    long_batch: int


SIZES = {
    # Many short steps: 45 (GPT-2) or 56 (BERT) checks per step, 10^5 checks per dtype in minutes on one thread.
    "small": Size(d=128, layers=2, heads=4, seq=64, batch=2, long_seq=512, long_batch=2),
    "tiny": Size(d=32, layers=2, heads=2, seq=16, batch=2, long_seq=512, long_batch=1),
    # Rows of 512 to 2,048 columns, which the GEMM checks' Triton path checks in runs of at least 256 (gemm/device.py):
    # with TRITON_INTERPRET=1 ATTNCHECKER_GEMM=triton, its kernels on clean training (slow under the interpreter).
    "wide": Size(d=512, layers=1, heads=8, seq=64, batch=2, long_seq=512, long_batch=1),
}


@dataclass(frozen=True)
class Run:
    arch: str
    """gpt2 (causal LM) or bert (masked LM, bidirectional)."""
    mask: str
    """causal, causal+pad, bidir+pad."""
    variant: str
    """grow (a learning rate that makes activations grow) or outliers (massive channels planted)."""
    long: bool = False
    path: str = "auto"
    """The attention path (ATTNCHECKER_ATTENTION): auto takes the tiled path from T·S = 512², unfused never."""

    @property
    def name(self) -> str:
        path = f"/{self.path}" if self.long or self.path != "auto" else ""
        return f"{self.arch}/{self.mask}/{self.variant}" + ("/T=long" if self.long else "") + path


RUNS = (Run("gpt2", "causal", "grow"), Run("gpt2", "causal+pad", "outliers"), Run("bert", "bidir+pad", "grow"),
        Run("bert", "bidir+pad", "outliers"))
LONG_RUNS = (Run("gpt2", "causal+pad", "outliers", long=True, path="unfused"),
             Run("gpt2", "causal+pad", "outliers", long=True, path="auto"),
             Run("bert", "bidir+pad", "outliers", long=True, path="unfused"))
OUTLIER_SCALES = (50.0, 150.0, 300.0)
"""The planted channels' LayerNorm weight factors (three channels per LayerNorm, the same channels in every layer, as
massive activations sit in fixed channels)."""
LR = {"grow": 3e-3, "outliers": 1e-3}
COST = {"fp32": 1.0, "bf16": 1.2, "tf32": 2.0, TF32_TRUNCATED: 2.0, "fp16": 5.0}
"""Relative CPU time per check (measured here, one thread): with --jobs, the slow dtypes start first."""
MAX_LISTED = 50
"""Detections listed in full per run (all are counted)."""


def build(arch: str, size: Size, seed: int, positions: int) -> nn.Module:
    import transformers as tf

    torch.manual_seed(seed)
    if arch == "gpt2":
        cfg = tf.GPT2Config(vocab_size=256, n_embd=size.d, n_layer=size.layers, n_head=size.heads,
                            n_positions=positions, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                            bos_token_id=PAD, eos_token_id=PAD)
        return tf.GPT2LMHeadModel(cfg).train()
    cfg = tf.BertConfig(vocab_size=256, hidden_size=size.d, num_hidden_layers=size.layers,
                        num_attention_heads=size.heads, intermediate_size=4 * size.d, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0, max_position_embeddings=positions, pad_token_id=PAD)
    return tf.BertForMaskedLM(cfg).train()


def plant_outliers(model: nn.Module, seed: int) -> list[int]:
    """Scale OUTLIER_SCALES channels of every LayerNorm weight: the hidden states (BERT, post-LN) or the GEMM inputs
    (GPT-2, pre-LN) get a few channels 50-300x the rest."""
    d = next(m for m in model.modules() if isinstance(m, nn.LayerNorm)).normalized_shape[0]
    g = torch.Generator().manual_seed(seed)
    channels = torch.randperm(d, generator=g)[:len(OUTLIER_SCALES)].tolist()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                for c, s in zip(channels, OUTLIER_SCALES, strict=True):
                    m.weight[c] *= s
    return channels


class Data:
    """Real text batches for one run: inputs, the attention mask (None for plain causal), targets (-100 = no loss)."""

    def __init__(self, run: Run, corpus: torch.Tensor, *, batch: int, seq: int, seed: int) -> None:
        self.run = run
        self.batches = Batches(corpus, batch=batch, seq=seq, seed=seed)
        self.gen = torch.Generator().manual_seed(seed + 1)

    def next(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        x_BT, y_BT = self.batches.next()
        b, t = x_BT.shape
        keep_BT = None
        if self.run.mask.endswith("+pad"):
            # Variable lengths down to a quarter of T, padded at the end; row 0 keeps all T (no trivially short batch).
            lengths_B = torch.randint(t // 4, t + 1, (b,), generator=self.gen)
            lengths_B[0] = t
            keep_BT = (torch.arange(t)[None, :] < lengths_B[:, None]).long()
            x_BT = x_BT.masked_fill(keep_BT == 0, PAD)
            y_BT = y_BT.masked_fill(keep_BT == 0, -100)
        if self.run.arch == "bert":
            # Masked LM: 15 % of the real tokens become MASK_TOKEN; the loss is on those only.
            chosen_BT = torch.rand(b, t, generator=self.gen) < 0.15
            if keep_BT is not None:
                chosen_BT &= keep_BT.bool()
            y_BT = torch.where(chosen_BT, x_BT, -100)
            x_BT = x_BT.masked_fill(chosen_BT, MASK_TOKEN)
        return x_BT, keep_BT, y_BT


@contextlib.contextmanager
def precision(dtype: str) -> Iterator[None]:
    """The step's arithmetic: fp32, TF32 emulated on the fp32 GEMMs, or CPU autocast to bf16 / fp16."""
    if dtype in ("tf32", TF32_TRUNCATED):
        with emulate_fp32_matmul("tf32", truncate=dtype == TF32_TRUNCATED):
            yield
    elif dtype in ("bf16", "fp16"):
        with torch.autocast("cpu", dtype=torch.bfloat16 if dtype == "bf16" else torch.float16):
            yield
    else:
        yield


@contextlib.contextmanager
def attention_path(path: str) -> Iterator[None]:
    before = os.environ.get(PATH_ENV)
    os.environ[PATH_ENV] = path
    try:
        yield
    finally:
        if before is None:
            del os.environ[PATH_ENV]
        else:
            os.environ[PATH_ENV] = before


class Activations:
    """Max |x| over every Linear/Conv1D input and output and every block output, and the massive-channel ratio of
    the block outputs (the largest channel's max |x| over the median channel's), via forward hooks."""

    def __init__(self, model: nn.Module) -> None:
        self.max_abs = 0.0
        self.massive_ratio = 0.0
        self._handles: list[Any] = []
        for m in model.modules():
            if isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D":
                self._handles.append(m.register_forward_hook(self._gemm))
            if type(m).__name__ in ("GPT2Block", "BertLayer"):
                self._handles.append(m.register_forward_hook(self._block))

    def _gemm(self, _m: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> None:
        for t in (args[0], out):
            self.max_abs = max(self.max_abs, float(t.detach().abs().amax()))  # sync: bench only

    def _block(self, _m: nn.Module, _args: tuple[Any, ...], out: Any) -> None:
        h_BTD = (out[0] if isinstance(out, tuple) else out).detach().float()
        per_channel_D = h_BTD.abs().amax(dim=(0, 1))
        self.max_abs = max(self.max_abs, float(per_channel_D.max()))  # sync: bench only
        self.massive_ratio = max(self.massive_ratio, float(per_channel_D.max() / per_channel_D.median().clamp_min(
            1e-30)))

    def close(self) -> None:
        for h in self._handles:
            h.remove()


def loss_of(model: nn.Module, x_BT: torch.Tensor, keep_BT: torch.Tensor | None, y_BT: torch.Tensor) -> torch.Tensor:
    logits_BTV = model(input_ids=x_BT, attention_mask=keep_BT).logits
    return F.cross_entropy(logits_BTV.float().reshape(-1, logits_BTV.shape[-1]), y_BT.reshape(-1), ignore_index=-100)


def train(run: Run, dtype: str, *, size: Size, corpus: torch.Tensor, checks: int, max_steps: int, seed: int,
          fault: Callable[[nn.Module], contextlib.AbstractContextManager[Any]] | None = None) -> dict[str, Any]:
    """Train one model protected with Policy.full and scope="all" until the engine has made ``checks`` checks (or
    ``max_steps`` steps). ``fault``: a context manager factory wrapped around the first step's forward and backward
    (the tests' planted fault, which must come out as a flag)."""
    seq, batch = (size.long_seq, size.long_batch) if run.long else (size.seq, size.batch)
    model = build(run.arch, size, seed, positions=seq)
    channels = plant_outliers(model, seed) if run.variant == "outliers" else []
    opt = torch.optim.AdamW(model.parameters(), lr=LR[run.variant], weight_decay=0.0)
    data = Data(run, corpus, batch=batch, seq=seq, seed=seed)
    acts = Activations(model)
    worst: dict[str, float] = {}
    losses: list[float] = []
    t0 = time.perf_counter()
    guard = attnchecker.protect(model, optimizer=opt, policy=attnchecker.Policy.full(), scope="all")

    def read_worst(*_: Any) -> None:
        # A pre-step hook of the optimizer registered after the guard's: the step's deferred outcomes (the GEMM
        # checks' Triton path reports its ratios at the step boundary) are in, and the guard's post-step hook has not
        # folded them away yet.
        stats = guard.step_stats
        assert stats is not None
        for op, r in stats.residual_max.items():
            worst[op] = max(worst.get(op, 0.0), float(r))  # sync: bench only, once per op per step

    hook = opt.register_step_pre_hook(read_worst)
    try:
        steps = 0
        while steps < max_steps and sum(guard.report().checks.values()) < checks:
            x_BT, keep_BT, y_BT = data.next()
            planted = fault(model) if fault is not None and steps == 0 else contextlib.nullcontext()
            with attention_path(run.path), planted:
                with precision(dtype):
                    loss = loss_of(model, x_BT, keep_BT, y_BT)
                with precision(dtype) if dtype in ("tf32", TF32_TRUNCATED) else contextlib.nullcontext():
                    loss.backward()
            losses.append(float(loss.detach()))
            opt.step()  # the guard's step() runs in the optimizer's post-hook: this step's counts are folded in
            opt.zero_grad(set_to_none=True)
            steps += 1
        report = guard.report()
        detections = guard.detections
    finally:
        hook.remove()
        guard.close()
        acts.close()
    checks_by_op = {op: n for op, n in report.checks.items() if n}
    flags = [{"op": d.op, "layer": d.layer, "step": d.step, "kind": d.kind, "action": d.action, "pattern": d.pattern,
              "batch": d.batch, "head": d.head, "row": d.row, "col": d.col, "value": d.value, "residual": d.residual,
              "bound": d.bound, "residual_over_bound": None if d.residual is None or not d.bound
              else d.residual / d.bound} for d in detections]
    return {
        "run": run.name, "arch": run.arch, "mask": run.mask, "variant": run.variant, "long": run.long,
        "path": run.path, "dtype": dtype, "seq": seq, "batch": batch, "d": size.d, "layers": size.layers,
        "heads": size.heads, "lr": LR[run.variant], "outlier_channels": channels,
        "outlier_scales": list(OUTLIER_SCALES) if channels else [], "steps": steps,
        "checks": sum(checks_by_op.values()), "checks_by_op": checks_by_op,
        "flags": max(report.detected, len(flags)), "flags_by_op": _by_op(flags),
        "detections": flags[:MAX_LISTED], "skipped_steps": report.skipped_steps,
        "worst_ratio_by_op": worst, "worst_ratio": max(worst.values(), default=0.0),
        "max_abs_activation": acts.max_abs, "massive_channel_ratio": acts.massive_ratio,
        "loss_first": losses[0] if losses else None, "loss_last": losses[-1] if losses else None,
        "seconds": time.perf_counter() - t0,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checks", type=int, default=100_000, help="clean checks per dtype over the T=64 runs (split "
                                                                  "evenly among the 4 model/mask/variant runs)")
    p.add_argument("--dtypes", default=",".join(DTYPES))
    p.add_argument("--size", choices=sorted(SIZES), default="small")
    p.add_argument("--tiny", action="store_true", help="the smoke test: --size tiny, 400 checks, 1 long step")
    p.add_argument("--long-steps", type=int, default=2, help="steps of each T=512 run per dtype (0: none)")
    p.add_argument("--max-steps", type=int, default=100_000, help="cap on the steps of one run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--jobs", type=int, default=1, help="runs in parallel processes (each run is one job)")
    p.add_argument("--path", choices=("auto", "unfused", "tiled"), default="auto",
                   help="the attention path of the T=64 runs (ATTNCHECKER_ATTENTION): auto takes the native pass for "
                        "fp32 on a CPU; unfused is the path a GPU takes at short sequences")
    p.add_argument("--out")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    # Every detection is in the JSON; the guard's one log line per uncorrectable one would drown the table.
    logging.getLogger("attnchecker").setLevel(logging.ERROR)
    dtypes = args.dtypes.split(",")
    for name in dtypes:
        if name not in (*DTYPES, TF32_TRUNCATED):
            p.error(f"unknown dtype {name!r}: choose from {', '.join((*DTYPES, TF32_TRUNCATED))}")
    if args.tiny:
        args.size, args.checks, args.long_steps = "tiny", min(args.checks, 400), min(args.long_steps, 1)
    size = SIZES[args.size]
    per_run = -(-args.checks // len(RUNS))
    runs = [dataclasses.replace(run, path=args.path) for run in RUNS]
    jobs = [(run, dtype, per_run, args.max_steps, args.seed + i) for dtype in dtypes for i, run in enumerate(runs)]
    jobs += [(run, dtype, 10**12, args.long_steps, args.seed + 100 + i) for dtype in dtypes
             for i, run in enumerate(LONG_RUNS if args.long_steps else ())]
    work = functools.partial(_job, size=size, threads=args.threads)
    if args.jobs > 1:
        # Every run in its own process (--threads threads each), the slowest dtypes first; results keep job order.
        order = sorted(range(len(jobs)), key=lambda j: (jobs[j][0].long, -COST[jobs[j][1]]))
        with ProcessPoolExecutor(max_workers=args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            done = dict(zip(order, pool.map(work, [jobs[j] for j in order]), strict=True))
        results = [done[j] for j in range(len(jobs))]
    else:
        results = [work(job) for job in jobs]
    totals = {d: {part: _total([r for r in results if r["dtype"] == d and r["long"] == long])
                  for part, long in (("short", False), ("long", True))} for d in dtypes}
    print(_common.table([[r["dtype"], r["run"], r["steps"], r["checks"], r["flags"], r["worst_ratio"],
                          r["max_abs_activation"], r["massive_channel_ratio"]] for r in results],
                        ["dtype", "model/mask/variant", "steps", "checks", "flags", "worst residual/bound",
                         "max |act|", "massive ratio"]))
    print(_common.table([[d, t["short"]["checks"], t["short"]["flags"], t["long"]["checks"], t["long"]["flags"],
                          t["short"]["worst_ratio"], t["long"]["worst_ratio"]] for d, t in totals.items()],
                        ["dtype", "checks (T=64)", "flags", "checks (T=512)", "flags (T=512)",
                         "worst ratio", "worst ratio (T=512)"]))
    worst_ops = sorted({op for r in results for op in r["worst_ratio_by_op"]})
    print(_common.table([[d, *[max((r["worst_ratio_by_op"].get(op, 0.0) for r in results if r["dtype"] == d),
                                   default=0.0) for op in worst_ops]] for d in dtypes],
                        ["dtype", *worst_ops]))
    from attnchecker.gemm import device as gemm_device
    from attnchecker.kernels import triton_gemm_check as tg

    # Which GEMM check path ran: ATTNCHECKER_GEMM, and whether the Triton kernels could run on these CPU tensors.
    gemm_path = {"ATTNCHECKER_GEMM": gemm_device.requested(), "triton_interpreted": tg.interpreted()}
    payload = {"size": vars(size), "per_run_checks": per_run, "path": args.path, "gemm": gemm_path, "jobs": args.jobs,
               "threads": args.threads,
               "long_steps": args.long_steps, "outlier_scales": list(OUTLIER_SCALES), "lr": LR, "totals": totals,
               "results": results}
    path = _common.write_result("clean_campaign", payload, args.out)
    print(f"wrote {path}")
    return 0


def _job(job: tuple[Run, str, int, int, int], *, size: Size, threads: int) -> dict[str, Any]:
    """One run: (run, dtype, checks, max_steps, seed)."""
    run, dtype, checks, max_steps, seed = job
    torch.set_num_threads(threads)
    logging.getLogger("attnchecker").setLevel(logging.ERROR)
    result = train(run, dtype, size=size, corpus=stdlib_corpus(), checks=checks, max_steps=max_steps, seed=seed)
    _progress(result)
    return result


def _total(rs: list[dict[str, Any]]) -> dict[str, Any]:
    return {"checks": sum(r["checks"] for r in rs), "flags": sum(r["flags"] for r in rs),
            "worst_ratio": max((r["worst_ratio"] for r in rs), default=0.0),
            "max_abs_activation": max((r["max_abs_activation"] for r in rs), default=0.0)}


def _by_op(flags: list[dict[str, Any]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for f in flags:
        key = f"{f['op']}/{f['kind']}/{f['action']}"
        out[key] = out.get(key, 0) + 1
    return out


def _progress(r: dict[str, Any]) -> None:
    print(f"  {r['dtype']:>4} {r['run']:<40} steps={r['steps']:<5} checks={r['checks']:<7} flags={r['flags']} "
          f"worst={r['worst_ratio']:.3g} max|act|={r['max_abs_activation']:.3g} {r['seconds']:.1f}s", flush=True)


if __name__ == "__main__":
    sys.exit(main())
