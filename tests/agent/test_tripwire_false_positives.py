"""Issue 10: tier 1 never trips on clean training. At least 10^4 tier-1 checks per dtype (fp32, bf16 autocast, fp16
autocast) on real training (the loss goes down), with padded keys and query rows whose every key is masked: an
nn.TransformerEncoder with a causal mask and left padding (-INF masks), and GPT-2 with left padding (its masks use the
dtype's most negative finite value). Counted in checks, not steps, so it stays fast: the period is 8, so seven steps
in eight are tier-1 steps, and the models are deep and narrow."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import attnchecker
from attnchecker import Policy

sys.path.insert(0, str(Path(__file__).parent))
import model_zoo as mz

CHECKS = 10_000
POLICY = Policy(period=8, min_period=8, max_period=8)
VOCAB, SEQ, BATCH, PAD = 61, 16, 4, 5


class PaddedEncoder(nn.Module):
    def __init__(self, layers: int = 8, d: int = 32) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, d)
        layer = nn.TransformerEncoderLayer(d, 4, dim_feedforward=64, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, VOCAB)

    def forward(self, ids: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        causal = nn.Transformer.generate_square_subsequent_mask(ids.shape[1])
        pad_mask = torch.zeros(pad.shape).masked_fill(pad, float("-inf"))
        return self.head(self.encoder(self.emb(ids), mask=causal, src_key_padding_mask=pad_mask, is_causal=True))


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    out = []
    for _ in range(n):
        ids = torch.randint(2, VOCAB, (BATCH, SEQ), generator=g)
        pad = torch.zeros(BATCH, SEQ, dtype=torch.bool)
        pad[1, :PAD] = True  # left padding: with the causal mask, query rows 0..PAD-1 of sequence 1 see no key
        pad[3, -3:] = True  # right padding
        out.append((ids, pad))
    return out


def _train(model: nn.Module, loss_of, dtype: torch.dtype, guard_checks: int, scope: str = "attention"
           ) -> tuple[list[float], attnchecker.Guard]:
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    guard = attnchecker.protect(model, optimizer=opt, policy=POLICY, scope=scope)
    data = _batches(4)
    losses: list[float] = []
    step = 0
    while guard.report().tier_checks["tripwire"] < guard_checks:
        opt.zero_grad(set_to_none=True)
        ids, pad = data[step % len(data)]
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            loss = loss_of(model, ids, pad)
        loss.backward()
        losses.append(loss.item())
        opt.step()
        step += 1
    return losses, guard


def _encoder_loss(model: nn.Module, ids: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
    logits = model(ids, pad)[:, :-1].float()
    keep = ~pad[:, 1:]
    return F.cross_entropy(logits[keep], ids[:, 1:][keep])


def _gpt2_loss(model: nn.Module, ids: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
    labels = ids.masked_fill(pad, -100)
    return model(input_ids=ids, attention_mask=(~pad).long(), labels=labels).loss


@pytest.mark.parametrize("scope", ["attention", "all"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_no_tier1_trip_in_ten_thousand_clean_checks(dtype: torch.dtype, scope: str) -> None:
    """scope "all": the whole-step GEMMs' tier 1 (Linear outputs, dX, dW, the fused attention backward) as well."""
    total = 0
    for name, model, loss_of, share in (
        ("encoder", PaddedEncoder(), _encoder_loss, 0.7),
        ("gpt2", mz.build("gpt2"), _gpt2_loss, 0.3),
    ):
        torch.manual_seed(0)
        losses, guard = _train(model, loss_of, dtype, int(CHECKS * share), scope)
        report = guard.report()
        assert report.tier_catches["tripwire"] == 0, (name, guard.detections[:5])
        assert report.tier_catches["optimizer"] == 0
        assert not guard.detections, (name, guard.detections[:5])
        first, last = sum(losses[:8]) / 8, sum(losses[-8:]) / 8
        assert last < 0.8 * first, (name, first, last)  # real training: the loss goes down
        total += report.tier_checks["tripwire"]
        guard.close()
    assert total >= CHECKS
