"""The setuptools hook of the native plane: with POCKETLLM_BUILD_CPP=1, ``pip install --no-build-isolation .``
builds cpp_engine with CMake against the active environment's torch and installs ``pocketllm_cpp`` top-level,
with the ``pocketllm_engine`` executable inside it (``pocketllm_cpp.engine_executable()`` gives its path). The
device backend follows that torch (``cuda`` for a CUDA build of it, else ``cpu``); POCKETLLM_CPP_BACKEND=cpu|cuda
overrides it.
Without it the install is the Python package alone (everything else is configured in pyproject.toml)."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.join(ROOT, "cpp_engine")
BUILD = os.path.join(SOURCE, "build-python")   # shared with `make native`, so rebuilds are incremental


class CMakeBuild(build_ext):
    """Builds the ``pocketllm_cpp`` and ``pocketllm_engine`` targets and places the module, its package file and
    the executable (``pocketllm_cpp/bin/``) in the wheel."""

    def build_extension(self, ext: Extension) -> None:
        import torch

        if not os.path.isfile(os.path.join(BUILD, "CMakeCache.txt")):
            backend = os.environ.get("POCKETLLM_CPP_BACKEND") or ("cuda" if torch.version.cuda else "cpu")
            subprocess.check_call(["cmake", "-S", SOURCE, "-B", BUILD, "-DCMAKE_BUILD_TYPE=Release",
                                   "-DPOCKET_BUILD_PYTHON=ON", f"-DPython3_EXECUTABLE={sys.executable}",
                                   f"-DPOCKET_BACKEND={backend}",
                                   f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}"])
        jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL", "2")
        subprocess.check_call(["cmake", "--build", BUILD, "--target", "pocketllm_cpp", "pocketllm_engine", "-j", jobs])
        built = glob.glob(os.path.join(BUILD, "python", "pocketllm_cpp", "_native*"))
        if not built:
            raise RuntimeError("the CMake build produced no pocketllm_cpp module")
        target = self.get_ext_fullpath(ext.name)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.copyfile(built[0], target)
        shutil.copyfile(os.path.join(SOURCE, "python", "pocketllm_cpp", "__init__.py"),
                        os.path.join(os.path.dirname(target), "__init__.py"))
        bin_dir = os.path.join(os.path.dirname(target), "bin")
        os.makedirs(bin_dir, exist_ok=True)
        shutil.copy2(os.path.join(BUILD, "pocketllm_engine"), os.path.join(bin_dir, "pocketllm_engine"))


if os.environ.get("POCKETLLM_BUILD_CPP") == "1":
    setup(ext_modules=[Extension("pocketllm_cpp._native", sources=[])], cmdclass={"build_ext": CMakeBuild})
else:
    setup()
