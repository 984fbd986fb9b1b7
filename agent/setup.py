"""The wheel's native kernels: compiled when the package is built, so that a training image without a C compiler
still gets the native pass (attnchecker/kernels/build.py says which variants, and how ``load`` picks one). The wheel
is then tagged for the platform (py3-none-<platform>): the kernels are plain shared libraries, loaded with ctypes,
independent of the Python version. An editable install builds nothing: a source checkout compiles each kernel at
first use with -march=native. Everything else is in pyproject.toml."""
from __future__ import annotations

import importlib.util
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_py import build_py

_BUILD = Path(__file__).parent / "attnchecker" / "kernels" / "build.py"


def _kernels_module():
    # By path: importing the package would import torch, which a build environment need not have.
    spec = importlib.util.spec_from_file_location("_attnchecker_kernel_build", _BUILD)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildPyWithKernels(build_py):
    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return
        kernels = _kernels_module()
        sources = [_BUILD.with_name(name) for name in kernels.SOURCES]
        dest = Path(self.build_lib) / "attnchecker" / "kernels" / kernels.PREBUILT_DIR.name
        for so in kernels.build_prebuilt(dest, sources=sources):
            self.announce(f"built native kernel {so.name}", level=2)


class WithKernels(Distribution):
    def has_ext_modules(self) -> bool:
        # Binary content: the wheel goes to platlib and is tagged for the platform (PlatformWheel).
        return True


class PlatformWheel(bdist_wheel):
    def get_tag(self) -> tuple[str, str, str]:
        _, _, plat = super().get_tag()
        return "py3", "none", plat


setup(distclass=WithKernels, cmdclass={"build_py": BuildPyWithKernels, "bdist_wheel": PlatformWheel})
