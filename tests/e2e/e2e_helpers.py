"""End-to-end helpers: a real collector (``attnchecker-server serve`` under uvicorn, in a subprocess on a loopback
port) on SQLite or PostgreSQL, a tiny attention model, and a training loop that records which threads talk to the
network.

The agent side is the product as a user runs it: ``attnchecker.protect(model, collector=..., token=...)``. The test
reads the collector only through its HTTP API and ``/metrics``, as an operator would.
"""
from __future__ import annotations

import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import attnchecker

try:
    import collector_testing as testing
except ImportError:  # only the agent is installed: running_collector() skips
    testing = None

VOCAB, SEQ, BATCH = 64, 16, 2
# Fast enough for a test: the sender flushes and polls ten times a second, and gives up quickly on a dead collector.
FAST = {"flush_interval_s": 0.05, "poll_interval_s": 0.1, "max_backoff_s": 0.3, "connect_timeout_s": 0.5,
        "read_timeout_s": 2.0}
BACKENDS = ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]


# --- the model ---------------------------------------------------------------------------------------------------


class _Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(dim, dim) for _ in range(3))
        self.o_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape

        def split(y: torch.Tensor) -> torch.Tensor:
            return y.view(b, t, self.heads, d // self.heads).transpose(1, 2)

        y = F.scaled_dot_product_attention(split(self.q_proj(x)), split(self.k_proj(x)), split(self.v_proj(x)),
                                           is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, d))


class TinyLM(nn.Module):
    """Embeddings, two residual attention layers (SDPA, separate q/k/v projections), a tied output head."""

    def __init__(self, dim: int = 32, heads: int = 2, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.layers = nn.ModuleList(_Attention(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = x + layer(x)
        return self.norm(x) @ self.embed.weight.T


def tiny_model(seed: int = 0) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM().train()


@dataclass
class Trained:
    """The socket operations made while ``train``'s steps ran."""

    network_in_steps: list[str] = field(default_factory=list)
    """Socket operations (connect, send, receive) the training thread made inside a step: the agent's own, since the
    test's calls run between steps. Empty when only the sender thread talks to the collector, so no step can wait
    on it."""
    network_elsewhere: int = 0
    """Socket operations other threads (the agent's sender) made meanwhile: shows the watch saw the traffic."""


_SOCKET_CALLS = ("connect", "connect_ex", "send", "sendall", "recv", "recv_into")


@contextmanager
def _watch_sockets(trained: Trained, armed: threading.Event) -> Iterator[None]:
    """Record every socket operation in this process (httpx's sync transport calls these methods of socket.socket):
    this thread's while ``armed`` is set, into ``trained.network_in_steps``, and count the other threads'."""
    me = threading.get_ident()
    own = {name: socket.socket.__dict__[name] for name in _SOCKET_CALLS if name in socket.socket.__dict__}
    for name in _SOCKET_CALLS:
        original = getattr(socket.socket, name)

        def watched(self: socket.socket, *args: Any, _original: Any = original, _name: str = name,
                    **kwargs: Any) -> Any:
            if threading.get_ident() != me:
                trained.network_elsewhere += 1
            elif armed.is_set():
                trained.network_in_steps.append(_name)
            return _original(self, *args, **kwargs)

        setattr(socket.socket, name, watched)
    try:
        yield
    finally:
        for name in _SOCKET_CALLS:
            if name in own:
                setattr(socket.socket, name, own[name])
            else:
                delattr(socket.socket, name)


def train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int, *,
          before_step: Callable[[int], None] | None = None) -> Trained:
    """``steps`` optimizer steps on seeded batches; the guard's step() runs in the optimizer's post hook. Returns
    the socket operations made on this thread inside the steps (forward, backward, optimizer step and the guard's
    step boundary) and on the others (``Trained``)."""
    trained, armed = Trained(), threading.Event()
    with _watch_sockets(trained, armed):
        for step in range(steps):
            if before_step is not None:
                before_step(step)
            ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(step))
            armed.set()
            logits = model(ids)
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            armed.clear()
    return trained


# --- the collector -----------------------------------------------------------------------------------------------


def wait_until(predicate: Callable[[], Any], timeout_s: float = 15.0, every_s: float = 0.05) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(every_s)
    return bool(predicate())


class Metrics:
    """A /metrics scrape: ``value(name, **labels)`` sums the samples whose labels include ``labels``."""

    def __init__(self, text: str) -> None:
        from prometheus_client.parser import text_string_to_metric_families

        self.samples = [(s.name, s.labels, s.value) for fam in text_string_to_metric_families(text)
                        for s in fam.samples]

    def value(self, name: str, **labels: str) -> float:
        return sum(v for n, lab, v in self.samples if n == name and labels.items() <= lab.items())


class Collector:
    """A real collector subprocess and an operator's view of it (HTTP API and /metrics)."""

    def __init__(self, settings: Any) -> None:
        self.settings = settings
        testing.migrate(settings)
        self.agent = testing.make_token(settings, "agent", "e2e-agent")
        self.operator = testing.make_token(settings, "operator", "e2e-operator")
        self.proc = testing.start_collector(settings, migrate_first=False)

    @property
    def url(self) -> str:
        return self.proc.url

    def kill(self) -> None:
        """SIGKILL: no graceful shutdown, connections just break."""
        self.proc.process.kill()
        self.proc.process.wait(10)

    def restart(self) -> None:
        self.proc = testing.start_collector(self.settings, port=self.proc.port, migrate_first=False)

    def stop(self) -> None:
        self.proc.stop()

    def api(self, method: str, path: str, **kw: Any) -> httpx.Response:
        headers = {"Authorization": f"Bearer {self.operator}", **kw.pop("headers", {})}
        return httpx.request(method, f"{self.url}/api/v1{path}", headers=headers, timeout=10, **kw)

    def run(self, run_id: str) -> dict[str, Any]:
        r = self.api("GET", f"/runs/{run_id}")
        assert r.status_code == 200, r.text
        return r.json()

    def run_by_name(self, name: str) -> dict[str, Any]:
        runs = self.api("GET", "/runs", params={"limit": 200}).json()["data"]
        (run,) = [r for r in runs if r["name"] == name]
        return run

    def events(self, run_id: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        cursor = None
        while True:
            params: dict[str, Any] = {"limit": 500, **({"cursor": cursor} if cursor else {})}
            page = self.api("GET", f"/runs/{run_id}/events", params=params).json()
            out += page["data"]
            cursor = page.get("next_cursor")
            if not cursor:
                return out

    def metrics(self) -> Metrics:
        """One scrape of /metrics."""
        r = httpx.get(f"{self.url}/metrics", headers={"Authorization": f"Bearer {self.operator}"}, timeout=10)
        assert r.status_code == 200, r.text
        return Metrics(r.text)

    def hang(self) -> None:
        """SIGSTOP: the kernel still accepts connections, but nothing ever answers (a hung collector)."""
        self.proc.process.send_signal(signal.SIGSTOP)

    def set_policy(self, guard: attnchecker.Guard, **fields: Any) -> int:
        """PUT the run's whole policy (defaults + ``fields``) and wait until the agent's transport has it; the guard
        applies it at its next step boundary. Returns the new version."""
        t = guard.transport
        assert wait_until(lambda: t.run_id is not None and t.latest_policy() is not None), "the run never registered"
        body = {k: v for k, v in attnchecker.Policy(**fields).to_wire().items() if k != "version"}
        r = self.api("PUT", f"/runs/{t.run_id}/policy", json=body)
        assert r.status_code == 200, r.text
        version = int(r.json()["version"])
        assert wait_until(lambda: t.latest_policy().version == version, 10.0), "the agent never polled the change"
        return version


@contextmanager
def running_collector(backend: str, directory: Path) -> Iterator[Collector]:
    if testing is None:
        pytest.skip("the collector (attnchecker-server) is not installed")
    directory.mkdir(parents=True, exist_ok=True)
    if backend == "postgres":
        if not testing.postgres_available():
            pytest.skip("PostgreSQL is not reachable on 127.0.0.1:5432 (set ATTNCHECKER_TEST_DATABASE_URL)")
        with testing.postgres_database(prefix="attnchecker_e2e") as url:
            settings = testing.make_settings("postgres", directory, database_url=url, metrics_cache_seconds=0)
            c = Collector(settings)
            try:
                yield c
            finally:
                c.stop()
        return
    c = Collector(testing.make_settings("sqlite", directory, metrics_cache_seconds=0))
    try:
        yield c
    finally:
        c.stop()


def protect_streaming(model: nn.Module, optimizer: torch.optim.Optimizer, url: str, token: str | None, run: str,
                      spool_dir: Path, **kw: Any) -> attnchecker.Guard:
    """protect() as a user streams to a collector, with the test's fast transport settings and 1-step intervals
    (so the stats can be read step by step)."""
    kw = {"stats_interval_steps": 1, "transport_options": FAST, **kw}
    return attnchecker.protect(model, optimizer=optimizer, run=run, collector=url, token=token, spool_dir=spool_dir,
                               **kw)
