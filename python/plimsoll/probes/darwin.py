"""macOS memory probe: ``sysctl``, ``vm_stat``, ``memory_pressure`` and libproc.

Why these sources: on Apple Silicon the line a worker must not cross is the GPU wired
ceiling (``iogpu.wired_limit_mb``), not RAM; wired memory bypasses the pressure system,
so ``in_use`` is wired pages, the figure that grows toward the IOGPU panic.

Shape (psutil's ``_psosx``): ``parse_*``/``decode_*`` are pure functions of command
output (or bytes), tested on recorded fixtures on Linux CI; ``run_command`` and the
``read_*`` runners are thin and only work on macOS; ``read_snapshot`` composes them and
takes its runners as parameters so the composition is tested on fixtures too.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import re
import subprocess
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

from plimsoll.core.units import GIB, mib_to_bytes
from plimsoll.probes.snapshot import MemorySnapshot, PressureLevel

# Absolute paths: a launchd daemon's PATH has no /usr/sbin.
SYSCTL = "/usr/sbin/sysctl"
VM_STAT = "/usr/bin/vm_stat"
MEMORY_PRESSURE = "/usr/bin/memory_pressure"

# kern.memorystatus_vm_pressure_level uses the dispatch levels (sys/event.h
# NOTE_MEMORYSTATUS_PRESSURE_*): 1 normal, 2 warn, 4 critical.
PRESSURE_LEVELS: dict[int, PressureLevel] = {1: "normal", 2: "warn", 4: "critical"}

Runner = Callable[[Sequence[str]], str | None]


class VmStat(NamedTuple):
    page_size: int
    wired_pages: int
    pageouts: int
    swapouts: int


class MemoryPressureSummary(NamedTuple):
    total_bytes: int | None
    free_percent: int | None


class RusageInfoV2(ctypes.LittleEndianStructure):
    """``struct rusage_info_v2`` from <sys/resource.h> (160 bytes, every Apple ABI)."""

    _fields_ = [
        ("ri_uuid", ctypes.c_uint8 * 16),
        *(
            (name, ctypes.c_uint64)
            for name in (
                "ri_user_time",
                "ri_system_time",
                "ri_pkg_idle_wkups",
                "ri_interrupt_wkups",
                "ri_pageins",
                "ri_wired_size",
                "ri_resident_size",
                "ri_phys_footprint",
                "ri_proc_start_abstime",
                "ri_proc_exit_abstime",
                "ri_child_user_time",
                "ri_child_system_time",
                "ri_child_pkg_idle_wkups",
                "ri_child_interrupt_wkups",
                "ri_child_pageins",
                "ri_child_elapsed_abstime",
                "ri_diskio_bytesread",
                "ri_diskio_byteswritten",
            )
        ),
    ]


RUSAGE_INFO_V2 = 2  # the flavor argument of proc_pid_rusage

# --- pure parsers ---------------------------------------------------------------------


def parse_sysctl_int(text: str | None) -> int | None:
    """``sysctl -n NAME`` output → int; None when the OID is unknown (empty output)."""
    value = (text or "").strip()
    return int(value) if re.fullmatch(r"-?\d+", value) else None


def parse_vm_stat(text: str) -> VmStat:
    """``vm_stat`` output → page size, wired pages, page-outs, swap-outs.

    Lines are ``printf("%-30s %16llu.\\n")``: a label, padding, a count and a period.
    Swapins/Swapouts exist since OS X 10.9 (system_cmds-597); absent, they read 0.
    """
    header = re.search(r"page size of (\d+) bytes", text)
    if header is None:
        raise ValueError(f"not vm_stat output (no page size header): {text[:80]!r}")
    counts: dict[str, int] = {}
    for line in text.splitlines():
        m = re.match(r"^(.+?):\s+(\d+)\.$", line.strip())
        if m:
            counts[m.group(1)] = int(m.group(2))
    if "Pages wired down" not in counts:
        raise ValueError("vm_stat output has no 'Pages wired down:' line")
    return VmStat(
        page_size=int(header.group(1)),
        wired_pages=counts["Pages wired down"],
        pageouts=counts.get("Pageouts", 0),
        swapouts=counts.get("Swapouts", 0),
    )


def parse_memory_pressure(text: str) -> MemoryPressureSummary:
    """``memory_pressure -Q`` output → physical memory and the free percentage.

    "The system has 137438953472 (8388608 pages with a page size of 16384)." then
    "System-wide memory free percentage: 62%". Some recent releases are reported to
    print "The system has N bytes of physical memory." instead; both start alike.
    """
    total = re.search(r"The system has (\d+)", text)
    free = re.search(r"System-wide memory free percentage:\s*(\d+)%", text)
    return MemoryPressureSummary(
        total_bytes=int(total.group(1)) if total else None,
        free_percent=int(free.group(1)) if free else None,
    )


def pressure_from_level(level: int | None) -> PressureLevel:
    """``kern.memorystatus_vm_pressure_level`` → level; anything unlisted is unknown."""
    return PRESSURE_LEVELS.get(level, "unknown") if level is not None else "unknown"


def parse_mlx_device_info(info: Mapping[str, object]) -> int | None:
    """MLX device info → Metal's recommendedMaxWorkingSetSize, or None without Metal."""
    value = info.get("max_recommended_working_set_size")
    return value if isinstance(value, int) and value > 0 else None


def default_wired_limit(memsize: int) -> tuple[int, str]:
    """Estimate macOS's own wired limit when the sysctl is 0 and Metal cannot be asked.

    Apple does not document the heuristic. Measured recommendedMaxWorkingSetSize: 2/3 of
    RAM on a 16 GiB M4, ~74% on 24 GiB, ~84% on 128 GiB. We take 2/3 up to 36 GiB and
    3/4 above: at or below every measurement, because an estimate that errs low only
    shrinks the pool, while one that errs high can panic the host (wired memory past what
    macOS allows).
    """
    if memsize > 36 * GIB:
        return memsize * 3 // 4, "3/4 of hw.memsize (>36 GiB host)"
    return memsize * 2 // 3, "2/3 of hw.memsize (<=36 GiB host)"


def wired_ceiling(
    memsize: int,
    wired_limit: tuple[int, str] | None,
    mlx_recommended: int | None,
) -> tuple[int, str]:
    """Decide the ceiling and name its source; clamp a ceiling above RAM to RAM.

    ``wired_limit`` is (bytes, sysctl setting); 0 bytes means "macOS default", whose
    value Metal reports as recommendedMaxWorkingSetSize (MLX re-reads it live).
    """
    if wired_limit is not None and wired_limit[0] > 0:
        ceiling, source = wired_limit[0], f"sysctl {wired_limit[1]}"
    elif mlx_recommended is not None:
        ceiling = mlx_recommended
        source = "MLX max_recommended_working_set_size (wired limit 0: macOS default)"
    else:
        ceiling, how = default_wired_limit(memsize)
        source = f"estimated macOS default wired limit, {how}; Metal unavailable"
    if ceiling > memsize:
        source += f"; clamped to hw.memsize from {ceiling} B"
        ceiling = memsize
    return ceiling, source


def decode_rusage_info_v2(buf: bytes) -> int:
    """The ``ri_phys_footprint`` of a ``rusage_info_v2`` buffer, in bytes.

    phys_footprint is what Activity Monitor's "Memory" column and jetsam count: it
    includes compressed and GPU (IOKit) memory that RSS misses.
    """
    size = ctypes.sizeof(RusageInfoV2)
    if len(buf) < size:
        raise ValueError(f"rusage_info_v2 needs {size} bytes, got {len(buf)}")
    return int(RusageInfoV2.from_buffer_copy(bytes(buf[:size])).ri_phys_footprint)


# --- runners (macOS only) -------------------------------------------------------------


def run_command(argv: Sequence[str]) -> str | None:
    """stdout of ``argv``, or None if it is missing, fails or hangs."""
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def read_sysctl(name: str, run: Runner = run_command) -> int | None:
    return parse_sysctl_int(run([SYSCTL, "-n", name]))


def read_wired_limit(run: Runner = run_command) -> tuple[int, str] | None:
    """The GPU wired limit in bytes and the setting it came from; None on Intel Macs."""
    mib = read_sysctl("iogpu.wired_limit_mb", run)
    if mib is not None:
        return mib_to_bytes(mib), f"iogpu.wired_limit_mb={mib}"
    # macOS 13 Ventura named it debug.iogpu.wired_limit, in bytes (renamed in 14).
    raw = read_sysctl("debug.iogpu.wired_limit", run)
    return (raw, f"debug.iogpu.wired_limit={raw}") if raw is not None else None


def read_mlx_recommended_working_set() -> int | None:
    """Ask Metal, through MLX, for recommendedMaxWorkingSetSize (None without Metal).

    MLX is imported here and only here: probes is a leaf, and this is the one reading
    that nothing but Metal can give.
    """
    try:
        import mlx.core as mx
    except ImportError:
        return None
    try:
        if not mx.metal.is_available():
            return None
        # Older MLX has only mx.metal.device_info() (deprecated once mx.device_info came).
        info = mx.device_info() if hasattr(mx, "device_info") else mx.metal.device_info()
    except (AttributeError, RuntimeError):
        return None
    return parse_mlx_device_info(info)


def read_phys_footprint(pid: int) -> int:
    """phys_footprint of ``pid`` via libproc's proc_pid_rusage (macOS 10.9+)."""
    lib = ctypes.CDLL(
        ctypes.util.find_library("System") or "/usr/lib/libSystem.B.dylib", use_errno=True
    )
    fn = lib.proc_pid_rusage
    fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    buf = ctypes.create_string_buffer(ctypes.sizeof(RusageInfoV2))
    if fn(pid, RUSAGE_INFO_V2, buf) != 0:
        err = ctypes.get_errno()  # OSError maps ESRCH/EPERM to their subclasses
        raise OSError(err, f"proc_pid_rusage({pid}): {os.strerror(err)}")
    return decode_rusage_info_v2(buf.raw)


def read_snapshot(
    pid: int | None = None,
    *,
    run: Runner = run_command,
    footprint: Callable[[int], int] = read_phys_footprint,
    mlx_recommended: Callable[[], int | None] = read_mlx_recommended_working_set,
) -> MemorySnapshot:
    """One reading of the host's memory world and ``pid``'s footprint (default: self)."""
    summary_text = run([MEMORY_PRESSURE, "-Q"])
    summary = parse_memory_pressure(summary_text or "")
    memsize = read_sysctl("hw.memsize", run) or summary.total_bytes
    if not memsize:
        raise OSError("neither sysctl hw.memsize nor memory_pressure -Q gave the RAM size")

    wired_limit = read_wired_limit(run)
    mlx = mlx_recommended() if wired_limit is None or wired_limit[0] == 0 else None
    ceiling, source = wired_ceiling(memsize, wired_limit, mlx)

    vm_text = run([VM_STAT])
    if vm_text is None:
        raise OSError("vm_stat failed")
    vm = parse_vm_stat(vm_text)

    level = read_sysctl("kern.memorystatus_vm_pressure_level", run)
    detail = f"kern.memorystatus_vm_pressure_level={level}"
    if summary.free_percent is not None:
        detail += f"; memory_pressure free {summary.free_percent}%"

    return MemorySnapshot(
        platform="darwin",
        total_ram_bytes=memsize,
        ceiling_bytes=ceiling,
        ceiling_source=source,
        in_use_bytes=vm.wired_pages * vm.page_size,
        process_footprint_bytes=footprint(os.getpid() if pid is None else pid),
        pressure=pressure_from_level(level),
        pressure_detail=detail,
        # Pageouts (dirty pages written to their backing files) plus Swapouts
        # (compressed pages written to swap): any rise means memory left RAM for disk.
        page_outs=vm.pageouts + vm.swapouts,
    )
