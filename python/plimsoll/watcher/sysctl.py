"""Ceiling writers: set the OS wired ceiling in MiB, read it back, fail on a mismatch.

``darwin`` runs ``sysctl -w iogpu.wired_limit_mb=<MiB>`` (macOS 14+, as root) and reads
``sysctl -n iogpu.wired_limit_mb`` back; where MLX with Metal is installed it also asks a
fresh interpreter for ``max_recommended_working_set_size`` (MLX caches device info for
the life of a process, so only a new process sees the new value), which follows the
sysctl to the byte. ``file:PATH`` writes the MiB value to a file and reads it back: the
Linux stand-in and the test backend.

A read-back that differs from what was written is an error (:class:`CeilingMismatch`),
never a warning: the admission arithmetic everywhere else trusts this number.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, Protocol

from plimsoll.core.units import mib_to_bytes
from plimsoll.probes.darwin import SYSCTL, parse_sysctl_int

OID = "iogpu.wired_limit_mb"
# Run in a fresh interpreter: see the module docstring.
MLX_CHECK = (
    "from plimsoll.probes.darwin import read_mlx_recommended_working_set as r\n"
    "print(r() or '')\n"
)


class CeilingError(RuntimeError):
    """The ceiling could not be written or read back."""


class CeilingMismatch(CeilingError):
    """The ceiling read back is not the one written."""


class Completed(NamedTuple):
    returncode: int
    stdout: str
    stderr: str


Runner = Callable[[Sequence[str]], Completed]


@dataclass(frozen=True)
class Applied:
    mib: int  # what was written
    read_back_mib: int  # what the OS (or file) says now
    mlx_bytes: int | None  # MLX's max_recommended_working_set_size; None where not asked
    detail: str


class CeilingWriter(Protocol):
    name: str

    def read_mib(self) -> int | None:
        """The ceiling now in MiB; None if unreadable (0 on macOS: the OS default)."""

    def write_mib(self, mib: int) -> Applied:
        """Write, read back, verify; raise CeilingError / CeilingMismatch."""


# --- pure -------------------------------------------------------------------------------


def parse_sysctl_write(text: str, oid: str = OID) -> tuple[int, int] | None:
    """``sysctl -w oid=N`` output ``oid: OLD -> NEW`` → (old, new); None if not that."""
    m = re.search(rf"^{re.escape(oid)}: (-?\d+) -> (-?\d+)\s*$", text, re.MULTILINE)
    return (int(m.group(1)), int(m.group(2))) if m else None


def verify(mib: int, read_back: int | None, mlx_bytes: int | None, source: str) -> Applied:
    """The check after every write: the read-back (and MLX, when asked) equal ``mib``."""
    if read_back != mib:
        got = "nothing" if read_back is None else f"{read_back} MiB"
        raise CeilingMismatch(f"wrote {mib} MiB to {source} but read back {got}")
    if mlx_bytes is not None and mlx_bytes != mib_to_bytes(mib):
        raise CeilingMismatch(
            f"wrote {mib} MiB ({mib_to_bytes(mib)} B) to {source} but MLX reports "
            f"max_recommended_working_set_size = {mlx_bytes} B"
        )
    detail = f"{source} = {read_back} MiB"
    detail += (f"; MLX max_recommended_working_set_size = {mlx_bytes} B" if mlx_bytes
               else "; MLX/Metal not present: not asked")
    return Applied(mib, read_back, mlx_bytes, detail)


def _check_mib(mib: int) -> None:
    if not isinstance(mib, int) or isinstance(mib, bool) or mib <= 0:
        raise CeilingError(f"refusing to write a non-positive ceiling: {mib!r}")


# --- file: ------------------------------------------------------------------------------


class FileCeiling:
    """``file:PATH``: the value in MiB and a newline, replaced atomically."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.name = f"file:{self.path}"

    def read_mib(self) -> int | None:
        try:
            return parse_sysctl_int(self.path.read_text())
        except OSError:
            return None

    def write_mib(self, mib: int) -> Applied:
        _check_mib(mib)
        try:
            fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", dir=self.path.parent)
            with os.fdopen(fd, "w") as f:
                f.write(f"{mib}\n")
            os.replace(tmp, self.path)
        except OSError as err:
            raise CeilingError(f"cannot write {self.path}: {err}") from None
        return verify(mib, self.read_mib(), None, str(self.path))


# --- darwin -----------------------------------------------------------------------------


def run_command(argv: Sequence[str], timeout: float = 60) -> Completed:
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as err:
        return Completed(-1, "", str(err))
    return Completed(done.returncode, done.stdout, done.stderr)


def mlx_recommended_bytes(run: Runner = run_command) -> int | None:
    """Metal's recommendedMaxWorkingSetSize as MLX sees it, from a fresh interpreter;
    None without MLX or Metal (then nothing is compared)."""
    done = run([sys.executable, "-c", MLX_CHECK])
    return parse_sysctl_int(done.stdout) if done.returncode == 0 else None


class DarwinSysctl:
    """``sysctl -w iogpu.wired_limit_mb=N`` (root), read back with ``sysctl -n``."""

    name = f"sysctl {OID}"

    def __init__(self, run: Runner = run_command,
                 mlx: Callable[[], int | None] | None = mlx_recommended_bytes) -> None:
        self._run, self._mlx = run, mlx

    def read_mib(self) -> int | None:
        done = self._run([SYSCTL, "-n", OID])
        return parse_sysctl_int(done.stdout) if done.returncode == 0 else None

    def write_mib(self, mib: int) -> Applied:
        _check_mib(mib)
        done = self._run([SYSCTL, "-w", f"{OID}={mib}"])
        if done.returncode != 0:
            raise CeilingError(
                f"sysctl -w {OID}={mib} failed (status {done.returncode}): "
                f"{(done.stderr or done.stdout).strip()} (the watcher must run as root on "
                "macOS 14 or later)"
            )
        change = parse_sysctl_write(done.stdout)
        if change is None and done.stderr.strip():
            # sysctl(8) may warn() and still exit 0; the read-back would catch it too.
            raise CeilingError(f"sysctl -w {OID}={mib}: {done.stderr.strip()}")
        if change is not None and change[1] != mib:
            raise CeilingMismatch(f"sysctl -w {OID}={mib} reported {change[0]} -> {change[1]}")
        return verify(mib, self.read_mib(), self._mlx() if self._mlx else None,
                      f"sysctl {OID}")


def open_writer(spec: str) -> CeilingWriter:
    """``darwin`` or ``file:PATH`` → a writer."""
    if spec == "darwin":
        return DarwinSysctl()
    if spec.startswith("file:") and len(spec) > len("file:"):
        path = Path(spec.removeprefix("file:"))
        if not path.parent.is_dir():
            raise ValueError(f"--sysctl {spec}: directory {path.parent} does not exist")
        return FileCeiling(path)
    raise ValueError(f"--sysctl {spec!r}: use 'darwin' or 'file:PATH'")
