"""Attach ATTNChecker to plain PyTorch models: a nanoGPT-style model calling F.scaled_dot_product_attention, and an
nn.TransformerEncoder (nn.MultiheadAttention inside). Runs in seconds on a CPU.

    python examples/attach_plain_pytorch.py
"""

# ruff: noqa: T201, N812, N806 - an example script: it prints, and keeps nanoGPT's names (F, B, T, C)
import attnchecker
import torch
import torch.nn.functional as F
from attnchecker import FaultPlan, Policy
from torch import nn


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)  # fused q/k/v: protected as three ops
        self.c_proj = nn.Linear(n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # routed to the protected kernel
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = 128, n_embd: int = 64, n_head: int = 4, n_layer: int = 2) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, n_embd)
        self.wpe = nn.Embedding(64, n_embd)
        self.attn = nn.ModuleList([CausalSelfAttention(n_embd, n_head) for _ in range(n_layer)])
        self.ln = nn.ModuleList([nn.LayerNorm(n_embd) for _ in range(n_layer)])
        self.head = nn.Linear(n_embd, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for ln, attn in zip(self.ln, self.attn, strict=True):
            x = x + attn(ln(x))
        return self.head(x)


def train(name: str, model: nn.Module, forward) -> None:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    faults = FaultPlan.random(steps=8, layers=2, per_step=1, seed=1)  # demo faults; leave out in real training
    with attnchecker.protect(model, optimizer=optimizer, policy=Policy.full(), faults=faults) as guard:
        for _ in range(8):
            ids = torch.randint(0, 128, (2, 32))
            logits = forward(model, ids)
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, 128), ids[:, 1:].reshape(-1))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        r = guard.report()
        print(
            f"{name}: final loss {loss.item():.4f}; layers {[s.name for s in guard.sites]}; "
            f"detected {r.detected}, corrected {r.corrected}, uncorrectable {r.uncorrectable}"
        )


def main() -> None:
    torch.manual_seed(0)
    train("nanoGPT-style (SDPA)", TinyGPT(), lambda m, ids: m(ids))

    encoder = nn.Sequential(
        nn.Embedding(128, 64),
        nn.TransformerEncoder(
            nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True), 2, enable_nested_tensor=False
        ),
        nn.Linear(64, 128),
    )
    train("nn.TransformerEncoder", encoder, lambda m, ids: m(ids))


if __name__ == "__main__":
    main()
