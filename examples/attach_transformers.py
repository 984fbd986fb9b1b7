"""Attach ATTNChecker to a Hugging Face transformers training loop (runs in seconds on a CPU, nothing downloaded).

    python examples/attach_transformers.py

The model is unmodified: protect() switches its attention implementation to the protected one and hooks the q/k/v
and output projections; close() (or leaving the `with` block) puts everything back.
"""

# ruff: noqa: T201 - an example script: it prints
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import attnchecker
import torch
import transformers
from attnchecker import FaultPlan, Policy


def main() -> None:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_embd=64, n_layer=2, n_head=4, n_positions=64, vocab_size=128, bos_token_id=0, eos_token_id=0
    )
    model = transformers.GPT2LMHeadModel(config)  # or AutoModelForCausalLM.from_pretrained(...)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    # A demo fault every step, so there is something to see; leave `faults=` out in real training.
    faults = FaultPlan.random(steps=10, layers=2, per_step=1, seed=0)
    # optimizer= makes every optimizer.step() a step boundary (policy changes apply there).
    with attnchecker.protect(model, optimizer=optimizer, policy=Policy.full(), faults=faults) as guard:
        for step in range(10):
            ids = torch.randint(0, 128, (2, 32))
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            print(f"step {step}: loss {loss.item():.4f}")
        report = guard.report()
        print("protected layers:", [site.name for site in guard.sites])
        print(f"detected {report.detected}, corrected {report.corrected}, uncorrectable {report.uncorrectable}")
        print("per op:", {op: (c.detected, c.corrected) for op, c in report.by_op().items()})
    print("attention implementation after close:", model.config._attn_implementation)


if __name__ == "__main__":
    main()
