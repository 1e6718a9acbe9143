"""What ``plimsoll verify`` watches while it injects faults: one probe per OS, one sampler.

The fault code (:mod:`.faults`) never reads a platform file itself; it asks
a :class:`Sampler` for the figures of a time window, and the sampler asks a probe chosen
per OS for one :class:`Sample` at a time:

- :class:`LinuxProbe`: the target's RSS (``/proc/PID/status``), its memory cgroup (usage,
  working set, fail count, OOM kills, the kernel's own high-water mark), host page-outs
  (``pswpout`` in ``/proc/vmstat``) and PSI (``/proc/pressure/memory``, some avg10).
- :class:`DarwinProbe`: the target's ``phys_footprint`` (libproc) stands in for usage and
  working set, host page-outs are ``vm_stat``'s Pageouts + Swapouts, and pressure is
  ``kern.memorystatus_vm_pressure_level`` (1 normal, 2 warn, 4 critical); there is no
  cgroup, so fail and OOM-kill counts stay 0 (a jetsam kill shows as the worker's exit).
  Its readers come from :mod:`plimsoll.probes.darwin`.

Invariant: a reading that is missing is 0 or None, never a guess; a window's deltas are
last-minus-first of the samples inside it, so a counter that only grows gives ≥ 0.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def pswpout() -> int:
    for line in _read("/proc/vmstat").splitlines():
        if line.startswith("pswpout "):
            return int(line.split()[1])
    return 0


def psi_some_avg10() -> float | None:
    for line in _read("/proc/pressure/memory").splitlines():
        if line.startswith("some "):
            return float(line.split()[1].split("=")[1])
    return None


def rss_of(pid: int) -> int:
    for line in _read(f"/proc/{pid}/status").splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


@dataclass
class Sample:
    t: float
    rss: int
    usage: int
    working_set: int
    failcnt: int
    oom_kill: int
    pswpout: int
    pressure: float | None
    mlx_active: int | None = None


class LinuxProbe:
    """A target process and (optionally) the memory cgroup that holds it."""

    pressure_name = "PSI some avg10"
    interval_s = 0.05  # a few small /proc and cgroup files: cheap

    def __init__(self, pid: int, cgroup=None):
        self.pid, self.cgroup = pid, cgroup

    def sample(self) -> Sample:
        cg = self.cgroup
        ev = cg.events() if cg else {}
        return Sample(time.monotonic(), rss_of(self.pid), (cg.usage() or 0) if cg else 0,
                      (cg.working_set() or 0) if cg else 0, ev.get("failcnt", 0),
                      ev.get("oom_kill", 0), pswpout(), psi_some_avg10())

    def reset_peak(self) -> None:
        """Restart the kernel's high-water mark (v1 ``max_usage_in_bytes``; v2's
        ``memory.peak`` cannot be reset by writing, so v2 keeps the sampled peak only)."""
        if self.cgroup is not None and self.cgroup.version == "v1":
            with contextlib.suppress(OSError):
                (self.cgroup.path / "memory.max_usage_in_bytes").write_text("0")

    def kernel_peak(self) -> int | None:
        return self.cgroup.max_usage() if self.cgroup is not None else None


class DarwinProbe:
    """macOS: phys_footprint, vm_stat page-outs, the kernel's pressure level.

    ``run`` and ``footprint`` default to :mod:`plimsoll.probes.darwin`'s real runners and
    are parameters so recorded command output drives it on Linux CI."""

    pressure_name = "kern.memorystatus_vm_pressure_level"
    interval_s = 0.5  # each sample runs vm_stat and sysctl

    def __init__(self, pid: int, cgroup=None, *, run=None, footprint=None):
        from plimsoll.probes import darwin

        self.pid, self.cgroup = pid, None
        self._run = run or darwin.run_command
        self._footprint = footprint or darwin.read_phys_footprint

    def sample(self) -> Sample:
        from plimsoll.probes import darwin

        try:
            fp = self._footprint(self.pid)
        except OSError:
            fp = 0
        vm_text = self._run([darwin.VM_STAT])
        vm = darwin.parse_vm_stat(vm_text) if vm_text else None
        level = darwin.read_sysctl("kern.memorystatus_vm_pressure_level", self._run)
        return Sample(time.monotonic(), fp, fp, fp, 0, 0,
                      (vm.pageouts + vm.swapouts) if vm else 0,
                      None if level is None else float(level))

    def reset_peak(self) -> None:
        pass

    def kernel_peak(self) -> int | None:
        return None


def probe_for(pid: int, cgroup=None, platform: str = sys.platform):
    """The probe for this OS (``platform`` is a parameter so tests can pick one)."""
    if platform == "darwin":
        return DarwinProbe(pid, cgroup)
    return LinuxProbe(pid, cgroup)


class Sampler(threading.Thread):
    """Samples the probe every ``interval_s`` (default: the probe's own cadence) until
    stopped; :meth:`window` summarises a span.

    ``mlx_active`` (optional) asks the target for MLX's active bytes; it is an HTTP call
    that can stall while the engine works, so a second thread polls it on its own cadence
    and the memory sampling never waits for it.
    """

    def __init__(self, probe, interval_s: float | None = None,
                 mlx_active: Callable[[], int | None] | None = None):
        super().__init__(daemon=True, name="plimsoll-verify-sampler")
        self.probe = probe
        self.interval_s = interval_s or getattr(probe, "interval_s", 0.05)
        self.samples: list[Sample] = []
        self.mlx: list[tuple[float, int]] = []
        self._halt = threading.Event()
        self._mlx_fn = mlx_active
        self._side = (threading.Thread(target=self._poll_mlx, daemon=True,
                                       name="plimsoll-verify-mlx") if mlx_active else None)

    def sample(self) -> Sample:
        return self.probe.sample()

    def run(self) -> None:
        if self._side is not None:
            self._side.start()
        while not self._halt.is_set():
            self.samples.append(self.sample())
            self._halt.wait(self.interval_s)

    def _poll_mlx(self) -> None:
        while not self._halt.is_set():
            try:
                v = self._mlx_fn()
            except Exception:  # a target that died or stalled: no reading
                v = None
            if v is not None:
                self.mlx.append((time.monotonic(), v))
            self._halt.wait(0.2)

    def stop(self) -> None:
        self._halt.set()
        self.join(5)
        if self._side is not None and self._side.is_alive():
            self._side.join(5)

    def reset_peak(self) -> None:
        self.probe.reset_peak()

    def window(self, t0: float, t1: float, kernel_peak: bool = False) -> dict:
        """Peaks and deltas of the samples in [t0, t1]; with ``kernel_peak`` the cgroup's own
        high-water mark (reset by :meth:`reset_peak` at t0) also counts, so a spike
        between two samples is not missed."""
        s = [x for x in self.samples if t0 <= x.t <= t1] or [self.sample()]
        before = [x for x in self.samples if x.t < t0]
        base = before[-1] if before else s[0]  # counters that moved just after t0 count
        pressure = [x.pressure for x in s if x.pressure is not None]
        mlx = [v for t, v in self.mlx if t0 <= t <= t1]
        peak_usage = max(x.usage for x in s)
        if kernel_peak and (k := self.probe.kernel_peak()):
            peak_usage = max(peak_usage, k)
        return {"samples": len(s), "peak_rss_bytes": max(x.rss for x in s),
                "peak_usage_bytes": peak_usage,
                "peak_working_set_bytes": max(x.working_set for x in s),
                "mlx_active_peak_bytes": max(mlx) if mlx else None,
                "failcnt_delta": s[-1].failcnt - base.failcnt,
                "oom_kill_delta": s[-1].oom_kill - base.oom_kill,
                "pswpout_delta": s[-1].pswpout - base.pswpout,
                "pressure_max": max(pressure) if pressure else None}
