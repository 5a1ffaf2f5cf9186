"""The setuptools hook of the native plane: ``POCKETLLM_BUILD_CPP=1`` builds a wheel holding ``pocketllm_cpp`` and
the ``pocketllm_engine`` executable; installed elsewhere, the module names the executable, which serves a request
of the harness protocol with a tiny Qwen3 checkpoint."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_wheel_installs_the_module_and_the_executable(native, tiny_checkpoint, tmp_path):
    env = {**os.environ, "POCKETLLM_BUILD_CPP": "1"}
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "-q", "-w",
                    str(tmp_path / "wheel"), ROOT], check=True, env=env, capture_output=True, timeout=900)
    wheel = glob.glob(str(tmp_path / "wheel" / "*.whl"))[0]
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q", "--target", str(site),
                    wheel], check=True, capture_output=True, timeout=300)
    probe = subprocess.run([sys.executable, "-c", "import pocketllm_cpp; print(pocketllm_cpp.backend); "
                            "print(pocketllm_cpp.engine_executable())"],
                           env={**os.environ, "PYTHONPATH": str(site)}, capture_output=True, text=True, check=True,
                           cwd=str(tmp_path))
    backend, executable = probe.stdout.split()
    assert backend == "cpu"
    assert executable == str(site / "pocketllm_cpp" / "bin" / "pocketllm_engine")
    request = {"op": "generate", "id": 1, "prompt": "Once upon a time", "n": 4, "temp": 0}
    served = subprocess.run([executable, "--model", tiny_checkpoint("qwen3")], input=json.dumps(request) + "\n",
                            capture_output=True, text=True, timeout=120)
    replies = [json.loads(line) for line in served.stdout.splitlines() if line.strip()]
    assert served.returncode == 0, served.stderr
    assert replies and replies[-1].get("id") == 1 and replies[-1].get("finish") == "budget", replies
