"""``plimsoll doctor`` says which MLX a worker would get: Metal on macOS, or what to fix."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from plimsoll.reliability.doctor import Line, MlxView, mlx_lines

pytestmark = pytest.mark.pure


def test_macos_with_metal_is_ok():
    assert mlx_lines(MlxView("0.32.4", True, "gpu"), "darwin") == [
        Line("ok", "MLX 0.32.4: default device gpu (Metal GPU)")]


def test_macos_without_metal_is_an_error_that_names_the_cause():
    (line,) = mlx_lines(MlxView("0.30.0", False, "cpu"), "darwin")
    assert line.level == "error"
    assert "no Metal GPU" in line.text and "nixpkgs' mlx is built with Metal off" in line.text


@pytest.mark.parametrize("platform, level", [("darwin", "error"), ("linux", "warn")])
def test_no_mlx(platform, level):
    (line,) = mlx_lines(MlxView(error="ModuleNotFoundError: No module named 'mlx'"), platform)
    assert line.level == level and "workers cannot start" in line.text


def test_linux_cpu_is_ok():
    assert mlx_lines(MlxView("0.32.4", False, "cpu"), "linux")[0].level == "ok"


@pytest.mark.impure
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="this host's MLX: Linux CPU")
def test_the_doctor_reads_this_hosts_mlx():
    done = subprocess.run([sys.executable, "-m", "plimsoll.cli", "doctor", "--json"],
                          capture_output=True, text=True, timeout=120)
    lines = json.loads(done.stdout)["lines"]
    import mlx.core as mx  # the test may: it checks the doctor against the real thing

    (line,) = [ln for ln in lines if ln["text"].startswith("MLX")]
    assert line == {"level": "ok", "text": f"MLX {mx.__version__}: default device cpu (no Metal)"}
