"""The architecture contract (``.importlinter``, run by ``lint-imports`` in CI) holds, and bites.

The real tree passes; a copy of the package with one deliberately wrong import of each kind
(an upward import, mlx outside the engine edge, launch reaching into the engine, a cycle
between siblings) fails, naming the
contract it broke. The copy is analysed in place of the installed package through
PYTHONPATH, with the repository's own contract file.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
CONFIG = REPO / ".importlinter"
PACKAGE = REPO / "python" / "plimsoll"


def lint_imports(package_parent: Path) -> subprocess.CompletedProcess[str]:
    exe = Path(sys.executable).with_name("lint-imports")
    if not exe.exists():
        found = shutil.which("lint-imports")
        if found is None:
            pytest.fail("lint-imports is not installed: pip install './python[test]'")
        exe = Path(found)
    env = dict(os.environ, PYTHONPATH=str(package_parent), COLUMNS="200")  # one line a contract
    return subprocess.run([str(exe), str(CONFIG), "--no-cache"], cwd=package_parent, env=env,
                          capture_output=True, text=True, timeout=300)


def copy_package(tmp_path: Path) -> Path:
    shutil.copytree(PACKAGE, tmp_path / "plimsoll",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return tmp_path


def append(path: Path, line: str) -> None:
    path.write_text(path.read_text() + "\n" + line + "\n")


def test_the_real_tree_keeps_every_contract() -> None:
    r = lint_imports(REPO / "python")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Contracts: 5 kept, 0 broken." in r.stdout, r.stdout


@pytest.mark.parametrize(("module", "line", "contract"), [
    ("core/units.py", "from plimsoll.proxy import supervisor  # upward", "Layers"),
    ("probes/linux.py", "from plimsoll.core import policy  # a leaf reads only units",
     "probes is a leaf"),
    ("proxy/app.py", "import mlx.core  # the proxy never loads the engine", "mlx and mlx_lm"),
    ("engine/work.py", "import mlx_lm  # work is the pure contract of the engine",
     "mlx and mlx_lm"),
    ("launch/spawn.py", "from plimsoll.engine import work  # launch's arithmetic is core's",
     "launch imports neither"),
    ("proxy/events.py", "from plimsoll.proxy import app  # app already imports events",
     "No import cycles"),
])
def test_a_deliberately_wrong_import_breaks_its_contract(tmp_path, module, line,
                                                         contract) -> None:
    root = copy_package(tmp_path)
    append(root / "plimsoll" / module, "def _wrong() -> None:\n    " + line)
    r = lint_imports(root)
    assert r.returncode != 0, r.stdout
    summary = r.stdout.split("Contracts:")[0].splitlines()
    assert [ln for ln in summary if ln.startswith(contract) and " BROKEN" in ln], r.stdout
    assert f".{Path(module).stem} " in r.stdout  # the culprit is named
