"""The pure tier (python/tests/pure_tier.py) holds, and bites.

Every file that declares pure tests collects under ``-m pure`` with mlx and processes blocked;
a scratch tree with one mlx import and one process start in pure tests fails there by name,
and a file that declares nothing is not even read.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
from pure_tier import ImpureError, hold, pure_only

pytestmark = pytest.mark.pure

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parents[1]


def test_the_hold_refuses_every_way_of_starting_a_process():
    with pytest.MonkeyPatch.context() as mp:
        hold(mp)
        for start in (lambda: subprocess.run(["true"], check=False), lambda: os.system("true"),
                      lambda: os.posix_spawn("/bin/true", ["true"], {})):
            with pytest.raises(ImpureError, match="started a process"):
                start()


def test_the_hold_refuses_mlx_even_when_it_was_imported_already():
    with pytest.MonkeyPatch.context() as mp:
        hold(mp)
        for name in ("mlx", "mlx.core", "mlx_lm"):
            with pytest.raises(ImpureError, match="imported mlx"):
                importlib.import_module(name)


@pytest.mark.parametrize("expression, alone", [
    ("pure", True), ("pure and not slow", True), ("(pure)", True), ("pure or slow", False),
    ("not pure", False), ("slow", False), ("", False), ("not impure and pure", True)])
def test_only_an_expression_that_selects_pure_tests_alone_holds_the_session(expression, alone):
    assert pure_only(expression) is alone


def test_a_module_mark_reaches_its_tests(request):
    assert request.node.get_closest_marker("pure") is not None


@pytest.mark.impure
def test_impure_overrides_the_module_mark_and_every_declared_file_collects(request):
    assert request.node.get_closest_marker("pure") is None
    r = subprocess.run([sys.executable, "-m", "pytest", "-m", "pure", "--collect-only", "-q",
                        "-p", "no:cacheprovider", str(TESTS)],
                       cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert " deselected" in r.stdout.splitlines()[-1]  # impure tests were collected, left out


SCRATCH = {
    "test_mlx.py": "import pytest\nimport mlx.core\n\npytestmark = pytest.mark.pure\n\n\n"
                   "def test_nothing():\n    pass\n",
    "test_spawns.py": "import subprocess\nimport pytest\n\n\n@pytest.mark.pure\n"
                      "def test_spawns():\n    subprocess.run(['true'])\n\n\n"
                      "def test_not_pure():\n    subprocess.run(['true'])\n",
    "test_undeclared.py": "import mlx.core\n\n\ndef test_nothing():\n    pass\n",
}


def scratch_run(tmp_path: Path, *args: str) -> str:
    """pytest with the pure tier's plugin alone over the SCRATCH files; its output."""
    for name, text in SCRATCH.items():
        (tmp_path / name).write_text(text)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(TESTS), *filter(None, [os.environ.get("PYTHONPATH")])]))
    r = subprocess.run([sys.executable, "-m", "pytest", "-p", "pure_tier", "-q", "-p",
                        "no:cacheprovider", *args, str(tmp_path)],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
                       check=False)
    return r.stdout + r.stderr


@pytest.mark.impure
def test_under_m_pure_a_pure_test_that_imports_mlx_or_starts_a_process_fails_by_name(tmp_path):
    out = scratch_run(tmp_path, "-m", "pure", "--continue-on-collection-errors")
    assert "ImpureError: a pure test imported mlx" in out  # test_mlx.py fails to collect
    assert "ImpureError: a pure test started a process" in out  # test_spawns.py::test_spawns
    assert "test_undeclared" not in out  # never read
    assert "1 failed, 1 deselected, 1 error" in out, out[-3000:]


@pytest.mark.impure
def test_in_a_full_run_a_pure_test_that_starts_a_process_fails_and_the_rest_run(tmp_path):
    out = scratch_run(tmp_path)
    assert "ImpureError: a pure test started a process" in out
    assert "1 failed, 3 passed" in out, out[-3000:]
