"""A plain ``pip install`` of the built wheel carries its native kernels (issue 33): every C source is in the wheel, the
kernels are compiled when the wheel is built (agent/setup.py) in portable variants, and in a fresh virtualenv, without
the source tree and without any C compiler, the native kernels load from the wheel and the native attention pass runs.
Where no kernel can be had, the warning says what is lost and how to get it."""
from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from attnchecker.kernels import build

AGENT = Path(__file__).resolve().parents[2] / "agent"
pytestmark = pytest.mark.slow

_CHECK = """
import json, shutil, sys, torch
import attnchecker
from attnchecker import Policy
from attnchecker.kernels import build, fused_attention, fused_pass, row_verify

assert shutil.which("cc") is None and shutil.which("gcc") is None
available = {m.__name__.rsplit(".", 1)[1]: m.available() for m in (fused_attention, fused_pass, row_verify)}

class Attention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv, self.proj = torch.nn.Linear(32, 96), torch.nn.Linear(32, 32)
    def forward(self, x):
        q, k, v = (t.view(2, 64, 4, 8).transpose(1, 2) for t in self.qkv(x).split(32, -1))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(out.transpose(1, 2).reshape(2, 64, 32))

model = Attention()
with attnchecker.protect(model, policy=Policy.full()) as guard:
    model(torch.randn(2, 64, 32)).sum().backward()
    backends = sorted({name for _, name in guard.coverage.backends})
print(json.dumps({"file": attnchecker.__file__, "available": available, "backends": backends,
                  "loaded": {n: str(build.loaded_from(n)) for n in build.SOURCES}}))
"""


_TRITON_CHECK = """
import json, torch
import triton.runtime.interpreter as interpreter
import attnchecker
from attnchecker import Policy
from attnchecker.inject import Fault, FaultPlan
from attnchecker.kernels import triton_attention, triton_attention_tiles, triton_checks, triton_given_check

launches = {}
run = interpreter.GridExecutor.__call__
def counted(self, *args, **kwargs):
    launches[self.fn.__name__] = launches.get(self.fn.__name__, 0) + 1
    return run(self, *args, **kwargs)
interpreter.GridExecutor.__call__ = counted

class Attention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv, self.proj = torch.nn.Linear(32, 96), torch.nn.Linear(32, 32)
    def forward(self, x):
        q, k, v = (t.view(1, 64, 2, 16).transpose(1, 2) for t in self.qkv(x).split(32, -1))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(out.transpose(1, 2).reshape(1, 64, 32))

torch.manual_seed(0)
model = Attention().to(torch.bfloat16)
x = torch.randn(1, 64, 32).to(torch.bfloat16)
plan = FaultPlan([Fault(op="scores", layer=0, step=1, kind="inf", seed=1)])
with attnchecker.protect(model, policy=Policy.full(), faults=plan) as guard:
    per_step = []
    for _ in range(2):
        before = dict(launches)
        out = model(x)
        guard.step()
        per_step.append({n: c - before.get(n, 0) for n, c in launches.items() if c > before.get(n, 0)})
    detections = [(d.op, d.step, d.action) for d in guard.detections]
    backends = sorted({name for _, name in guard.coverage.backends})
print(json.dumps({"files": [m.__file__ for m in (triton_attention, triton_attention_tiles, triton_checks,
                                                  triton_given_check)],
                  "per_step": per_step, "detections": detections, "backends": backends,
                  "finite": bool(torch.isfinite(out).all())}))
"""


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel, built once from a copy of agent/ (a build writes build/ and egg-info beside its sources)."""
    root = tmp_path_factory.mktemp("wheel")
    src = root / "agent"
    shutil.copytree(AGENT, src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__", "prebuilt"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(root / "dist"), str(src)], check=True, capture_output=True, timeout=300)
    (found,) = (root / "dist").glob("attnchecker-*.whl")
    return found


@pytest.fixture(scope="module")
def fresh_venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A new virtualenv with the wheel installed by pip; torch and httpx from this environment's site-packages by a
    .pth line (processed as a plain path: the editable attnchecker this environment has stays out)."""
    root = tmp_path_factory.mktemp("venv")
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", "-q",
                    str(wheel)], check=True, capture_output=True, timeout=300)
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    Path(site, "_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return python


def test_the_wheel_carries_every_kernel_source_and_its_prebuilt_variants(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {f"attnchecker/kernels/{name}" for name in build.SOURCES} <= names
    prebuilt = {n.rsplit("/", 1)[1] for n in names if n.startswith("attnchecker/kernels/prebuilt/")}
    assert prebuilt == {f"{Path(s).stem}-{v}.so" for s in build.SOURCES for v in build.variants()}
    # Shared libraries loaded with ctypes: any Python 3, this platform.
    assert wheel.name.startswith("attnchecker-0.1.0-py3-none-") and "any" not in wheel.name


def test_a_fresh_venv_without_a_compiler_gets_the_native_kernels_from_the_wheel(fresh_venv: Path,
                                                                                 tmp_path: Path) -> None:
    empty = tmp_path / "bin"
    empty.mkdir()
    cache = tmp_path / "cache"
    env = {"PATH": str(empty), "CC": "/nonexistent/cc", "HOME": str(tmp_path), "ATTNCHECKER_CACHE_DIR": str(cache),
           "OMP_NUM_THREADS": "1"}
    done = subprocess.run([str(fresh_venv), "-c", _CHECK], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout.strip().splitlines()[-1])
    venv = fresh_venv.parent.parent
    assert Path(got["file"]).is_relative_to(venv)  # the installed package, not the checkout
    assert got["available"] == {"fused_attention": True, "fused_pass": True, "row_verify": True}
    assert got["backends"] == ["native"]  # the native attention pass ran the checked calls
    best = build.runnable_variants()[0]  # this CPU's best: x86-64-v4 on an AVX-512 machine
    for name, path in got["loaded"].items():
        assert Path(path).is_relative_to(venv / "lib"), (name, path)
        assert Path(path).name == f"{Path(name).stem}-{best}.so"
    assert not cache.exists()  # nothing was compiled
    assert "not available" not in done.stderr, done.stderr


def test_the_wheel_carries_every_module_of_the_package(wheel: Path) -> None:
    """Every module of the source tree is in the wheel: the Triton kernels' too, which only a GPU (or the interpreter)
    imports, so a run on CPU would not notice one missing."""
    names = set(zipfile.ZipFile(wheel).namelist())
    tree = {str(p.relative_to(AGENT)) for p in (AGENT / "attnchecker").rglob("*.py") if "__pycache__" not in p.parts}
    assert tree and tree <= names, sorted(tree - names)


def test_an_installed_wheel_runs_the_triton_attention_over_the_vendor_forward_and_in_its_kernel(
        fresh_venv: Path, tmp_path: Path) -> None:
    """From the installed wheel, under Triton's interpreter (ATTNCHECKER_ATTENTION=triton, the route a GPU takes): a
    clean bf16 call under Policy.full() is checked over the vendor's forward (v·[e, w], the identities, the repair
    launch), and INF planned in the next step's scores runs the call in our checked kernel, which corrects it. Triton
    reads each kernel's source from its file, so the kernels must be installed as source."""
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "1",
           "ATTNCHECKER_ATTENTION": "triton"}
    done = subprocess.run([str(fresh_venv), "-c", _TRITON_CHECK], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=300, check=False)
    if done.returncode != 0 and "No module named 'triton'" in done.stderr:
        pytest.skip("triton is not installed")
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    venv = fresh_venv.parent.parent
    assert all(Path(f).is_relative_to(venv) for f in got["files"]), got["files"]
    assert got["backends"] == ["triton"]
    assert got["per_step"][0] == {"_value_sums": 1, "_check_given": 1, "_attention": 1}
    assert got["per_step"][1]["_attention"] == 2  # our kernel's first pass and its repair
    (op, step, action), = got["detections"]
    assert (op, step) == ("scores", 1) and action in ("corrected", "recomputed"), got["detections"]
    assert got["finite"]


def test_no_kernel_to_be_had_is_a_warning_that_says_what_is_lost_and_how_to_get_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(build, "PREBUILT_DIR", tmp_path / "none")
    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv(build.NATIVE_ENV, raising=False)
    with caplog.at_level(logging.WARNING, "attnchecker"):
        fn = build.load(build.source("row_verify.c"), "attnchecker_verify_rows", "row checks evaluate their bound "
                        "eagerly")
    assert fn is None
    (message,) = [r.getMessage() for r in caplog.records]
    assert "row_verify.c is not available" in message
    assert "row checks evaluate their bound eagerly" in message  # what is lost
    assert "install attnchecker from a wheel built for this platform" in message  # how to get it
    assert "C compiler" in message and f"{build.NATIVE_ENV}=0" in message
