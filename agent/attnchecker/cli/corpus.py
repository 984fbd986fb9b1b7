"""Training text that ships with every Python: the standard library's own source, as bytes (a 256-token vocabulary).
Nothing is downloaded."""
from __future__ import annotations

import sysconfig
from pathlib import Path

import torch


def stdlib_corpus(max_bytes: int = 4 << 20) -> torch.Tensor:
    """The top-level stdlib modules concatenated in name order (deterministic), as a uint8 tensor."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks: list[bytes] = []
    size = 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        size += len(data)
        if size >= max_bytes:
            break
    if size == 0:
        raise RuntimeError(f"no Python sources found under {root}: the demo trains on the standard library's source")
    return torch.frombuffer(bytearray(b"".join(chunks)[:max_bytes]), dtype=torch.uint8)


class Batches:
    """Seeded random windows of the corpus: (inputs, targets) as int64 (batch, seq)."""

    def __init__(self, data_N: torch.Tensor, *, batch: int, seq: int, seed: int) -> None:
        if data_N.numel() <= seq + 1:
            raise ValueError(f"corpus of {data_N.numel()} bytes is too small for seq={seq}")
        self.data_N = data_N
        self.batch = batch
        self.seq = seq
        self.gen = torch.Generator().manual_seed(seed)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        starts_B = torch.randint(self.data_N.numel() - self.seq - 1, (self.batch,), generator=self.gen)
        offsets_T = torch.arange(self.seq + 1)
        window_BT = self.data_N[starts_B[:, None] + offsets_T].long()
        return window_BT[:, :-1], window_BT[:, 1:]
