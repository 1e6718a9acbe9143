"""Pinned command-line clients from npm, installed once into a cache directory, for tests.

``npm_command(package, version, command)`` returns the path of ``command`` after a pinned
``npm install`` into ``PLIMSOLL_CLIENTS_DIR`` (default ``~/.cache/plimsoll/clients``, the
directory ``.ci/install-clients`` fills), or skips the calling test with the reason: no
npm, node older than the client needs, or the install failed (offline). A second call with
the package in place installs nothing.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

CODEX = ("@openai/codex", "0.171.0", "codex")
"""Codex CLI, pinned (its native binary comes as an optional dependency; node >= 16)."""
INSTALL_TIMEOUT_S = 600


def clients_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(os.environ.get("PLIMSOLL_CLIENTS_DIR") or Path(base) / "plimsoll" / "clients")


def node_major() -> int:
    node = shutil.which("node")
    if node is None:
        return 0
    out = subprocess.run([node, "--version"], capture_output=True, text=True, timeout=30)
    try:
        return int(out.stdout.strip().lstrip("v").split(".")[0])
    except ValueError:
        return 0


def _installed(root: Path, package: str, version: str, command: str) -> Path | None:
    manifest = root / "node_modules" / package / "package.json"
    binary = root / "node_modules" / ".bin" / command
    try:
        ok = json.loads(manifest.read_text()).get("version") == version
    except (OSError, ValueError):
        return None
    return binary if ok and binary.exists() else None


def npm_command(package: str, version: str, command: str, min_node: int = 16) -> Path:
    """``command`` of ``package@version``, installed on first use; skips if it cannot be."""
    root = clients_dir()
    if (found := _installed(root, package, version, command)) is not None:
        return found
    npm = shutil.which("npm")
    if npm is None:
        pytest.skip(f"{package} needs npm, which is not installed (apt-get install nodejs npm)")
    if (major := node_major()) < min_node:
        pytest.skip(f"{package} needs node >= {min_node}; this machine has node {major or 'none'}"
                    " (.ci/install-clients installs a pinned node)")
    root.mkdir(parents=True, exist_ok=True)
    try:
        done = subprocess.run([npm, "install", "--prefix", str(root), "--save-exact",
                               "--no-audit", "--no-fund", "--loglevel=error",
                               f"{package}@{version}"], capture_output=True, text=True,
                              timeout=INSTALL_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.skip(f"npm install {package}@{version} took over {INSTALL_TIMEOUT_S} s")
    if done.returncode != 0 or (found := _installed(root, package, version, command)) is None:
        pytest.skip(f"npm install {package}@{version} failed (rc {done.returncode}): "
                    f"{done.stderr.strip()[-400:]}")
    return found
