"""Shared fixtures: demo models built once per session, real worker processes on 127.0.0.1."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from plimsoll.web.serve import free_port

pytest_plugins = ["pure_tier"]  # the pure tier's marker and its enforcement

OPENBLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0"

# Test modules are imported under their bare names (pytest's default "prepend" import mode, no
# __init__.py files), and some import helpers from others by that name (``from test_proxy import
# Proxy``), as do the shared helpers here (``from families import …``). This folder and every
# test folder go on sys.path, so those imports resolve whichever file runs alone. Basenames stay
# unique across folders: pytest refuses two test modules of one basename in this mode.
TESTS = Path(__file__).resolve().parent
for _folder in [TESTS, *sorted({p.parent for p in TESTS.glob("*/test_*.py")})]:
    if str(_folder) not in sys.path:
        sys.path.insert(0, str(_folder))


def gauge_text(status: dict[str, dict]) -> str:
    """The proxy's /metrics text of its per-model gauges, every model ready with ``status``
    (model → its worker's status report), through the real collector and exposition."""
    from prometheus_client.exposition import generate_latest
    from prometheus_client.registry import CollectorRegistry

    from plimsoll.proxy.gauges import Poll, gauges

    p = Poll(workers={m: {"state": "ready"} for m in status}, status=status)

    class One:
        def collect(self):
            return gauges(p, lambda _: 0)

    reg = CollectorRegistry()
    reg.register(One())
    return generate_latest(reg).decode()


def sharpened_model(src: Path, out: Path, scale: float = 4.0) -> Path:
    """A copy of the model at ``src`` with its matrices scaled by ``scale`` (as
    ``plimsoll.engine.drive.sharpen`` does in memory), saved at ``out``: at scale 1 a tiny
    random model repeats one token, which would make an equality of outputs weak."""
    import shutil

    import mlx.core as mx

    shutil.copytree(src, out)
    for f in out.glob("*.safetensors"):
        weights = mx.load(str(f))
        mx.save_safetensors(str(f), {k: v * scale if v.ndim == 2 else v
                                     for k, v in weights.items()}, metadata={"format": "mlx"})
    return out


def worker_env() -> dict[str, str]:
    """float32 matmul through OpenBLAS is ~70x faster than MLX's own CPU kernels here."""
    env = dict(os.environ)
    if os.path.exists(OPENBLAS) and "LD_PRELOAD" not in env:
        env["LD_PRELOAD"] = OPENBLAS
    return env


@pytest.fixture(scope="session", autouse=True)
def private_cache(tmp_path_factory) -> Iterator[Path]:
    """Tests never read or write the user's cache (calibration records change admission)."""
    path = tmp_path_factory.mktemp("plimsoll-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PLIMSOLL_CACHE", str(path))
        yield path


@pytest.fixture(scope="session", autouse=True)
def calm_pressure(tmp_path_factory) -> Iterator[Path]:
    """Proxies under test read a calm PSI file unless a test points them at another one.

    The proxy's tripwire acts on system-wide PSI, which rises whenever any task stalls on
    memory, including one reclaiming inside its own cgroup limit (another test's, or another
    user's on a shared box). Only the tripwire's own tests drive pressure; the real
    /proc/pressure/memory is read by tests that unset PLIMSOLL_PSI_PATH.
    """
    path = tmp_path_factory.mktemp("psi") / "memory"
    path.write_text("some avg10=0.00 avg60=0.00 avg300=0.00 total=0\n"
                    "full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PLIMSOLL_PSI_PATH", str(path))
        yield path


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    from plimsoll.demo.model import build_demo_model

    return build_demo_model(tmp_path_factory.mktemp("models") / "tiny", preset="tiny")


class Worker:
    """A real ``plimsoll worker`` process; stopped (and waited for) on exit."""

    def __init__(self, model: Path, *, extra_env: dict[str, str] | None = None,
                 log: Path | None = None, **flags):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        defaults = {"max-cache-blocks": 2048, "gpu-memory-utilization": 0.9,
                    "cache-memory-mb": 64, "max-num-seqs": 8, "context": 4096,
                    "max-tokens": 512, "ceiling-bytes": 8 << 30, "total-ram-bytes": 16 << 30}
        defaults.update({k.replace("_", "-"): v for k, v in flags.items()})
        argv = [sys.executable, "-m", "plimsoll.cli", "worker", "--model", str(model),
                "--model-name", "tiny", "--port", str(self.port)]
        for k, v in defaults.items():
            # True: a bare flag; False: its --no- spelling (a flag that is on by default)
            argv += [f"--{k}"] if v is True else [f"--no-{k}"] if v is False \
                else [f"--{k}", str(v)]
        env = worker_env() | (extra_env or {})
        out = log.open("w") if log is not None else None  # else: pytest's own output
        self.proc = subprocess.Popen(argv, env=env, start_new_session=True, stdout=out,
                                     stderr=subprocess.STDOUT if out else None)
        if out is not None:
            out.close()  # the child holds its own copy
        self.wait_ready()

    def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker exited with {self.proc.returncode}")
            try:
                if httpx.get(self.url + "/v1/plimsoll/status", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.2)
        raise RuntimeError("worker not ready in time")

    def status(self) -> dict:
        return httpx.get(self.url + "/v1/plimsoll/status", timeout=10).json()

    def wait_idle(self, timeout: float = 30.0) -> dict:
        """Poll status until nothing runs, waits or holds live blocks; return that status."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            s = self.status()
            if s["running"] == 0 and s["waiting"] == 0 and s["pool"]["used"] == 0:
                return s
            time.sleep(0.1)
        raise AssertionError(f"worker did not go idle: {s}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="module")
def worker(tiny_model) -> Iterator[Worker]:
    w = Worker(tiny_model)
    yield w
    w.stop()


def parse_log_line(line: str) -> dict[str, str] | None:
    """A watcher log line (``plimsoll.watcher.run``'s format) → {"time", "level", "event",
    key: value, …}; None if not one."""
    try:
        head, level, event, *rest = shlex.split(line)
    except ValueError:
        return None
    out = {"time": head, "level": level, "event": event}
    for item in rest:
        k, sep, v = item.partition("=")
        if not sep:
            return None
        out[k] = v
    return out if "ts" in out else None


@pytest.fixture(scope="session")
def family_dir(tmp_path_factory):
    """``family_dir(name)``: the tiny model of family ``name`` (tests/families.py), built once
    per session on first use, in the real mlx-lm layout with the demo tokenizer."""
    from families import build_family

    from plimsoll.demo import tokenizer as tokenizer_build

    tok = tokenizer_build.train_tokenizer(512)
    root = tmp_path_factory.mktemp("families")
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = build_family(name, root / name, tok)
        return built[name]
    return get


# Known regressions after this session's merges (engine, clients, disk tier), reported in the
# closing notes and left for the next session: they still run, and pass or fail visibly
# (xfail, not skip). Each reason says what changed.
KNOWN_REGRESSIONS = {
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        key = item.nodeid.split("python/tests/")[-1].split("[")[0]
        if key in KNOWN_REGRESSIONS:
            item.add_marker(pytest.mark.xfail(reason=KNOWN_REGRESSIONS[key], strict=False))
