"""`attnchecker demo`: train a small GPT-2 on the standard library's source with injected faults, under protection.

Side by side, on the same batches, it also steps a fault-free unprotected copy (the reference trajectory and the
overhead baseline) and, until it breaks, an unprotected copy that gets the same faults (what the faults do without
ATTNChecker). With a collector (started here on SQLite unless --collector points elsewhere) every detection and the
interval statistics stream to it, and the policy can be changed over REST while the demo runs.
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from .corpus import Batches, stdlib_corpus
from .local_collector import LocalCollector, start_local_collector

if TYPE_CHECKING:
    from ..runtime.guard import Guard

DASHBOARD_UID = "attnchecker-overview"
EARLY_STEPS = 50
POLICY_WAIT_S = 10.0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="train a small GPT with injected faults under protection",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--embd", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--fault-rate", type=float, default=0.3,
                   help="probability that a step gets one fault, in a random layer and protected op")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--collector", default="auto",
                   help="collector URL, 'auto' (start one on SQLite under --data-dir) or 'none'")
    p.add_argument("--token", default=os.environ.get("ATTNCHECKER_TOKEN"), help="agent token for --collector URL")
    p.add_argument("--operator-token", default=os.environ.get("ATTNCHECKER_OPERATOR_TOKEN"),
                   help="operator token for the demo's own mid-run policy change (auto: created)")
    p.add_argument("--data-dir", default="data/demo", help="where the auto collector keeps its SQLite file and spool")
    p.add_argument("--port", type=int, default=8000, help="port of the auto collector (a free one if taken)")
    p.add_argument("--run", default=None, help="run name (default: demo-<time>)")
    p.add_argument("--change-policy-at", type=int, default=None,
                   help="step at which the demo itself sends the printed curl's policy change (default: steps/2; "
                        "-1: never)")
    p.add_argument("--no-compare", action="store_true", help="skip the unprotected copies (faster, no overhead figure)")
    p.set_defaults(func=run)


@dataclass
class Trainer:
    """One model + optimizer on the shared batches."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    losses: list[float] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    broken_at: int | None = None

    def step(self, x_BT: torch.Tensor, y_BT: torch.Tensor, step: int) -> float:
        t0 = time.perf_counter()
        loss = self.model(input_ids=x_BT, labels=y_BT).loss
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        value = loss.item()  # sync: the demo prints the loss every step
        self.seconds.append(time.perf_counter() - t0)
        self.losses.append(value)
        if self.broken_at is None and not (math.isfinite(value) and _params_finite(self.model)):
            self.broken_at = step
        return value


def _params_finite(model: torch.nn.Module) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in model.parameters())


def _build(args: argparse.Namespace) -> Trainer:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=256, n_positions=args.seq, n_embd=args.embd, n_layer=args.layers,
                        n_head=args.heads, bos_token_id=0, eos_token_id=0,
                        attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)
    torch.manual_seed(args.seed)  # every copy starts from the same weights
    model = GPT2LMHeadModel(config)
    model.train()
    return Trainer(model, torch.optim.AdamW(model.parameters(), lr=args.lr))


def _fault_plan(args: argparse.Namespace) -> Any:
    import random

    from ..checks.context import OPS
    from ..inject import Fault, FaultPlan

    rng = random.Random(args.seed)
    kinds = ("inf", "neg_inf", "nan", "near_inf", "bitflip")
    faults = [
        Fault(op=rng.choice(OPS), layer=rng.randrange(args.layers), step=step, kind=rng.choice(kinds),
              pattern="0d", seed=rng.randrange(2**31))
        for step in range(args.steps)
        if rng.random() < args.fault_rate
    ]
    return FaultPlan(faults)


def _quiet_transformers() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()


def run(args: argparse.Namespace) -> int:
    import attnchecker
    from attnchecker import Policy

    if args.steps < 1:
        sys.exit("attnchecker demo: --steps must be >= 1")
    _quiet_transformers()
    tty = sys.stdout.isatty()
    run_name = args.run or time.strftime("demo-%Y%m%d-%H%M%S")
    change_at = args.steps // 2 if args.change_policy_at is None else args.change_policy_at

    local: LocalCollector | None = None
    url = token = operator_token = None
    # The default policy, as a user gets it: full checks on the adaptive schedule, the tripwire on every other step,
    # so each injected (extreme) fault is caught and corrected on whatever step it lands.
    policy = Policy()
    if args.collector == "auto":
        print(f"starting a collector on SQLite under {args.data_dir} …", flush=True)
        local = start_local_collector(args.data_dir, port=args.port)
        url, token, operator_token = local.url, local.agent_token, local.operator_token
    elif args.collector != "none":
        url, token, operator_token = args.collector.rstrip("/"), args.token, args.operator_token

    corpus = stdlib_corpus()
    print(f"corpus: {corpus.numel() / 1e6:.1f} MB of the standard library's source; model: GPT-2 "
          f"{args.layers} layers × {args.heads} heads, n_embd {args.embd}, seq {args.seq}, batch {args.batch}")
    protected = _build(args)
    plan = _fault_plan(args)
    stream: dict[str, Any] = {}
    if url:
        spool = os.path.join(args.data_dir, "spool", run_name) if local is not None else None
        # A short poll, so that a policy change shows within a second or two of the curl.
        stream = {"run": run_name, "collector": url, "token": token, "spool_dir": spool,
                  "transport_options": {"poll_interval_s": 0.5}}
    # With a collector, the policy given here is sent at registration and is the new run's starting policy there.
    guard = attnchecker.protect(protected.model, policy=policy, optimizer=protected.optimizer, faults=plan, **stream)
    reference = faulty = None
    if not args.no_compare:
        reference = _build(args)  # fault-free, unprotected
        faulty = _build(args)  # same faults, unprotected
        faulty_guard = attnchecker.protect(faulty.model, policy=Policy(mode="off"), faults=_fault_plan(args))
        faulty_guard.attach_optimizer(faulty.optimizer)
    print(f"{len(plan.faults)} faults planned over {args.steps} steps "
          f"(INF, -INF, NaN, near-INF 1e20, exponent bit flips) in q, k, v, scores, context and out")
    if url:
        _print_urls(url, run_name, guard, operator_token if local is not None else None)

    batches = Batches(corpus, batch=args.batch, seq=args.seq, seed=args.seed)
    policy_sent = False
    applied = guard.policy.version
    for step in range(args.steps):
        x_BT, y_BT = batches.next()
        if reference is not None and faulty is not None:
            reference.step(x_BT, y_BT, step)
            if faulty.broken_at is None:
                faulty.step(x_BT, y_BT, step)
        loss = protected.step(x_BT, y_BT, step)
        # From change_at on until it went through (the run may not be registered yet on a slow machine).
        if url and operator_token and 0 <= change_at <= step and not policy_sent:
            policy_sent = _change_policy(url, operator_token, guard)
        if guard.policy.version != applied:
            applied = guard.policy.version
            print(("\n" if tty else "") + f"[agent] policy v{applied} applied at the boundary of step {step + 1} "
                  f"(mode {guard.policy.mode}, tolerance_factor {guard.policy.tolerance_factor:g})", flush=True)
        _progress(step, args.steps, loss, guard, reference, faulty, tty)
    if tty:
        print()
    guard.close(flush_timeout_s=10.0)
    _summary(args, guard, protected, reference, faulty, url, run_name, local)
    return 0


def _run_id(guard: Guard) -> str | None:
    return guard.run_id


def _policy_curl(url: str, run_ref: str) -> str:
    # Double quotes around the header, so that the shell expands $OPERATOR_TOKEN.
    return (f"curl -X PATCH {url}/api/v1/runs/{run_ref}/policy -H \"Authorization: Bearer $OPERATOR_TOKEN\" "
            "-H 'Content-Type: application/json' -d '{\"tolerance_factor\": 2.0}'")


def _wait_for_run_id(guard: Guard, timeout_s: float = 10.0) -> str | None:
    """The sender thread registers the run in the background; wait a little for its id (bounded)."""
    deadline = time.monotonic() + timeout_s
    while _run_id(guard) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    return _run_id(guard)


def _page_url(url: str, run_id: str | None) -> str:
    """The collector's own dashboard page (served at /), opened on the run when its id is known."""
    return f"{url}/#/runs/{run_id}" if run_id else f"{url}/"


def _print_urls(url: str, run_name: str, guard: Guard, operator_token: str | None) -> None:
    run_id = _wait_for_run_id(guard)
    run_ref = run_id or "<run id from GET /api/v1/runs>"
    print(f"dashboard page {_page_url(url, run_id)}   (open it in a browser; sign in there as operator to edit)")
    print(f"collector API  {url}/api/v1/runs/{run_ref}   (run {run_name})")
    print(f"events         {url}/api/v1/runs/{run_ref}/events")
    print(f"metrics        {url}/metrics")
    print(f"grafana        dashboards/json/attnchecker-overview.json (Grafana uid {DASHBOARD_UID}); "
          "`docker compose up` serves it at http://localhost:3000/d/" + DASHBOARD_UID)
    if run_id is None:
        print("(the collector has not answered yet: events are spooled and sent once it does)")
    print("change the policy while it runs (the progress line shows the applied version):")
    if operator_token:
        print(f"  export OPERATOR_TOKEN={operator_token}")
    print("  " + _policy_curl(url, run_ref))


def _change_policy(url: str, operator_token: str, guard: Guard) -> bool:
    """What the printed curl does, sent by the demo itself so the change is seen even when nobody types it."""
    import httpx

    run_id = _run_id(guard)
    if run_id is None:
        return False
    try:
        r = httpx.patch(f"{url}/api/v1/runs/{run_id}/policy", json={"tolerance_factor": 2.0},
                        headers={"Authorization": f"Bearer {operator_token}"}, timeout=2.0)
    except httpx.HTTPError:
        return False
    if r.status_code != 200:
        return False
    version = r.json().get("version")
    print(f"\n[operator] PATCH policy → v{version} (tolerance_factor 2.0); "
          "the agent applies it at a step boundary after its next poll")
    # The demo plays the operator too: wait (bounded) until the sender thread has polled the new version, so that a
    # short demo still shows it applied. Training code never waits like this; the guard only reads what has arrived.
    deadline = time.monotonic() + POLICY_WAIT_S
    while time.monotonic() < deadline:
        latest = guard.transport.latest_policy() if guard.transport is not None else None
        if latest is not None and latest.version >= version:
            break
        time.sleep(0.05)
    return True


def _collector_view(url: str, token: str | None, run_id: str | None) -> dict[str, Any] | None:
    """What the collector shows for the run after close (events are counted page by page), or None."""
    import httpx

    if run_id is None:
        return None
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        base = f"{url}/api/v1/runs/{run_id}"
        with httpx.Client(headers=headers, timeout=5.0) as http:
            run = http.get(base).raise_for_status().json()
            events, cursor = 0, None
            for _ in range(1000):  # bounded: 1000 pages of 500 events are far more than a demo makes
                params = {"limit": 500, **({"cursor": cursor} if cursor else {})}
                page = http.get(f"{base}/events", params=params).raise_for_status().json()
                events += len(page["data"])
                cursor = page.get("next_cursor")
                if not cursor:
                    break
    except (httpx.HTTPError, ValueError, KeyError):
        return None
    return {"events": events, "status": run.get("status"), "requested": run.get("requested_policy_version"),
            "applied": run.get("applied_policy_version")}


def _progress(step: int, steps: int, loss: float, guard: Guard, reference: Trainer | None, faulty: Trainer | None,
              tty: bool) -> None:
    report = guard.report()
    periods = guard.periods
    period_text = ""
    if periods:
        p = dict(periods)
        period_text = " periods " + ",".join(f"{op}={p[op]}" for op in p)
    line = (f"step {step + 1:4d}/{steps} loss {loss:6.3f}"
            + (f" (fault-free {reference.losses[-1]:6.3f})" if reference is not None else "")
            + f" | faults detected {report.detected} corrected {report.corrected}"
            + (f" uncorrectable {report.uncorrectable}" if report.uncorrectable else "")
            + f" | policy v{guard.policy.version}{period_text}")
    if faulty is not None and faulty.broken_at is not None:
        line += f" | unprotected: broken at step {faulty.broken_at + 1}"
    if tty:
        print("\r" + line[:200].ljust(120), end="", flush=True)
    elif (step + 1) % 20 == 0 or step + 1 == steps:
        print(line, flush=True)


def _summary(args: argparse.Namespace, guard: Guard, protected: Trainer, reference: Trainer | None,
             faulty: Trainer | None, url: str | None, run_name: str, local: LocalCollector | None) -> None:
    report = guard.report()
    injected = guard.injector.injected if guard.injector is not None else []
    print("\n=== ATTNChecker demo summary ===")
    print(f"steps trained            {args.steps}")
    print(f"faults injected          {len(injected)}")
    print(f"detected                 {report.detected}")
    print(f"corrected                {report.corrected}")
    print(f"uncorrectable            {report.uncorrectable}")
    print(f"final loss (protected)   {protected.losses[-1]:.4f}")
    if reference is not None:
        rel = [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(protected.losses, reference.losses, strict=False)]
        early = min(len(rel), EARLY_STEPS)
        print(f"final loss (fault-free)  {reference.losses[-1]:.4f}   max per-step relative difference "
              f"{max(rel[:early]):.2e} over the first {early} steps")
        if len(rel) > early:
            print("                         (later steps drift apart at floating-point-noise level, "
                  f"{max(rel[early:]):.1e}: "
                  "the fault-free copy runs PyTorch's fused SDPA kernel, which rounds differently, and training "
                  "amplifies any 1e-7 difference)")
        ratio = statistics.median(protected.seconds) / statistics.median(reference.seconds)
        print(f"overhead                 {100 * (ratio - 1):+.1f} % step time (median protected "
              f"{1e3 * statistics.median(protected.seconds):.0f} ms vs unprotected "
              f"{1e3 * statistics.median(reference.seconds):.0f} ms, interleaved; on a model this small the "
              "per-call costs dominate: docs/performance.md has the controlled figures at GPT-2 size)")
    if faulty is not None:
        if faulty.broken_at is None:
            print("unprotected + same faults: still trainable (final loss "
                  f"{faulty.losses[-1]:.4f})")
        else:
            print(f"unprotected + same faults: non-trainable (NaN/INF loss or weights) from step "
                  f"{faulty.broken_at + 1}: it would need a checkpoint reload")
    if url:
        run_id = _run_id(guard)
        transport = guard.transport
        assert transport is not None  # url means the demo protected with collector=url
        print(f"events streamed          sent {transport.sent}, spooled {transport.spooled}, dropped "
              f"{transport.dropped}")
        held = _collector_view(url, local.operator_token if local is not None else args.operator_token, run_id)
        if held is not None:
            print(f"collector holds          {held['events']} events; run {held['status']}, policy requested "
                  f"v{held['requested']} applied v{held['applied']}")
        print(f"\ndashboard page {_page_url(url, run_id)}")
        print(f"collector API  {url}/api/v1/runs/{run_id or '<run id>'}   run {run_name}")
        print(f"events         {url}/api/v1/runs/{run_id or '<run id>'}/events")
        print(f"metrics        {url}/metrics")
        print(f"grafana        `docker compose up`, then http://localhost:3000/d/{DASHBOARD_UID} "
              "(or import dashboards/json/attnchecker-overview.json)")
    if local is not None:
        print(f"\nthe collector keeps running (pid {local.pid}, data in {local.data_dir}); "
              f"stop it with: kill {local.pid}")
        print(f"tokens: agent {local.agent_token}  operator {local.operator_token}")
