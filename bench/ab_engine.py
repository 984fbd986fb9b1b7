"""A/B two versions of the engine (agent/attnchecker/attention/pipeline.py) in one process, interleaved, on the GPT-2
size: the installed one ("A") and another copy of attention.py given by path ("B", e.g. `git show REV:agent/attnchecker/
attention.py > /tmp/before.py`). Both are driven through the same integrations (they import protected_sdpa and
check_linear from attnchecker.attention.pipeline at call time, which is swapped per step).

    python bench/ab_engine.py /tmp/before.py [rounds]
"""
from __future__ import annotations

import contextlib
import functools
import importlib.util
import statistics
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common
import overhead as ov
import torch

import attnchecker.attention.pipeline as engine_a


def load(path: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location("attnchecker.attention_b", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


@contextlib.contextmanager
def engine(mod: ModuleType) -> Iterator[None]:
    old = (engine_a.protected_sdpa, engine_a.check_linear)
    engine_a.protected_sdpa, engine_a.check_linear = mod.protected_sdpa, mod.check_linear
    try:
        yield
    finally:
        engine_a.protected_sdpa, engine_a.check_linear = old


def main() -> int:
    torch.set_num_threads(1)
    engine_b = load(sys.argv[1])
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 6
    size = ov.SIZES["full"]
    base = ov.build_model("gpt2", size)
    batch = torch.randint(0, size["vocab"], (size["batch"], size["seq"]), generator=torch.Generator().manual_seed(0))
    shared = (base, torch.optim.AdamW(base.parameters(), lr=1e-5))
    vs = {"baseline": (ov.Variant("baseline", shared, batch, tiny_batch=batch[:1, :8]), engine_a)}
    for name in ("full", "skip"):
        for tag, mod in (("A", engine_a), ("B", engine_b)):
            vs[f"{name}_{tag}"] = (ov.Variant(name, shared, batch, tiny_batch=batch[:1, :8]), mod)

    def run(v: ov.Variant, mod: ModuleType) -> float:
        with engine(mod):
            return v.step()

    _common.interleaved({n: functools.partial(run, *vm) for n, vm in vs.items()}, rounds=rounds, warmup=1)
    cpu = {n: vm[0].cpu_s[1:] for n, vm in vs.items()}
    r = _common.ratios(cpu, "baseline")
    rows = [[n, statistics.median(cpu[n]) * 1e3, _common.pct(r[n]["median"]),
             f"[{_common.pct(r[n]['p25'])}, {_common.pct(r[n]['p75'])}]"] for n in vs]
    print(_common.table(rows, ["variant (A installed, B given)", "CPU ms/step", "vs baseline", "IQR"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
