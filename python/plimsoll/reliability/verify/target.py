"""The things ``plimsoll verify`` drives: prompts, the workload, a target, spike helpers.

A :class:`Target` is a server under test (plimsoll's worker, or ``mlx_lm.server`` for the
contrast) with the memory cgroup it runs in; a :class:`Workload` is the same set of requests
and spike sizes for both; a :class:`Helper` is one :mod:`plimsoll.reliability.spike` process placed
in the target's cgroup (so the kernel charges its spike where the guard looks), read with
bounded waits. Prompts are text, the same strings for both targets (``mlx_lm.server`` takes no
token lists), built from the model's own tokenizer to at most the wanted number of tokens.
The prefetch fault's scratch file is made here too: written, synced and dropped from the page
cache, so whoever reads it next is charged for it.
"""

from __future__ import annotations

import contextlib
import os
import queue
import random
import subprocess
import sys
import threading
import time
from collections import Counter
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path

from plimsoll.core.units import MIB


# --- prompts ------------------------------------------------------------------------------
class Prompts:
    """Texts of a known token count, built once and shared by every target."""

    def __init__(self, model_dir: Path, vocab: int):
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
        self.vocab = min(vocab, self.tok.get_vocab_size())
        self._made: dict[tuple[int, int], str] = {}

    def count(self, text: str) -> int:
        return len(self.tok.encode(text, add_special_tokens=False).ids)

    def text(self, n: int, seed: int) -> str:
        """At most ``n`` tokens, as close as a few trims get (decoding random ids and
        encoding the text again does not give the same count)."""
        key = (n, seed)
        if key in self._made:
            return self._made[key]
        rng = random.Random(seed)
        ids = [rng.randrange(10, self.vocab) for _ in range(n)]
        text = self.tok.decode(ids)
        for _ in range(12):
            c = self.count(text)
            if c <= n:
                break
            ids = ids[:max(1, len(ids) - (c - n) - 1)]
            text = self.tok.decode(ids)
        self._made[key] = text
        return text


# --- what is driven -----------------------------------------------------------------------
@dataclass
class Workload:
    """The requests and spike sizes, fixed by plimsoll's run and replayed on the contrast."""

    model_dir: Path
    concurrency: int
    context: int
    max_tokens: int  # the output reservation a request may ask for
    default_max_tokens: int
    max_queue: int
    mmap_path: Path | None = None
    spike_mib: dict[str, int] = field(default_factory=dict)  # kind → MiB, set by plimsoll's run
    load_copies: int | None = None


class Target:
    """A server under test, in its own memory cgroup (or none), on 127.0.0.1."""

    def __init__(self, label: str, url: str, model_name: str, proc: subprocess.Popen,
                 cgroup, prompts: Prompts, *, guarded: bool):
        self.label, self.url, self.model_name = label, url, model_name
        self.proc, self.cgroup, self.prompts, self.guarded = proc, cgroup, prompts, guarded

    def post(self, text: str, max_tokens: int, timeout: float = 300.0) -> str:
        import httpx

        try:
            r = httpx.post(f"{self.url}/v1/completions", timeout=timeout,
                           json={"model": self.model_name, "prompt": text,
                                 "max_tokens": max_tokens, "temperature": 0.0})
        except httpx.HTTPError as err:
            return f"error {type(err).__name__}"
        if r.status_code == 200:
            return "200"
        try:
            code = r.json()["error"].get("code") or ""
        except (ValueError, KeyError, AttributeError, TypeError):
            code = ""
        return f"{r.status_code} {code}".strip()

    def burst(self, texts: list[str], max_tokens: int) -> Counter:
        with futures.ThreadPoolExecutor(max(1, len(texts))) as ex:
            return Counter(ex.map(lambda t: self.post(t, max_tokens), texts))

    def alive(self) -> bool:
        return self.proc.poll() is None

    def place(self, argv: list[str]) -> list[str]:
        """``argv`` run inside this target's cgroup from its first instruction."""
        if self.cgroup is None:
            return argv
        return [sys.executable, "-m", "plimsoll.guard", "enter", str(self.cgroup.path),
                "--", *argv]

    def lines(self) -> tuple[int | None, int | None]:
        """(soft line, hard line) in bytes; the contrast has no soft line."""
        if self.guarded:
            import httpx

            st = httpx.get(f"{self.url}/v1/plimsoll/status", timeout=10).json()["cgroup"]
            return st["soft_bytes"], st["limit_bytes"]
        return None, (self.cgroup.limit() if self.cgroup else None)

    def working_set(self) -> int:
        return (self.cgroup.working_set() or 0) if self.cgroup else 0

    def recovers(self, within_s: float = 30.0) -> bool:
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline and self.alive():
            if self.post("hello again", 2, timeout=60) == "200":
                return True
            time.sleep(0.3)
        return False


# --- spike helpers ------------------------------------------------------------------------
class Helper:
    """One :mod:`plimsoll.reliability.spike` process in the target's cgroup; every read bounded."""

    def __init__(self, target: Target, kind: str, arg: str | None = None,
                 env: dict[str, str] | None = None):
        argv = [sys.executable, "-m", "plimsoll.reliability.spike", kind, *([arg] if arg else [])]
        self.proc = subprocess.Popen(target.place(argv), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env)
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self._lines.put(line.strip())
        self._lines.put("")  # EOF: the helper exited (or was killed)

    def expect(self, word: str, timeout_s: float = 120.0) -> str | None:
        try:
            line = self._lines.get(timeout=timeout_s)
        except queue.Empty:
            return None
        return line if line.startswith(word) else None

    def send(self, line: str) -> None:
        try:
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, ValueError, OSError):
            pass

    def release(self, timeout_s: float = 60.0) -> int:
        with contextlib.suppress(BrokenPipeError, OSError):
            self.proc.stdin.close()
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(10)


def drop_cached(path: Path) -> None:
    """Drop ``path``'s clean pages from the page cache (a page is charged to the cgroup that
    first faults it in, so a cached file would be charged to nobody under test)."""
    if hasattr(os, "posix_fadvise"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def filesystem_of(path: Path, mountinfo: str | None = None) -> str | None:
    """The filesystem type holding ``path`` (Linux ``/proc/self/mountinfo``), or None."""
    if mountinfo is None:
        try:
            mountinfo = Path("/proc/self/mountinfo").read_text()
        except OSError:
            return None
    target, best = str(Path(path).resolve()), (-1, None)
    for line in mountinfo.splitlines():
        left, _, right = line.partition(" - ")
        fields = left.split()
        if len(fields) < 5 or not right:
            continue
        mp = fields[4].replace("\\040", " ")
        inside = target == mp or target.startswith(mp.rstrip("/") + "/")
        if inside and len(mp) > best[0]:
            best = (len(mp), right.split()[0])
    return best[1]


def make_scratch(directory: Path, size_bytes: int) -> Path:
    """A file of ``size_bytes`` written, synced and dropped from the page cache, so the
    prefetch that reads it back is charged to the reader's cgroup, not to ours."""
    path = Path(directory) / "prefetch.bin"
    chunk = b"\x5a" * (8 * MIB)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        left = size_bytes
        while left > 0:
            left -= os.write(fd, chunk[:min(left, len(chunk))])
        os.fsync(fd)
    finally:
        os.close(fd)
    drop_cached(path)
    return path
