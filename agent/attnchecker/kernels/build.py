"""Native kernels of the CPU fast paths (fused_pass.c, fused_attention.c): compiled on first use with the system C
compiler (``cc``, or ``$CC``) into a cache directory (``$ATTNCHECKER_CACHE_DIR``, default ``~/.cache/attnchecker``),
keyed by the source, the flags and the CPU, and loaded with ctypes: no Python headers, no build step at install.
Where there is no compiler, the build fails, or ``ATTNCHECKER_NATIVE=0``, ``load`` returns None (logged once per
kernel) and each caller takes its PyTorch path.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["NATIVE_ENV", "load", "ptr", "source"]

log = logging.getLogger("attnchecker")

NATIVE_ENV = "ATTNCHECKER_NATIVE"
"""Set to 0 to keep every check on its PyTorch path (to compare the two, or where a compiler must not run)."""
# No -ffast-math: it implies -ffinite-math-only, under which the compiler may drop the NaN and INF a check must see.
# -fassociative-math (with the two flags it requires) lets the sums over a row run in vector lanes.
_FLAGS = ("-O3", "-march=native", "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math", "-fPIC",
          "-shared", "-std=c99")


def load(source: Path, symbol: str, what: str) -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """``symbol`` of ``source`` built (once per source, flags and CPU) and loaded; None, with one warning that says
    what the caller does instead (``what``), where it cannot be."""
    if os.environ.get(NATIVE_ENV, "1").strip() == "0":
        return None
    try:
        so = _build(source)
        return getattr(ctypes.CDLL(str(so)), symbol)
    except (OSError, subprocess.SubprocessError, ValueError, AttributeError) as e:
        log.warning("attnchecker: the native kernel %s is not available (%s); %s", source.name, e, what)
        return None


def source(name: str) -> Path:
    """The path of one of the C sources that ship beside this module."""
    return Path(__file__).with_name(name)


def ptr(t: Any) -> ctypes.c_void_p | None:
    """A tensor's data pointer as a kernel argument (None: a NULL the kernel reads as "not given")."""
    return None if t is None else ctypes.c_void_p(t.data_ptr())


def _build(source_path: Path) -> Path:
    source = source_path.read_bytes()
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise ValueError("no C compiler (cc, gcc or $CC) on PATH")
    key = hashlib.sha256(b"\0".join([source, " ".join(_FLAGS).encode(), cc.encode(), _cpu().encode()])).hexdigest()
    so = _cache_dir() / f"{source_path.stem}-{key[:16]}.so"
    if so.exists():
        return so
    so.parent.mkdir(parents=True, exist_ok=True)
    # Built under a name of its own, then renamed: ranks of one job building at once each install a whole file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=so.parent)
    os.close(fd)
    try:
        done = subprocess.run([cc, *_FLAGS, "-o", tmp, str(source_path), "-lm"], capture_output=True, text=True,
                              timeout=120, check=False)
        if done.returncode != 0:
            raise ValueError(f"{cc} failed: {done.stderr.strip()[:500]}")
        os.replace(tmp, so)
    finally:
        Path(tmp).unlink(missing_ok=True)
    return so


def _cache_dir() -> Path:
    base = os.environ.get("ATTNCHECKER_CACHE_DIR")
    return (Path(base) if base else Path.home() / ".cache" / "attnchecker") / "native"


def _cpu() -> str:
    """What -march=native compiled for: a library built on one CPU model may not run on another (a cache directory
    shared across a cluster's nodes)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    lines = [ln for ln in info.splitlines() if ln.startswith(("model name", "flags", "Features", "CPU part"))]
    return "\n".join(sorted(set(lines)))
