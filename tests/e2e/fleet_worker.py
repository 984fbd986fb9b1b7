"""One rank of the simulated fleet (tests/e2e/test_fleet.py), started by torchrun with the gloo backend.

Each rank stands in for its own machine and GPU through the identity overrides (ATTNCHECKER_HOSTNAME: 4 hosts, two
ranks each; ATTNCHECKER_DEVICE_UUID: one uuid per rank), trains the tiny model of e2e_helpers under
DistributedDataParallel and attnchecker.protect(), and injects faults through the project's injector: a FaultPlan per
rank, with the bad rank's rate ten times the others'. It runs RUNS runs one after another (a new run name each, the
guard closed between them), then one more, "live", that trains until the test's stop file appears, writing down each
policy its guard applies (the operator's suspect-device round trip).

    torchrun --standalone --nproc_per_node 8 fleet_worker.py URL TOKEN DIR
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from e2e_helpers import FAST, VOCAB, tiny_model
from torch.nn.parallel import DistributedDataParallel

import attnchecker
from attnchecker import FaultPlan
from attnchecker.policy import OPS

RUNS = 3
STEPS = 8
LAYERS = 2
BAD_RANK = 5
HEALTHY_RATE = 0.04
"""Per (step, layer, op) slot: about 4 faults per healthy rank per run (8 steps x 2 layers x 6 ops = 96 slots), about
38 on the bad rank."""
LIVE_STEP_PAUSE_S = 0.05


def uuid_of(rank: int) -> str:
    return f"GPU-5eed0000-0000-4000-8000-{rank:012d}"


def host_of(rank: int) -> str:
    return f"fleet-node-{rank // 2}"


def _plan(rank: int, run: int) -> FaultPlan:
    rate = HEALTHY_RATE * (10 if rank == BAD_RANK else 1)
    # Extreme values: tier 1 catches them on every step, so every fault is seen whatever the schedule.
    return FaultPlan.random(steps=STEPS, layers=LAYERS, ops=OPS, kinds=("inf", "nan", "near_inf"), rate=rate,
                            seed=1000 * run + rank)


def _train(ddp: torch.nn.Module, opt: torch.optim.Optimizer, step: int, rank: int) -> None:
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(step * 64 + rank))
    logits = ddp(ids)
    torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1)).backward()
    opt.step()  # the guard's step boundary runs in the optimizer's post hook
    opt.zero_grad(set_to_none=True)


def main(url: str, token: str, directory: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    os.environ["ATTNCHECKER_HOSTNAME"] = host_of(rank)
    os.environ["ATTNCHECKER_DEVICE_UUID"] = uuid_of(rank)
    out = Path(directory)
    model = tiny_model(seed=0)
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    # Eight agents on one small collector (and two cores): poll and flush a few times a second, not ten, and wait
    # longer for an answer before spooling.
    transport = {**FAST, "poll_interval_s": 0.5, "flush_interval_s": 0.25, "read_timeout_s": 10.0}
    common = {"collector": url, "token": token, "spool_dir": out / f"spool-{rank}", "transport_options": transport,
              "stats_interval_steps": 4}
    sent = []
    for run in range(RUNS):
        guard = attnchecker.protect(model, optimizer=opt, run=f"fleet-{run}", faults=_plan(rank, run), **common)
        for step in range(STEPS):
            _train(ddp, opt, step, rank)
        guard.close(flush_timeout_s=10.0)
        # What this rank reported (its stats payloads, as sent) and the injector's ground truth: the test waits until
        # the collector has exactly this on this rank's device (anything spooled on the way is replayed later).
        sent.append({"run": f"fleet-{run}", "injected": len(guard.injector.injected),
                     "checks": sum(o["checks"] + o["tripwire_checks"] for b in guard.intervals for o in b["ops"]),
                     "detected": sum(f["detected"] for b in guard.intervals for f in b["faults"])})
        dist.barrier()
    (out / f"sent-{rank}.json").write_text(json.dumps(sent))

    # The live run: the default policy, until the test (an operator) has marked the bad device and seen its rank
    # apply the suspect-device policy.
    guard = attnchecker.protect(model, optimizer=opt, run="fleet-live", **common)
    applied = (guard.policy.version, "run")
    log = (out / f"applied-{rank}.log").open("a")
    step = 0
    stop = out / "stop"
    while True:
        # Every rank stops at the same step (DDP's collectives need them all): rank 0 decides and broadcasts.
        flag = torch.tensor([int(stop.exists())]) if rank == 0 else torch.zeros(1, dtype=torch.long)
        dist.broadcast(flag, src=0)
        if flag.item():
            break
        _train(ddp, opt, step, rank)
        step += 1
        scope = guard.policy_scope
        if (guard.policy.version, scope) != applied:
            applied = (guard.policy.version, scope)
            p = guard.policy
            print(json.dumps({"step": step, "version": p.version, "scope": scope, "period": p.period,
                              "adaptive": p.adaptive}), file=log, flush=True)
        time.sleep(LIVE_STEP_PAUSE_S)
    guard.close(flush_timeout_s=10.0)
    log.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
