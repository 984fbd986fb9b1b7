"""Data-parallel training, as it runs on many accelerators: two processes (gloo on CPU), the model wrapped in
DistributedDataParallel, each rank protected with protect(model, optimizer=opt, scope="all") and the default policy.

An INF planted by a TorchDispatchMode below autograd into one rank's MLP weight gradient (GPT-2's c_fc dW) is
corrected on that rank before DDP's all-reduce reads it, so both ranks step on the fault-free average and keep equal,
finite weights. Under the attention scope the same fault is all-reduced into both ranks' gradients: the optimizer
net keeps it out of the weights only by skipping that step on every rank (the control)."""
from __future__ import annotations

import os
import socket
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode

STEPS = 3
FAULT_STEP = 1


class _DwInf(TorchDispatchMode):
    """INF into element 7 of the first backward GEMM output shaped like GPT-2's c_fc weight gradient (64, 256)."""

    def __init__(self) -> None:
        super().__init__()
        self.backward = False
        self.hit = False

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if (not self.hit and self.backward and func is torch.ops.aten.mm.default
                and tuple(out.shape) == (64, 256)):
            out.view(-1)[7] = float("inf")
            self.hit = True
        return out


def _worker(rank: int, world: int, port: int, scope: str | None, inject: bool, queue: Any) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    from model_zoo import batch, build

    import attnchecker

    model = build("gpt2")
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-2)
    guard = attnchecker.protect(model, optimizer=opt, scope=scope) if scope else None
    hit = False
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        ids = batch("gpt2", step * world + rank)["ids"]  # each rank its own data, as a sampler gives it
        mode = _DwInf() if inject and rank == 0 and step == FAULT_STEP else None
        if mode is None:
            ddp(input_ids=ids, labels=ids).loss.backward()
        else:
            with mode:
                loss = ddp(input_ids=ids, labels=ids).loss
                mode.backward = True
                loss.backward()
            hit = mode.hit
        opt.step()
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    detections = [(d.op, d.tier, d.action, d.step) for d in guard.detections] if guard else []
    queue.put((rank, weights.numpy().tobytes(), detections, hit))
    if guard:
        guard.close()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(scope: str | None, *, inject: bool) -> list[tuple[int, torch.Tensor, list, bool]]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, 2, port, scope, inject, queue)) for r in range(2)]
    for p in procs:
        p.start()
    got = sorted((queue.get(timeout=300) for _ in procs), key=lambda r: r[0])
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    return [(r, torch.frombuffer(bytearray(w), dtype=torch.float32), d, h) for r, w, d, h in got]


@pytest.fixture(autouse=True)
def _child_path(monkeypatch: pytest.MonkeyPatch) -> None:
    # Spawned children import model_zoo from here and attnchecker as the parent does.
    here = os.path.dirname(__file__)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))


def test_a_weight_gradient_fault_on_one_rank_is_corrected_before_the_all_reduce() -> None:
    clean = _run("all", inject=False)
    faulty = _run("all", inject=True)
    assert faulty[0][3], "the injector found no c_fc weight-gradient GEMM on rank 0"
    assert torch.equal(faulty[0][1], faulty[1][1])  # DDP kept the ranks in step
    assert bool(torch.isfinite(faulty[0][1]).all())
    torch.testing.assert_close(faulty[0][1], clean[0][1], rtol=1e-6, atol=1e-9)
    assert faulty[0][2] == [("linear_dw", "abft", "corrected", FAULT_STEP)]
    assert faulty[1][2] == []


def test_under_the_attention_scope_the_fault_reaches_every_rank_and_costs_the_step() -> None:
    faulty = _run("attention", inject=True)
    assert faulty[0][3]
    for _rank, _weights, detections, _hit in faulty:
        # rank 1 never saw the fault itself: DDP's all-reduce brought it the INF.
        assert detections == [("grad", "optimizer", "uncorrectable", FAULT_STEP)]
