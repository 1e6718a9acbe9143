"""macOS probe: parsers on recorded outputs, the composition on a fixture runner.

CI is Linux, so the commands are replaced by a runner that serves the fixture files for
one host; the parsers and the ceiling decision run for real on them.
"""

from __future__ import annotations

import ctypes
import struct
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from plimsoll import probes
from plimsoll.core.units import GIB, MIB
from plimsoll.probes import MemorySnapshot, darwin

pytestmark = pytest.mark.pure

FIXTURES = Path(__file__).parents[1] / "fixtures" / "darwin"
HOSTS = ("m2_ultra_128g_default", "m2_max_96g_limited_warn", "intel_16g_no_iogpu_critical")


def fx(path: str) -> str:
    return (FIXTURES / path).read_text()


class FixtureRunner:
    """Serves ``sysctl -n NAME``, ``vm_stat`` and ``memory_pressure -Q`` from a host dir.

    A missing file answers None, as ``run_command`` does for an unknown OID or a failure.
    """

    def __init__(self, host: str, missing: Sequence[str] = ()) -> None:
        self.dir, self.missing, self.calls = FIXTURES / host, set(missing), []

    def __call__(self, argv: Sequence[str]) -> str | None:
        self.calls.append(tuple(argv))
        files = {
            darwin.VM_STAT: "vm_stat.txt",
            darwin.MEMORY_PRESSURE: "memory_pressure_Q.txt",
        }
        name = f"sysctl_{argv[2]}.txt" if argv[0] == darwin.SYSCTL else files[argv[0]]
        path = self.dir / name
        return None if name in self.missing or not path.exists() else path.read_text()


def no_mlx() -> int | None:
    return None


def must_not_ask_mlx() -> int | None:
    raise AssertionError("MLX must not be asked when the sysctl gives the ceiling")


def snapshot(
    host: str,
    mlx: Callable[[], int | None] = no_mlx,
    missing: Sequence[str] = (),
) -> MemorySnapshot:
    return darwin.read_snapshot(
        4242,
        run=FixtureRunner(host, missing),
        footprint=lambda pid: pid * 1000,
        mlx_recommended=mlx,
    )


# --- parsers --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("m2_ultra_128g_default/vm_stat.txt", darwin.VmStat(16384, 1623456, 12345, 23456)),
        ("m2_max_96g_limited_warn/vm_stat.txt", darwin.VmStat(16384, 4718592, 0, 0)),
        ("intel_16g_no_iogpu_critical/vm_stat.txt", darwin.VmStat(4096, 786432, 45678, 234567)),
        ("vm_stat_osx_10_6.txt", darwin.VmStat(4096, 198765, 6789, 0)),  # no Swapouts line
    ],
)
def test_parse_vm_stat(path: str, expected: darwin.VmStat) -> None:
    assert darwin.parse_vm_stat(fx(path)) == expected


def test_parse_vm_stat_rejects_other_text() -> None:
    with pytest.raises(ValueError, match="page size"):
        darwin.parse_vm_stat("Pages wired down:     12.\n")
    with pytest.raises(ValueError, match="wired"):
        darwin.parse_vm_stat("Mach Virtual Memory Statistics: (page size of 16384 bytes)\n")


@pytest.mark.parametrize(
    ("path", "total", "free"),
    [
        ("m2_ultra_128g_default/memory_pressure_Q.txt", 137438953472, 62),
        ("m2_max_96g_limited_warn/memory_pressure_Q.txt", 103079215104, 21),
        ("intel_16g_no_iogpu_critical/memory_pressure_Q.txt", 17179869184, 8),
        ("memory_pressure_Q_physical_memory_variant.txt", 17179869184, 40),
    ],
)
def test_parse_memory_pressure(path: str, total: int, free: int) -> None:
    assert darwin.parse_memory_pressure(fx(path)) == (total, free)


def test_parse_memory_pressure_on_garbage_is_empty() -> None:
    assert darwin.parse_memory_pressure("usage: memory_pressure [options]\n") == (None, None)


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("0\n", 0),
        ("73728\n", 73728),
        ("137438953472\n", 128 * GIB),
        ("", None),
        (None, None),
        ("sysctl: unknown oid 'iogpu.wired_limit_mb'\n", None),
    ],
)
def test_parse_sysctl_int(text: str | None, value: int | None) -> None:
    assert darwin.parse_sysctl_int(text) == value


@pytest.mark.parametrize(
    ("level", "pressure"),
    [
        (1, "normal"),
        (2, "warn"),
        (4, "critical"),
        (0, "unknown"),
        (3, "unknown"),
        (None, "unknown"),
    ],
)
def test_pressure_from_level(level: int | None, pressure: str) -> None:
    assert darwin.pressure_from_level(level) == pressure


def test_parse_mlx_device_info() -> None:
    metal = {"memory_size": 128 * GIB, "max_recommended_working_set_size": 115448725504}
    assert darwin.parse_mlx_device_info(metal) == 115448725504
    # mx.device_info() on a Linux CPU build, as recorded on the dev VM:
    assert darwin.parse_mlx_device_info({"architecture": "x86_64", "device_name": "AMD"}) is None
    assert darwin.parse_mlx_device_info({"max_recommended_working_set_size": 0}) is None


@pytest.mark.parametrize(
    ("memsize", "ceiling"),
    [
        (128 * GIB, 96 * GIB),
        (37 * GIB, 37 * GIB * 3 // 4),
        (36 * GIB, 24 * GIB),
        (16 * GIB, 16 * GIB * 2 // 3),
    ],
)
def test_default_wired_limit_errs_low(memsize: int, ceiling: int) -> None:
    assert darwin.default_wired_limit(memsize)[0] == ceiling


def test_wired_ceiling_decisions() -> None:
    ram = 128 * GIB
    assert darwin.wired_ceiling(ram, (72 * GIB, "iogpu.wired_limit_mb=73728"), 1) == (
        72 * GIB,
        "sysctl iogpu.wired_limit_mb=73728",
    )
    ceiling, source = darwin.wired_ceiling(ram, (0, "iogpu.wired_limit_mb=0"), 110 * GIB)
    assert ceiling == 110 * GIB and source.startswith("MLX max_recommended_working_set_size")
    for wired in ((0, "iogpu.wired_limit_mb=0"), None):  # None: Intel, no such sysctl
        ceiling, source = darwin.wired_ceiling(ram, wired, None)
        assert ceiling == 96 * GIB and "estimated" in source and "3/4" in source


def test_wired_ceiling_clamps_above_ram() -> None:
    ceiling, source = darwin.wired_ceiling(
        64 * GIB, (darwin.mib_to_bytes(200_000), "iogpu.wired_limit_mb=200000"), None
    )
    assert ceiling == 64 * GIB
    clamp = f"clamped to hw.memsize from {200_000 * MIB} B"
    assert source == f"sysctl iogpu.wired_limit_mb=200000; {clamp}"
    ceiling, source = darwin.wired_ceiling(16 * GIB, None, 17 * GIB)
    assert ceiling == 16 * GIB and "clamped" in source


def rusage_blob(phys_footprint: int, size: int = 160) -> bytes:
    """A rusage_info_v2 laid out by hand: uuid[16] then 18 uint64, footprint the 8th."""
    values = [11, 22, 33, 44, 55, 66, 77, phys_footprint, 99, 0, 1, 2, 3, 4, 5, 6, 7, 8]
    blob = struct.pack("<16s18Q", bytes(range(16)), *values)
    return blob + b"\xff" * (size - len(blob))


def test_decode_rusage_info_v2() -> None:
    assert ctypes.sizeof(darwin.RusageInfoV2) == 160
    assert darwin.RusageInfoV2.ri_phys_footprint.offset == 72
    assert darwin.decode_rusage_info_v2(rusage_blob(83 * GIB)) == 83 * GIB
    # v3/v4 start with the v2 fields, so a longer buffer decodes its v2 prefix.
    assert darwin.decode_rusage_info_v2(rusage_blob(5 * MIB, size=296)) == 5 * MIB
    with pytest.raises(ValueError):
        darwin.decode_rusage_info_v2(rusage_blob(1)[:100])


# --- the composition on fixture hosts -------------------------------------------------


def test_snapshot_default_wired_limit_asks_metal() -> None:
    s = snapshot(HOSTS[0], mlx=lambda: 115448725504)
    assert s.platform == "darwin"
    assert s.total_ram_bytes == 128 * GIB
    assert s.ceiling_bytes == 115448725504
    assert s.ceiling_source == "MLX max_recommended_working_set_size (wired limit 0: macOS default)"
    assert s.in_use_bytes == 1623456 * 16384
    assert s.page_outs == 12345 + 23456
    assert s.pressure == "normal"
    assert s.pressure_detail == "kern.memorystatus_vm_pressure_level=1; memory_pressure free 62%"
    assert s.process_footprint_bytes == 4242 * 1000


def test_snapshot_default_wired_limit_without_metal_estimates() -> None:
    s = snapshot(HOSTS[0])
    assert s.ceiling_bytes == 96 * GIB
    assert s.ceiling_source.startswith("estimated macOS default wired limit, 3/4")


def test_snapshot_with_the_sysctl_set_is_exact_and_skips_metal() -> None:
    runner = FixtureRunner(HOSTS[1])
    s = darwin.read_snapshot(run=runner, footprint=lambda pid: 1, mlx_recommended=must_not_ask_mlx)
    assert s.ceiling_bytes == 73728 * MIB == 72 * GIB
    assert s.ceiling_source == "sysctl iogpu.wired_limit_mb=73728"
    assert (s.pressure, s.page_outs, s.in_use_bytes) == ("warn", 0, 72 * GIB)
    assert all(argv[0].startswith("/usr/") for argv in runner.calls)  # launchd-safe paths


def test_snapshot_intel_without_iogpu_sysctl() -> None:
    s = snapshot(HOSTS[2])
    assert s.total_ram_bytes == 16 * GIB
    assert s.ceiling_bytes == 16 * GIB * 2 // 3
    assert "2/3" in s.ceiling_source
    assert (s.pressure, s.in_use_bytes) == ("critical", 786432 * 4096)
    assert s.page_outs == 45678 + 234567


def test_snapshot_ventura_debug_sysctl_fallback() -> None:
    """macOS 13 has no iogpu.wired_limit_mb; its debug.iogpu.wired_limit is in bytes."""
    runner = FixtureRunner(HOSTS[0], missing=["sysctl_iogpu.wired_limit_mb.txt"])

    def ventura(argv: Sequence[str]) -> str | None:
        if tuple(argv) == (darwin.SYSCTL, "-n", "debug.iogpu.wired_limit"):
            return f"{100 * GIB}\n"
        return runner(argv)

    s = darwin.read_snapshot(run=ventura, footprint=lambda pid: 1, mlx_recommended=no_mlx)
    assert s.ceiling_bytes == 100 * GIB
    assert s.ceiling_source == f"sysctl debug.iogpu.wired_limit={100 * GIB}"


def test_snapshot_memsize_falls_back_to_memory_pressure() -> None:
    s = snapshot(HOSTS[0], missing=["sysctl_hw.memsize.txt"])
    assert s.total_ram_bytes == 137438953472


def test_snapshot_unknown_pressure_level_keeps_the_free_figure() -> None:
    s = snapshot(HOSTS[0], missing=["sysctl_kern.memorystatus_vm_pressure_level.txt"])
    assert s.pressure == "unknown"
    assert s.pressure_detail.endswith("memory_pressure free 62%")


def test_snapshot_without_vm_stat_fails_loud() -> None:
    with pytest.raises(OSError, match="vm_stat"):
        snapshot(HOSTS[0], missing=["vm_stat.txt"])


# --- runners, for real where this OS allows -------------------------------------------


@pytest.mark.impure
def test_run_command_for_real() -> None:
    assert darwin.run_command(["/bin/echo", "16384"]) == "16384\n"
    assert darwin.run_command(["/bin/false"]) is None
    assert darwin.run_command(["/nonexistent/sysctl", "-n", "hw.memsize"]) is None


@pytest.mark.impure
@pytest.mark.skipif(sys.platform == "darwin", reason="Metal may be present on a Mac")
def test_mlx_without_metal_gives_no_recommendation() -> None:
    pytest.importorskip("mlx.core")
    assert darwin.read_mlx_recommended_working_set() is None


@pytest.mark.impure
@pytest.mark.skipif(sys.platform == "darwin", reason="tests the non-macOS failure")
def test_phys_footprint_runner_fails_loud_off_macos() -> None:
    with pytest.raises(OSError):
        darwin.read_phys_footprint(1)


@pytest.mark.skipif(sys.platform != "darwin", reason="libproc exists only on macOS")
def test_real_darwin_snapshot() -> None:
    s = probes.read_snapshot()
    assert s.platform == "darwin"
    assert 0 < s.ceiling_bytes <= s.total_ram_bytes
    assert 0 < s.process_footprint_bytes < s.total_ram_bytes


def test_dispatch_refuses_an_unknown_platform(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "platform", "sunos5")
    with pytest.raises(NotImplementedError, match="sunos5"):
        probes.read_snapshot()
