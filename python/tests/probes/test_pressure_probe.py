"""The pressure probe: real /proc on this machine, recorded files and outputs elsewhere."""

from __future__ import annotations

import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

from plimsoll.probes import darwin
from plimsoll.probes import pressure as P

pytestmark = pytest.mark.pure

FX = Path(__file__).parents[1] / "fixtures" / "pressure"
DARWIN_HOST = Path(__file__).parents[1] / "fixtures" / "darwin" / "m2_max_96g_limited_warn"


class Clock:
    def __init__(self, t: float = 100.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_linux_fixtures_read_as_written(tmp_path):
    psi, vm = tmp_path / "memory", tmp_path / "vmstat"
    shutil.copy(FX / "psi_critical.txt", psi)
    shutil.copy(FX / "vmstat_t0.txt", vm)
    r = P.read_linux(str(psi), str(vm), clock=Clock(5.0))
    assert (r.platform, r.mono, r.some_avg10, r.full_avg10, r.page_outs, r.error) == (
        "linux", 5.0, 60.0, 18.4, 48000, None)
    assert r.has_signal
    assert r.describe().startswith("PSI memory some avg10=60.00 full avg10=18.40")


def test_a_psi_file_without_a_full_line_reads_some_only(tmp_path):
    r = P.read_linux(str(FX / "psi_some_only_old_kernel.txt"), str(FX / "vmstat_t1.txt"))
    assert (r.some_avg10, r.full_avg10, r.page_outs) == (3.2, None, 49024)
    assert "full avg10=n/a" in r.describe()


def test_the_env_overrides_point_the_reader_at_other_files(monkeypatch):
    monkeypatch.setenv(P.PSI_PATH_ENV, str(FX / "psi_warn.txt"))
    monkeypatch.setenv(P.VMSTAT_PATH_ENV, str(FX / "vmstat_t1.txt"))
    r = P.read_pressure()  # on macOS too: a set PSI path selects the file reader
    assert (r.platform, r.some_avg10, r.full_avg10, r.page_outs) == ("linux", 14.73, 2.11, 49024)


def test_missing_or_garbled_sources_are_reported_not_raised(tmp_path):
    r = P.read_linux(str(tmp_path / "absent"), str(tmp_path / "absent-too"))
    assert r.some_avg10 is None and r.page_outs is None and not r.has_signal
    assert "cannot read" in r.error and "absent-too" in r.error
    bad = tmp_path / "half"
    bad.write_text("full avg10=1.00 avg60=0.00 avg300=0.00 total=1\n")
    r = P.read_linux(str(bad), str(FX / "vmstat_t0.txt"))
    assert r.some_avg10 is None and r.page_outs == 48000
    assert "no 'some avg10='" in r.error


@pytest.mark.skipif(not Path("/proc/pressure/memory").exists(), reason="no PSI on this kernel")
def test_the_real_proc_pressure_memory_parses_on_this_machine(monkeypatch):
    monkeypatch.delenv(P.PSI_PATH_ENV, raising=False)
    monkeypatch.delenv(P.VMSTAT_PATH_ENV, raising=False)
    r = P.read_linux()
    assert r.error is None, r.error
    assert r.some_avg10 is not None and 0.0 <= r.some_avg10 <= 100.0
    assert r.full_avg10 is not None and 0.0 <= r.full_avg10 <= r.some_avg10 + 1e-9
    assert r.page_outs is not None and r.page_outs >= 0
    if sys.platform.startswith("linux"):
        assert P.read_pressure().source == r.source


class Runner:
    """``sysctl -n kern.memorystatus_vm_pressure_level`` and ``vm_stat`` from files."""

    def __init__(self, level: str | None, vm_stat: Path | None) -> None:
        self.level, self.vm_stat = level, vm_stat

    def __call__(self, argv: Sequence[str]) -> str | None:
        if argv[0] == darwin.SYSCTL:
            assert argv[1:] == ["-n", "kern.memorystatus_vm_pressure_level"]
            return self.level
        assert list(argv) == [darwin.VM_STAT]
        return self.vm_stat.read_text() if self.vm_stat else None


def test_darwin_reader_on_recorded_outputs():
    level = (DARWIN_HOST / "sysctl_kern.memorystatus_vm_pressure_level.txt").read_text()
    r0 = P.read_darwin(Runner(level, FX / "darwin_vm_stat_t0.txt"), clock=Clock(1.0))
    r1 = P.read_darwin(Runner("4\n", FX / "darwin_vm_stat_t1.txt"), clock=Clock(3.0))
    assert (r0.platform, r0.darwin_level, r0.page_outs, r0.error) == ("darwin", 2, 0, None)
    assert (r1.darwin_level, r1.page_outs) == (4, 5120 + 3072)  # Pageouts + Swapouts
    assert r1.has_signal and "kern.memorystatus_vm_pressure_level=4" in r1.describe()


def test_darwin_reader_without_its_commands_reports_why():
    r = P.read_darwin(Runner("", None))
    assert r.darwin_level is None and r.page_outs is None and not r.has_signal
    assert "gave no value" in r.error and "vm_stat failed" in r.error
