"""Native kernels of the CPU fast paths (fused_pass.c, fused_attention.c, row_verify.c) and how they are built and
loaded (ctypes: no Python headers, no Python ABI).

Two ways to a kernel:
- Prebuilt: a wheel carries each kernel compiled when the package was built (agent/setup.py runs
  ``build_prebuilt``), in portable variants, not ``-march=native`` (a wheel runs on other CPUs than the one that built
  it): on x86-64 one for x86-64-v4 (AVX-512: Skylake-SP, Ice Lake, Sapphire Rapids, Zen 4 and newer), one for
  x86-64-v3 (AVX2 and FMA: Haswell, Zen and newer) and one for the x86-64 baseline (SSE2); on aarch64 one for
  armv8-a. ``load`` takes the best variant this CPU runs. No compiler is needed where it is installed.
- Built at first use with the system C compiler (``cc``, or ``$CC``) and ``-march=native``, into a cache directory
  (``$ATTNCHECKER_CACHE_DIR``, default ``~/.cache/attnchecker``) keyed by the source, the flags and the CPU: a source
  checkout, or an install without prebuilt kernels.

``ATTNCHECKER_NATIVE``: unset or ``1``, the prebuilt kernel if there is one for this CPU, else one built here;
``native``, always built here with ``-march=native``; a variant's name (``x86-64-v4``, ``x86-64-v3``, ``x86-64``,
``armv8-a``), that prebuilt variant only (benchmarks compare them); ``0``, none. Where no kernel can be had, ``load``
returns None with one warning per kernel that says what is lost and how to get it, and each caller takes its PyTorch
path.

This module imports only the standard library: agent/setup.py loads it by path to build the wheel's kernels.
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
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["NATIVE_ENV", "PREBUILT_DIR", "SOURCES", "build_prebuilt", "load", "loaded_from", "prebuilt", "ptr",
           "runnable_variants", "source", "variants"]

log = logging.getLogger("attnchecker")

NATIVE_ENV = "ATTNCHECKER_NATIVE"
"""0: no native kernel; native: built here with -march=native; a variant's name: that prebuilt variant; else auto."""
SOURCES = ("fused_pass.c", "fused_attention.c", "row_verify.c")
PREBUILT_DIR = Path(__file__).with_name("prebuilt")
"""Where a wheel's kernels are, one ``<stem>-<variant>.so`` each."""
# No -ffast-math: it implies -ffinite-math-only, under which the compiler may drop the NaN and INF a check must see.
# -fassociative-math (with the two flags it requires) lets the sums over a row run in vector lanes.
_COMMON = ("-O3", "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math", "-fPIC", "-shared", "-std=c99")
_FLAGS = ("-O3", "-march=native", *_COMMON[1:])
_SOURCE_FLAGS: dict[str, tuple[str, ...]] = {
    # Multiply-adds fused (one rounding each instead of two, never a larger error): the sums of fused_pass.c, whose
    # rows are in cache when it sums them, ran ~10-15 % faster so. Not row_verify.c, whose bounds follow
    # tolerance.py's operations one by one (the tests hold the two to 2e-6).
    "fused_pass.c": ("-ffp-contract=fast",),
}
# Per machine, best first: (variant, its -march flags, the /proc/cpuinfo flags a CPU needs to run it). x86-64-v3 is
# psABI's level 3 (AVX, AVX2, BMI1/2, F16C, FMA, LZCNT, MOVBE, XSAVE), x86-64-v4 adds AVX-512 F/BW/CD/DQ/VL;
# -mtune=generic keeps the schedule neutral.
_VARIANTS: dict[str, tuple[tuple[str, tuple[str, ...], frozenset[str]], ...]] = {
    "x86_64": (
        ("x86-64-v4", ("-march=x86-64-v4", "-mtune=generic"),
         frozenset({"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave",
                    "avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"})),
        ("x86-64-v3", ("-march=x86-64-v3", "-mtune=generic"),
         frozenset({"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"})),
        ("x86-64", ("-march=x86-64", "-mtune=generic"), frozenset()),
    ),
    "aarch64": (("armv8-a", ("-march=armv8-a",), frozenset()),),
}
_MACHINES = {"amd64": "x86_64", "x86_64": "x86_64", "aarch64": "aarch64", "arm64": "aarch64"}
_loaded: dict[str, Path] = {}


def load(source: Path, symbol: str, what: str) -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """``symbol`` of ``source``'s kernel, prebuilt or built here (module doc); None, with one warning that says what
    the caller does instead (``what``) and how to get the kernel, where there is none."""
    mode = os.environ.get(NATIVE_ENV, "1").strip().lower() or "1"
    if mode == "0":
        return None
    try:
        so = _library(source, mode)
        fn = getattr(ctypes.CDLL(str(so)), symbol)
    except (OSError, subprocess.SubprocessError, ValueError, AttributeError) as e:
        log.warning("attnchecker: the native kernel %s is not available (%s): %s. To have it, install attnchecker "
                    "from a wheel built for this platform (its kernels are prebuilt) or give this machine a C "
                    "compiler (cc, or $CC) to build it at first use; %s=0 keeps every check on its PyTorch path "
                    "without this warning", source.name, e, what, NATIVE_ENV)
        return None
    _loaded[source.name] = so
    return fn


def loaded_from(name: str) -> Path | None:
    """The library file ``load`` took kernel source ``name`` from (None before, or when there was none)."""
    return _loaded.get(name)


def _library(source_path: Path, mode: str) -> Path:
    if mode == "native":
        return _build(source_path)
    if mode not in ("1", "auto"):
        so = PREBUILT_DIR / f"{source_path.stem}-{mode}.so"
        if mode not in variants() or not so.exists():
            raise ValueError(f"{NATIVE_ENV}={mode}: no prebuilt variant {mode!r} here (this machine's: "
                             f"{', '.join(variants()) or 'none'}; or 1, native, 0)")
        return so
    found = prebuilt(source_path)
    return found if found is not None else _build(source_path)


def prebuilt(source_path: Path) -> Path | None:
    """The wheel's kernel for ``source_path`` in the best variant this CPU runs, or None (a source checkout)."""
    for name in runnable_variants():
        so = PREBUILT_DIR / f"{source_path.stem}-{name}.so"
        if so.exists():
            return so
    return None


def runnable_variants() -> tuple[str, ...]:
    """The variants of this machine's architecture this CPU runs, best first."""
    flags = _cpu_flags()
    return tuple(name for name, _, needs in _VARIANTS.get(_machine(), ()) if needs <= flags)


def variants() -> tuple[str, ...]:
    """The prebuilt variants of this machine's architecture, best first."""
    return tuple(name for name, _, _ in _VARIANTS.get(_machine(), ()))


def build_prebuilt(dest: Path, cc: str | None = None, sources: Sequence[Path] | None = None) -> list[Path]:
    """Compile every kernel in every variant of this machine's architecture into ``dest`` (agent/setup.py, when the
    wheel is built). Raises ValueError when there is no compiler or a build fails: a wheel without its kernels would
    lose the native pass wherever it is installed."""
    machine = _machine()
    if machine not in _VARIANTS:
        raise ValueError(f"no portable kernel variants are defined for {platform.machine()!r}")
    cc = cc or _compiler()
    dest.mkdir(parents=True, exist_ok=True)
    built = []
    for src in sources or [source(name) for name in SOURCES]:
        for name, march, _ in _VARIANTS[machine]:
            out = dest / f"{src.stem}-{name}.so"
            _compile(cc, src, out, (_COMMON[0], *march, *_COMMON[1:], *_SOURCE_FLAGS.get(src.name, ())))
            built.append(out)
    return built


def source(name: str) -> Path:
    """The path of one of the C sources that ship beside this module."""
    return Path(__file__).with_name(name)


def ptr(t: Any) -> ctypes.c_void_p | None:
    """A tensor's data pointer as a kernel argument (None: a NULL the kernel reads as "not given")."""
    return None if t is None else ctypes.c_void_p(t.data_ptr())


def _compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise ValueError("no C compiler (cc, gcc or $CC) on PATH")
    return cc


def _compile(cc: str, src: Path, out: Path, flags: Sequence[str]) -> None:
    """src compiled with flags to out, under a name of its own and then renamed: ranks of one job building at once
    each install a whole file."""
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        done = subprocess.run([cc, *flags, "-o", tmp, str(src), "-lm"], capture_output=True, text=True, timeout=120,
                              check=False)
        if done.returncode != 0:
            raise ValueError(f"{cc} failed: {done.stderr.strip()[:500]}")
        os.replace(tmp, out)
    finally:
        Path(tmp).unlink(missing_ok=True)


def _build(source_path: Path) -> Path:
    source = source_path.read_bytes()
    cc = _compiler()
    flags = (*_FLAGS, *_SOURCE_FLAGS.get(source_path.name, ()))
    key = hashlib.sha256(b"\0".join([source, " ".join(flags).encode(), cc.encode(), _cpu().encode()])).hexdigest()
    so = _cache_dir() / f"{source_path.stem}-{key[:16]}.so"
    if so.exists():
        return so
    so.parent.mkdir(parents=True, exist_ok=True)
    _compile(cc, source_path, so, flags)
    return so


def _cache_dir() -> Path:
    base = os.environ.get("ATTNCHECKER_CACHE_DIR")
    return (Path(base) if base else Path.home() / ".cache" / "attnchecker") / "native"


def _machine() -> str:
    return _MACHINES.get(platform.machine().lower(), platform.machine().lower())


def _cpu_info() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def _cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (Linux /proc/cpuinfo; empty elsewhere, where only the baseline variant is taken)."""
    for line in _cpu_info().splitlines():
        if line.startswith(("flags", "Features")):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def _cpu() -> str:
    """What -march=native compiled for: a library built on one CPU model may not run on another (a cache directory
    shared across a cluster's nodes)."""
    info = _cpu_info()
    if not info:
        return platform.processor() or platform.machine()
    lines = [ln for ln in info.splitlines() if ln.startswith(("model name", "flags", "Features", "CPU part"))]
    return "\n".join(sorted(set(lines)))
