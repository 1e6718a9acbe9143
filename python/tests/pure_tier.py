"""The pure tier: tests that import no mlx and start no process, held to it while they run.

A module joins with ``pytestmark = pytest.mark.pure``, its tests that are not pure marked
``@pytest.mark.impure``; one test alone joins with ``@pytest.mark.pure``.
Under ``pytest -m pure`` only the files that say so are collected, and for the whole session
mlx and mlx_lm cannot be imported and every way of starting a process (subprocess, os.fork,
os.posix_spawn, os.system, multiprocessing's spawn) raises :class:`ImpureError`: a pure module
that imports mlx, directly or through the package, fails to collect, and a pure test or fixture
that starts a process fails. In a full run the same blocks hold around each pure test, with
mlx's modules hidden from ``sys.modules`` meanwhile, so a lazy mlx import or a process started
by the test fails there too.
"""

from __future__ import annotations

import importlib.abc
import itertools
import multiprocessing.util
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from _pytest.mark.expression import Expression

BLOCKED = ("mlx", "mlx_lm")
PURE_ONLY = pytest.StashKey[bool]()
MARK = "pytest.mark.pure"  # how a file declares pure tests; other files are not read under -m pure

# Every call that starts a process ends in one of these; os.popen, os.spawn*, pty.fork and
# asyncio's subprocesses go through them.
PROCESS_STARTERS = [(subprocess.Popen, "_execute_child"), (os, "fork"), (os, "forkpty"),
                    (os, "posix_spawn"), (os, "posix_spawnp"), (os, "system"),
                    (multiprocessing.util, "spawnv_passfds")]


class ImpureError(BaseException):
    """A pure test reached for mlx or a process. Not an ``Exception``: a test's ``except
    Exception`` or ``except OSError`` (a missing tool, then skip) must not swallow it."""


class _BlockMlx(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ImpureError(f"a pure test imported {name}")
        return None


def _refuse(what: str):
    def refuse(*args, **kwargs):
        raise ImpureError(f"a pure test started a process ({what})")
    return refuse


def hold(mp: pytest.MonkeyPatch) -> None:
    """Block mlx imports and process starts until ``mp`` is undone."""
    for name in [m for m in sys.modules if m.partition(".")[0] in BLOCKED]:
        mp.delitem(sys.modules, name)
    mp.setattr(sys, "meta_path", [_BlockMlx(), *sys.meta_path])
    for owner, attr in PROCESS_STARTERS:
        if hasattr(owner, attr):
            mp.setattr(owner, attr, _refuse(f"{getattr(owner, '__name__', owner)}.{attr}"))


def pure_only(markexpr: str) -> bool:
    """Whether ``-m markexpr`` selects pure tests alone: it is false for a test without the
    ``pure`` marker whatever other markers that test has."""
    names = set(re.findall(r"[A-Za-z_]\w*", markexpr)) - {"and", "or", "not"}
    if "pure" not in names:
        return False
    expression = Expression.compile(markexpr)
    others = sorted(names - {"pure"})
    return not any(expression.evaluate(_having(on)) for n in range(len(others) + 1)
                   for on in itertools.combinations(others, n))


def _having(markers: tuple[str, ...]):
    return lambda name, /, **kwargs: name in markers


MARKERS = {
    "pure": "imports no mlx and starts no process; held to it (python/tests/pure_tier.py)",
    "impure": "in a module marked pure: this test is not (it starts a process or needs mlx)",
}


def pytest_configure(config: pytest.Config) -> None:
    # pytest.ini names these too; here they also hold for runs without it (the Nix check).
    registered = {line.partition(":")[0] for line in config.getini("markers")}
    for name, text in MARKERS.items():
        if name not in registered:
            config.addinivalue_line("markers", f"{name}: {text}")
    config.stash[PURE_ONLY] = pure_only(config.getoption("markexpr") or "")
    if config.stash[PURE_ONLY]:
        mp = pytest.MonkeyPatch()
        hold(mp)
        config.add_cleanup(mp.undo)


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    path = collection_path
    if (config.stash[PURE_ONLY] and path.is_file() and path.suffix == ".py"
            and path.name.startswith("test_")):
        return MARK not in path.read_text() or None
    return None


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A module's ``pure`` mark moves onto each of its tests but those marked ``impure``, so
    that ``-m pure``, ``-m "not pure"`` and the hold below see each test as it is."""
    pure_modules: dict[pytest.Module, bool] = {}
    for item in items:
        module = item.getparent(pytest.Module)
        if module is None:
            continue
        if module not in pure_modules:
            marks = module.own_markers
            pure_modules[module] = any(mark.name == "pure" for mark in marks)
            marks[:] = [mark for mark in marks if mark.name != "pure"]
        if (pure_modules[module] and item.get_closest_marker("impure") is None
                and item.get_closest_marker("pure") is None):
            item.add_marker("pure")


@pytest.fixture(autouse=True)
def _pure_held(request: pytest.FixtureRequest) -> Iterator[None]:
    """Around a pure test in a full run (under ``-m pure`` the session is held already)."""
    if request.node.get_closest_marker("pure") is None or request.config.stash[PURE_ONLY]:
        yield
        return
    with pytest.MonkeyPatch.context() as mp:
        hold(mp)
        yield
