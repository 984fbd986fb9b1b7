"""The model zoo the protect/integration tests train: tiny random-weight configs (2 layers, hidden 64, 4 heads), built
offline, plus a nanoGPT-style SDPA model and nn.TransformerEncoder models. No tests here; the other test_protect*
modules import it."""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")

VOCAB = 128
SEQ = 24
BATCH = 2
HF_ARCHS = ("gpt2", "bert", "roberta", "gpt_neo", "llama")
PLAIN_ARCHS = ("nanogpt", "torch_encoder")
ARCHS = HF_ARCHS + PLAIN_ARCHS


class CausalSelfAttention(nn.Module):
    """nanoGPT's attention: fused c_attn, inline F.scaled_dot_product_attention, c_proj."""

    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    def __init__(
        self, vocab: int = VOCAB, n_embd: int = 64, n_head: int = 4, n_layer: int = 2, block: int = 64
    ) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, n_embd)
        self.wpe = nn.Embedding(block, n_embd)
        self.h = nn.ModuleList([Block(n_embd, n_head) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


class EncoderLM(nn.Module):
    """nn.TransformerEncoder over embeddings, causal mask + key padding mask."""

    def __init__(self, batch_first: bool = True, vocab: int = VOCAB, d: int = 64, nhead: int = 4) -> None:
        super().__init__()
        self.batch_first = batch_first
        self.emb = nn.Embedding(vocab, d)
        layer = nn.TransformerEncoderLayer(d, nhead, dim_feedforward=128, dropout=0.0, batch_first=batch_first)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor, pad: torch.Tensor | None = None) -> torch.Tensor:
        x = self.emb(idx)
        if not self.batch_first:
            x = x.transpose(0, 1)
        mask = nn.Transformer.generate_square_subsequent_mask(idx.shape[1])
        # Float like the causal mask: PyTorch deprecates mixing bool and float masks.
        pad_mask = None if pad is None else torch.zeros(pad.shape).masked_fill(pad, float("-inf"))
        y = self.encoder(x, mask=mask, src_key_padding_mask=pad_mask, is_causal=True)
        if not self.batch_first:
            y = y.transpose(0, 1)
        return self.head(y)


def _hf(arch: str, overrides: dict[str, object]) -> nn.Module:
    import transformers as tf

    def config(cls: type, **defaults: object) -> object:
        # The test's overrides win over the zoo's defaults (attention dropout, say).
        return cls(**{**defaults, "vocab_size": VOCAB, **overrides})

    if arch == "gpt2":
        return tf.GPT2LMHeadModel(config(tf.GPT2Config, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                         eos_token_id=0))
    if arch in ("bert", "roberta"):
        cls_cfg, cls_model = (
            (tf.BertConfig, tf.BertForMaskedLM) if arch == "bert" else (tf.RobertaConfig, tf.RobertaForMaskedLM)
        )
        return cls_model(config(cls_cfg, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                intermediate_size=128, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                max_position_embeddings=64, pad_token_id=1))
    if arch == "gpt_neo":
        return tf.GPTNeoForCausalLM(config(tf.GPTNeoConfig, hidden_size=64, num_layers=2, num_heads=4,
                                           attention_types=[[["global", "local"], 1]], window_size=8,
                                           max_position_embeddings=64, intermediate_size=128, embed_dropout=0.0,
                                           attention_dropout=0.0, resid_dropout=0.0, bos_token_id=0,
                                           eos_token_id=0))
    if arch == "llama":
        return tf.LlamaForCausalLM(config(tf.LlamaConfig, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                          bos_token_id=0, eos_token_id=0, pad_token_id=0))
    raise ValueError(arch)


def build(arch: str, seed: int = 0, **config: object) -> nn.Module:
    """A fresh model with weights fixed by ``seed`` (same seed -> identical weights), in train mode. ``config``
    overrides fields of a transformers config."""
    torch.manual_seed(seed)
    if arch in HF_ARCHS:
        model = _hf(arch, config)
    elif arch == "nanogpt":
        model = NanoGPT()
    elif arch == "torch_encoder":
        model = EncoderLM(batch_first=True)
    elif arch == "torch_encoder_seq_first":
        model = EncoderLM(batch_first=False)
    else:
        raise ValueError(arch)
    return model.train()


def batch(arch: str, step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(2, VOCAB, (BATCH, SEQ), generator=g)
    out = {"ids": ids}
    if arch in ("bert", "roberta", "torch_encoder", "torch_encoder_seq_first"):
        # The second sequence is padded at the end: exercises the padding mask path.
        keep = torch.ones(BATCH, SEQ, dtype=torch.long)
        keep[1, -5:] = 0
        out["keep"] = keep
    return out


def loss_of(arch: str, model: nn.Module, b: dict[str, torch.Tensor]) -> torch.Tensor:
    ids = b["ids"]
    if arch in HF_ARCHS:
        kwargs = {"input_ids": ids, "labels": ids}
        if "keep" in b:
            kwargs["attention_mask"] = b["keep"]
        return model(**kwargs).loss
    if arch == "nanogpt":
        logits = model(ids)
    else:
        logits = model(ids, pad=b["keep"] == 0)
    return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


@dataclass
class RunResult:
    losses: list[float]
    finite_weights: bool
    grads: list[dict[str, torch.Tensor]]


def injected_step(arch: str, model: nn.Module, opt: torch.optim.Optimizer, injector: Any) -> dict[str, torch.Tensor]:
    """One forward, backward and optimizer step of ``model`` on batch 0 under ``injector`` (a dispatch mode with a
    ``phase`` attribute, set to "backward" before the backward): the gradients, as the optimizer took them."""
    opt.zero_grad(set_to_none=True)
    with injector:
        loss = loss_of(arch, model, batch(arch, 0))
        injector.phase = "backward"
        loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    opt.step()
    return grads


def train(
    arch: str,
    model: nn.Module,
    steps: int,
    *,
    on_step: Callable[[], None] | None = None,
    lr: float = 1e-3,
    keep_grads: bool = False,
    autocast: torch.dtype | None = None,
) -> RunResult:
    """AdamW for ``steps`` steps on fixed seeded batches. ``on_step`` runs after each optimizer step (Guard.step)."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses: list[float] = []
    grads: list[dict[str, torch.Tensor]] = []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        if autocast is not None:
            with torch.autocast("cpu", dtype=autocast):
                loss = loss_of(arch, model, batch(arch, step))
        else:
            loss = loss_of(arch, model, batch(arch, step))
        loss.backward()
        if keep_grads:
            grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})
        losses.append(loss.item())
        opt.step()
        if on_step is not None:
            on_step()
    finite = all(torch.isfinite(p).all().item() for p in model.parameters())
    return RunResult(losses=losses, finite_weights=finite, grads=grads)


def rel_diff(a: float, b: float) -> float:
    if math.isnan(a) or math.isnan(b) or math.isinf(a) or math.isinf(b):
        return math.inf
    return abs(a - b) / max(abs(b), 1e-12)


STEPS = 20


@functools.cache
def reference_losses(arch: str, steps: int = STEPS) -> tuple[float, ...]:
    """The unprotected, fault-free per-step losses (cached: several tests compare against them)."""
    return tuple(train(arch, build(arch), steps).losses)


def fault_seed(arch: str) -> int:
    """A different, fixed fault plan per architecture."""
    return 100 + ARCHS.index(arch) if arch in ARCHS else 99
