"""Where plimsoll keeps what it writes, and the one rule for those directories.

:func:`cache_dir` is the root (demo models, trained tokenizers, calibration records, the
admin token, the embedded demo's KV blocks). :func:`private_dir` is how every directory
plimsoll keeps its own files in comes to exist: created ``0700``, or, when it exists already,
used only if it belongs to this user and no one else may read, write or enter it. KV blocks
hold conversations, the admin token changes modes, calibration records change admission:
a directory another user can write could feed the server their files, one they can read
leaks what was said.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

PRIVATE_MODE = 0o700


class UnsafeDirectory(PermissionError):
    """A directory plimsoll would keep files in is not this user's alone (the message says
    why, and what to run)."""


def cache_dir() -> Path:
    """``$PLIMSOLL_CACHE``, else ``$XDG_CACHE_HOME/plimsoll``, else ``~/.cache/plimsoll``."""
    if env := os.environ.get("PLIMSOLL_CACHE"):
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "plimsoll"


def private_dir(path: str | Path, what: str = "plimsoll's files") -> Path:
    """``path`` as a directory that is this user's alone; returns it.

    Missing directories (``path`` and any missing parents) are created ``0700``. An existing
    ``path`` — and, for a path under :func:`cache_dir`, every directory from the cache root
    down to it — must be owned by this user with no group or other permission bits, else
    :class:`UnsafeDirectory` says which directory, why, and what to run. ``what`` names the
    contents for that message. Links are followed: what counts is the directory used.
    """
    path = Path(path).expanduser().absolute()
    missing = []
    for d in (path, *path.parents):
        if os.path.lexists(d):
            break
        missing.append(d)
    for d in reversed(missing):
        try:
            os.mkdir(d, PRIVATE_MODE)
        except FileExistsError:
            continue  # made meanwhile by another process: checked below like any other
        os.chmod(d, PRIVATE_MODE)  # the umask may have taken bits from the owner's too
    root = cache_dir().expanduser().absolute()
    inside = [d for d in path.parents if d == root or root in d.parents]
    for d in (*reversed(inside), path):
        _check(d, what)
    return path


def _check(d: Path, what: str) -> None:
    try:
        st = d.stat()
    except FileNotFoundError:
        raise UnsafeDirectory(f"{d}: a link to nothing; plimsoll keeps {what} there: remove "
                              "it or point it at a directory of your own") from None
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeDirectory(f"{d} is not a directory; plimsoll keeps {what} there: move "
                              "it away or choose another directory")
    me = os.geteuid()
    if st.st_uid != me:
        raise UnsafeDirectory(
            f"{d} belongs to uid {st.st_uid}, not to this user (uid {me}); plimsoll keeps "
            f"{what} there only in a directory of its own user: choose another directory "
            f"(or, if it is yours, run `chown {me} {d}`)")
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o077:
        who = "group and others" if mode & 0o070 and mode & 0o007 else (
            "its group" if mode & 0o070 else "other users")
        raise UnsafeDirectory(
            f"{d} has mode {mode:04o}: {who} may reach it, and plimsoll keeps {what} there: "
            f"run `chmod 700 {d}` (or choose another directory)")
