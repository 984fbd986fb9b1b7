"""The Triton GEMM checks compiled, on a CUDA device (marker ``gpu``; skipped without one): the short checks of one
prepared GPU run. Without a GPU, test_triton_gemm_check.py and test_whole_step_triton.py run the same kernels under
Triton's interpreter. Run on one H200 so far (docs/performance.md §8)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from gemm_injector import GemmInjector, is_model_gemm, worst_rel
from model_zoo import batch, build, loss_of
from sync_counter import SyncCounter

import attnchecker
from attnchecker import Policy
from attnchecker.checks.deferred import drain
from attnchecker.gemm import device
from attnchecker.gemm.check import check_gemms
from attnchecker.inject import bitflip
from attnchecker.kernels import triton_gemm_check as tg

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def ieee_gemms() -> None:
    """The products these tests compare in IEEE fp32 (PyTorch's default; a TF32 run is bench/'s business)."""
    torch.backends.cuda.matmul.allow_tf32 = False


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_gpu_the_check_corrects_each_kind_and_recomputes_a_row_without_a_sync(dtype: torch.dtype, make_ctx,
                                                                             monkeypatch) -> None:
    monkeypatch.setenv(device.GEMM_ENV, "auto")
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(512, 768, device="cuda", generator=g).to(dtype)
    b = torch.randn(768, 1024, device="cuda", generator=g).to(dtype)
    c = (a.float() @ b.float()).to(dtype)
    want = c.clone()
    for row, value in enumerate((float("inf"), float("nan"), 1e20)):
        c[10 * row + 1, 7 * row + 3] = value
    c[31, 24] = bitflip(c[31, 24])
    c[300, :] = float("inf")
    ctx, rec = make_ctx()
    tg.LAUNCHES.reset()
    with SyncCounter() as syncs:
        check_gemms(ctx, [("linear_dw", c, a, b, None)])
    assert syncs.calls == []
    assert tg.LAUNCHES.by_kernel == {"operand_pass": 2, "check_pass": 1, "repair_rows": 1}
    drain(ctx.runtime.deferred)
    (det,) = rec.detections
    assert (det.op, det.action, det.pattern) == ("linear_dw", "recomputed", "2d")
    if dtype == torch.float32:
        # The repaired elements are dot products in another order than cuBLAS's: each of the two lies within K·u·|a||b|
        # of the exact value (u = 2^-24). assert_close's fp32 default (1.3e-6 relative, 1e-5 absolute) is tighter
        # than that at K = 768, where an element's |a||b| is ~600.
        bound = 2 * a.shape[1] * 2.0**-24 * (a.abs() @ b.abs())
        assert bool(((c - want).abs() <= bound).all()), float(((c - want).abs() / bound).max())
    else:
        torch.testing.assert_close(c, want)


def test_gpu_a_gpt2_step_corrects_a_fault_in_each_kind_of_linear_gemm(monkeypatch) -> None:
    """One layer of GPT-2 on cuda, every Linear GEMM checked on the Triton path: a fault in the MLP's forward, dX and
    dW (below autograd) is corrected, the gradients are the clean step's."""
    monkeypatch.setenv(device.GEMM_ENV, "auto")

    def step(injector: GemmInjector) -> tuple[dict[str, torch.Tensor], list]:
        model = build("gpt2", n_layer=1).cuda()
        guard = attnchecker.protect(model, policy=Policy.full(), scope="all")
        with injector:
            loss = loss_of("gpt2", model, {k: v.cuda() for k, v in batch("gpt2", 0).items()})
            injector.phase = "backward"
            loss.backward()
        guard.step()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        detections = list(guard.detections)
        guard.close()
        return grads, detections

    recorder = GemmInjector()
    clean, detections = step(recorder)
    assert detections == []
    picks = [c for c in recorder.calls if is_model_gemm(c) and c.shape in ((48, 256), (64, 256))]
    for n, call in enumerate(picks[:3]):
        grads, detections = step(GemmInjector(target=call.index, kind=("inf", "nan", "bitflip")[n], element=11))
        assert detections and all(d.action in ("corrected", "recomputed") for d in detections), detections
        assert worst_rel(grads, clean) <= 1e-4


@pytest.mark.slow
def test_gpu_the_check_bench_runs(tmp_path: Path) -> None:
    out = tmp_path / "triton_gemm_check.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "triton_gemm_check.py"), "--tiny", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=540, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["device"] == "cuda" and doc["time"]
