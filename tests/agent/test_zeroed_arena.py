"""checks/zeroed.py: the zero-filled memory the GPU path's atomics take, one memset a chunk instead of one a call."""
from __future__ import annotations

import itertools
import threading

import pytest
import torch

from attnchecker.checks.zeroed import ZeroedArena

CPU = torch.device("cpu")


def _span(t: torch.Tensor) -> tuple[int, int]:
    return t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()


def test_slices_are_zero_distinct_and_never_handed_out_twice() -> None:
    """Each slice is zeros when taken, whatever was written into the ones before it; no two overlap; each starts on a
    16-byte boundary, as an allocation of its own would (Triton specialises a kernel on it); a chunk is made only when
    the current one cannot hold the request."""
    arena = ZeroedArena(chunk_floats=64)
    taken = []
    for n in (16, 16, 0, 15, 16, 2):
        got = arena.take(CPU, n)
        assert got.shape == (n,) and got.dtype == torch.float32 and bool((got == 0).all())
        assert got.data_ptr() % 16 == 0
        got.fill_(3.0)  # a kernel's atomics
        taken.append(got)
    spans = sorted(_span(t) for t in taken if t.numel())
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))
    assert arena.chunks_made == 2  # 16 + 16 + 15 (+ 1 to align) + 16 = 64 fill the first


def test_a_large_request_gets_its_own_memory_and_leaves_the_chunk_alone() -> None:
    """Past a quarter chunk (a full check's operand sums on a wide layer) a request is its own allocation, so it
    does not keep a chunk alive; the chunk's next slice follows the last small one."""
    arena = ZeroedArena(chunk_floats=64)
    small = arena.take(CPU, 7)
    big = arena.take(CPU, 17)
    nxt = arena.take(CPU, 8)
    assert bool((big == 0).all()) and big.numel() == 17
    assert arena.chunks_made == 1
    assert nxt.data_ptr() == small.data_ptr() + 8 * 4
    assert not (big.untyped_storage().data_ptr() == small.untyped_storage().data_ptr())


def test_threads_taking_at_once_never_share_a_slice() -> None:
    arena = ZeroedArena(chunk_floats=256)
    got: list[torch.Tensor] = []
    lock = threading.Lock()

    def work() -> None:
        mine = [arena.take(CPU, 3) for _ in range(200)]
        with lock:
            got.extend(mine)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({t.data_ptr() for t in got}) == len(got) == 800


@pytest.mark.parametrize(("chunk", "n", "what"), [(0, 1, "chunk_floats must be at least 1"),
                                                  (64, -1, "n must be at least 0")])
def test_bad_sizes_are_clear_errors(chunk: int, n: int, what: str) -> None:
    with pytest.raises(ValueError, match=what):
        ZeroedArena(chunk_floats=chunk).take(CPU, n)


def test_a_full_chunk_is_freed_once_its_slices_are() -> None:
    """The arena keeps only its current chunk: an earlier one lives as long as the records holding its slices (until
    the step boundary reads them), then its memory goes back, so a long run holds a chunk and what is pending."""
    import gc
    import weakref

    arena = ZeroedArena(chunk_floats=64)
    pending = [arena.take(CPU, 16) for _ in range(4)]
    first = weakref.ref(pending[0]._base)
    pending.append(arena.take(CPU, 16))  # a second chunk
    assert arena.chunks_made == 2 and first() is not None
    pending.clear()
    gc.collect()
    assert first() is None
