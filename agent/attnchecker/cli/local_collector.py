"""Start (or reuse) a collector for the demo: `attnchecker-server serve` on SQLite, as a separate process.

The agent never imports the server package; it runs the server's own command line, as an operator would.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx


@dataclass(frozen=True)
class LocalCollector:
    url: str
    pid: int
    data_dir: Path
    agent_token: str
    operator_token: str


def _server_command() -> list[str]:
    exe = Path(sys.executable).with_name("attnchecker-server")
    if exe.exists():
        return [str(exe)]
    found = shutil.which("attnchecker-server")
    if found is None:
        raise RuntimeError("attnchecker-server is not installed: `pip install -e server` (make demo does it)")
    return [found]


def _env(data_dir: Path) -> dict[str, str]:
    return {**os.environ, "ATTNCHECKER_DATA_DIR": str(data_dir), "ATTNCHECKER_OPEN_READS": "true"}


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/readyz", timeout=1.0).status_code == 200
    except httpx.HTTPError:
        return False


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _token(data_dir: Path, role: str, name: str) -> str:
    out = subprocess.run([*_server_command(), "token", "create", "--role", role, "--name", name],
                         env=_env(data_dir), check=True, capture_output=True, text=True)
    return out.stdout.strip().splitlines()[0]


def start_local_collector(
    data_dir: str | os.PathLike[str], *, port: int = 8000, timeout_s: float = 60.0
) -> LocalCollector:
    """Reuse the collector a previous demo left running in `data_dir`, or migrate and start a new one."""
    data = Path(data_dir).resolve()
    data.mkdir(parents=True, exist_ok=True)
    state_file = data / "collector.json"
    if state_file.exists():
        state = json.loads(state_file.read_text())
        if _ready(state["url"]):
            return LocalCollector(state["url"], state["pid"], data, state["agent_token"], state["operator_token"])
    cmd = _server_command()
    subprocess.run([*cmd, "migrate"], env=_env(data), check=True, capture_output=True, text=True)
    # Demo tokens live in the demo's own data dir (mode 0600); production tokens are created by operators.
    agent_token = _token(data, "agent", "demo-agent")
    operator_token = _token(data, "operator", "demo-operator")
    if not _port_free(port):
        port = _free_port()
    log = open(data / "collector.log", "ab")
    proc = subprocess.Popen([*cmd, "serve", "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"],
                            env=_env(data), stdout=log, stderr=log, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while not _ready(url):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the collector did not start; see {data / 'collector.log'}")
        time.sleep(0.2)
    state_file.write_text(json.dumps({"url": url, "pid": proc.pid, "agent_token": agent_token,
                                      "operator_token": operator_token}))
    state_file.chmod(0o600)
    return LocalCollector(url, proc.pid, data, agent_token, operator_token)
