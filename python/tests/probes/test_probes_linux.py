"""Linux probe: parsers on fixture files, snapshots on fixture trees, and for real.

The real tests create memory cgroups (cgroup v1, as root) and move a child Python into
them: the ceiling a process reports must be exactly the limit the kernel enforces on it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from plimsoll.core.units import GIB, KIB, MIB
from plimsoll.probes import MemorySnapshot, linux, read_snapshot

pytestmark = pytest.mark.pure

FIXTURES = Path(__file__).parents[1] / "fixtures" / "linux"
PACKAGE_DIR = Path(__file__).resolve().parents[2]
V1_MEMORY = Path("/sys/fs/cgroup/memory")
SENTINEL_4K = 9223372036854771712  # PAGE_COUNTER_MAX * 4096
SENTINEL_64K = 9223372036854710272  # PAGE_COUNTER_MAX * 65536 (arm64 64 KiB pages)
CID = "/docker/6b3c1f7a0d2e9f4b8a1c5d7e3f2a4b6c8d0e1f3a5b7c9d1e3f5a7b9c1d3e5f7a"


def fx(tree: str, path: str) -> str:
    return (FIXTURES / tree / path).read_text()


# --- parsers --------------------------------------------------------------------------


def test_parse_meminfo_converts_kb_and_keeps_unitless_counts() -> None:
    mem = linux.parse_meminfo(fx("v1_hybrid_nested_limit", "proc/meminfo"))
    assert mem["MemTotal"] == 24684092 * KIB
    assert mem["MemAvailable"] == 24322128 * KIB
    assert mem["HugePages_Total"] == 0  # no "kB": a page count, not scaled


@pytest.mark.parametrize(
    ("tree", "v1", "v2"),
    [
        ("v1_hybrid_nested_limit", "/plimsoll/worker", "/"),
        ("v2_service_limit", None, "/system.slice/plimsoll-worker.service"),
        ("v1_docker_no_cgroupns", CID, "/system.slice/containerd.service"),
        ("v1_old_kernel_no_psi_no_memavailable", "/user.slice", None),
    ],
)
def test_parse_proc_cgroup(tree: str, v1: str | None, v2: str | None) -> None:
    paths = linux.parse_proc_cgroup(fx(tree, "proc/self/cgroup"))
    assert (paths.get("v1"), paths.get("v2")) == (v1, v2)


def test_parse_proc_cgroup_ignores_controller_lists_without_memory() -> None:
    text = "7:cpu,cpuacct:/a\n9:net_cls,net_prio:/b\n1:name=systemd:/c\n"
    assert linux.parse_proc_cgroup(text) == {}


def test_parse_mountinfo_real_hybrid_host() -> None:
    mounts = linux.parse_mountinfo(fx("v1_hybrid_nested_limit", "proc/self/mountinfo"))
    assert mounts == {
        "v1": linux.Mount("/", "/sys/fs/cgroup/memory"),
        "v2": linux.Mount("/", "/sys/fs/cgroup/unified"),
    }


def test_parse_mountinfo_docker_and_pure_v2() -> None:
    docker = linux.parse_mountinfo(fx("v1_docker_no_cgroupns", "proc/self/mountinfo"))
    assert docker["v1"] == linux.Mount(CID, "/sys/fs/cgroup/memory")
    v2 = linux.parse_mountinfo(fx("v2_service_limit", "proc/self/mountinfo"))
    assert v2 == {"v2": linux.Mount("/", "/sys/fs/cgroup")}


def test_parse_mountinfo_unescapes_octal() -> None:
    line = "40 31 0:38 / /mnt/my\\040cgroups rw,relatime shared:9 - cgroup2 cgroup2 rw\n"
    assert linux.parse_mountinfo(line) == {"v2": linux.Mount("/", "/mnt/my cgroups")}


@pytest.mark.parametrize(
    ("text", "expected"),
    [(f"{SENTINEL_4K}\n", None), (f"{SENTINEL_64K}\n", None), ("536870912\n", 512 * MIB)],
)
def test_parse_v1_limit(text: str, expected: int | None) -> None:
    assert linux.parse_v1_limit(text) == expected


def test_parse_v2_limit() -> None:
    assert linux.parse_v2_limit("max\n") is None
    assert linux.parse_v2_limit("4294967296\n") == 4 * GIB


def test_parse_psi_fixture() -> None:
    psi = linux.parse_psi(fx("v2_service_limit", "proc/pressure/memory"))
    assert psi == linux.Psi(some_avg10=30.12, full_avg10=6.0)


def test_parse_psi_rejects_text_without_some() -> None:
    with pytest.raises(ValueError):
        linux.parse_psi("full avg10=1.00 avg60=0.00 avg300=0.00 total=1\n")


@pytest.mark.parametrize(
    ("some", "full", "level"),
    [
        (0.0, 0.0, "normal"),
        (9.99, 4.99, "normal"),
        (10.0, 0.0, "warn"),
        (24.99, 4.99, "warn"),
        (25.0, 0.0, "critical"),
        (0.5, 5.0, "critical"),
        (3.0, None, "normal"),
    ],
)
def test_psi_level_default_thresholds(some: float, full: float | None, level: str) -> None:
    assert linux.psi_level(linux.Psi(some, full)) == level


def test_psi_level_thresholds_are_parameters() -> None:
    psi = linux.Psi(some_avg10=12.5, full_avg10=1.2)
    assert linux.psi_level(psi) == "warn"
    assert linux.psi_level(psi, linux.PsiThresholds(warn_some=20.0)) == "normal"
    assert linux.psi_level(psi, linux.PsiThresholds(critical_full=1.0)) == "critical"


def test_parse_vmstat_pswpout() -> None:
    assert linux.parse_vmstat_pswpout(fx("v1_hybrid_nested_limit", "proc/vmstat")) == 1234
    assert linux.parse_vmstat_pswpout("pswpin 3\npgfault 9\n") == 0


def test_parse_status_vmrss() -> None:
    status = fx("v1_hybrid_nested_limit", "proc/self/status")
    assert linux.parse_status_vmrss(status) == 1536000 * KIB
    assert linux.parse_status_vmrss(fx("status", "kthreadd_status.txt")) == 0


def test_cgroup_levels_walk_up_to_the_mount_root() -> None:
    mount = linux.Mount("/", "/sys/fs/cgroup/memory")
    assert linux.cgroup_levels(mount, "/a/b") == [
        ("/a/b", "/sys/fs/cgroup/memory/a/b"),
        ("/a", "/sys/fs/cgroup/memory/a"),
        ("/", "/sys/fs/cgroup/memory"),
    ]


def test_cgroup_levels_container_root_maps_to_mount_point() -> None:
    mount = linux.Mount(CID, "/sys/fs/cgroup/memory")
    assert linux.cgroup_levels(mount, CID) == [(CID, "/sys/fs/cgroup/memory")]
    assert linux.cgroup_levels(mount, CID + "/inner") == [
        (CID + "/inner", "/sys/fs/cgroup/memory/inner"),
        (CID, "/sys/fs/cgroup/memory"),
    ]
    assert linux.cgroup_levels(mount, "/elsewhere") == [(CID, "/sys/fs/cgroup/memory")]


def test_cgroup_ceiling_decisions() -> None:
    mem = {"MemTotal": 16 * GIB, "MemAvailable": 10 * GIB}
    assert linux.cgroup_ceiling(mem, None) == (
        16 * GIB,
        "MemTotal (no cgroup memory limit)",
        6 * GIB,
    )
    at_ram = linux.CgroupLimit("v2", "/a", "/a", 16 * GIB, 1 * GIB)
    assert linux.cgroup_ceiling(mem, at_ram) == (16 * GIB, "cgroup v2 memory.max of /a", GIB)
    above = linux.CgroupLimit("v1", "/a", "/a/b", 32 * GIB, 1 * GIB)
    ceiling, source, in_use = linux.cgroup_ceiling(mem, above)
    assert (ceiling, in_use) == (16 * GIB, 6 * GIB)
    assert source == f"MemTotal (cgroup v1 memory.limit_in_bytes of /a = {32 * GIB} B; clamped)"
    no_usage = linux.CgroupLimit("v1", "/a", "/a", 4 * GIB, None)
    assert linux.cgroup_ceiling(mem, no_usage)[2] == 6 * GIB


# --- snapshots on fixture trees -------------------------------------------------------


def snap(
    tree: str, thresholds: linux.PsiThresholds = linux.DEFAULT_PSI_THRESHOLDS
) -> MemorySnapshot:
    return linux.read_snapshot(root=str(FIXTURES / tree), thresholds=thresholds)


def test_snapshot_v1_limit_on_parent_binds_the_unlimited_child() -> None:
    s = snap("v1_hybrid_nested_limit")
    assert s.platform == "linux"
    assert s.ceiling_bytes == s.total_ram_bytes == 8 * GIB
    assert s.ceiling_source == (
        "cgroup v1 memory.limit_in_bytes of /plimsoll (ancestor of /plimsoll/worker)"
    )
    assert s.in_use_bytes == 2 * GIB  # the limiting cgroup's usage, not the leaf's
    assert (s.pressure, s.page_outs) == ("warn", 1234)
    assert s.pressure_detail == "PSI memory some avg10=12.50 full avg10=1.20"
    assert s.process_footprint_bytes == 1536000 * KIB


def test_snapshot_psi_thresholds_pass_through() -> None:
    assert snap("v1_hybrid_nested_limit", linux.PsiThresholds(warn_some=20.0)).pressure == "normal"


def test_snapshot_v2_service_limit() -> None:
    s = snap("v2_service_limit")
    assert s.ceiling_bytes == s.total_ram_bytes == 4 * GIB
    assert s.ceiling_source == "cgroup v2 memory.max of /system.slice/plimsoll-worker.service"
    assert s.in_use_bytes == 3 * GIB
    assert s.pressure == "critical"  # full avg10=6.00 >= 5
    assert s.page_outs == 0


def test_snapshot_docker_without_cgroupns() -> None:
    s = snap("v1_docker_no_cgroupns")
    assert s.ceiling_bytes == s.total_ram_bytes == 2 * GIB
    assert s.ceiling_source == f"cgroup v1 memory.limit_in_bytes of {CID}"
    assert s.in_use_bytes == 734003200
    assert (s.pressure, s.page_outs) == ("normal", 77)


def test_snapshot_clamps_a_limit_above_memtotal() -> None:
    s = snap("v2_limit_above_memtotal_no_mountinfo")
    mem_total, available = 24684092 * KIB, 24322128 * KIB
    assert s.ceiling_bytes == s.total_ram_bytes == mem_total
    assert "clamped" in s.ceiling_source and "/user.slice" in s.ceiling_source
    assert str(64 * GIB) in s.ceiling_source
    assert s.in_use_bytes == mem_total - available


def test_snapshot_old_kernel_without_psi_or_memavailable() -> None:
    s = snap("v1_old_kernel_no_psi_no_memavailable")
    assert s.ceiling_bytes == s.total_ram_bytes == 8009180 * KIB
    assert s.ceiling_source == "MemTotal (no cgroup memory limit)"
    assert s.in_use_bytes == (8009180 - 512340 - 102400 - 2048000) * KIB
    assert s.pressure == "unknown" and "4.20" in s.pressure_detail
    assert s.page_outs == 27373


def test_snapshot_of_a_missing_pid_raises() -> None:
    with pytest.raises(ProcessLookupError):
        linux.read_snapshot(pid=4194304, root=str(FIXTURES / "v2_service_limit"))


# --- for real, on this machine --------------------------------------------------------


def test_real_snapshot_agrees_with_psutil() -> None:
    s = read_snapshot()
    vm = psutil.virtual_memory()
    assert s.platform == "linux"
    assert s.total_ram_bytes == s.ceiling_bytes <= vm.total
    if "no cgroup" in s.ceiling_source:
        assert s.ceiling_bytes == vm.total
    rss = psutil.Process().memory_info().rss
    assert abs(s.process_footprint_bytes - rss) < 64 * MIB
    assert (s.pressure == "unknown") != os.access("/proc/pressure/memory", os.R_OK)
    assert s.page_outs * 4096 <= psutil.swap_memory().sout + 4096 * 1024


def test_real_snapshot_of_a_missing_pid_raises() -> None:
    with pytest.raises(ProcessLookupError):
        read_snapshot(pid=2**22 + 1)  # above the kernel's pid_max ceiling


def _require_v1_memory_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("creating memory cgroups needs root")
    if not (V1_MEMORY / "memory.limit_in_bytes").exists():
        pytest.skip("no cgroup v1 memory controller at /sys/fs/cgroup/memory")


@contextlib.contextmanager
def v1_cgroup(rel: str, limit: int | None = None) -> Iterator[Path]:
    """Create /sys/fs/cgroup/memory/<rel> (with an optional limit); rmdir it afterwards."""
    path = V1_MEMORY / rel
    path.mkdir()
    try:
        if limit is not None:
            (path / "memory.limit_in_bytes").write_text(str(limit))
        yield path
    finally:
        for _ in range(50):  # a just-killed task can keep the cgroup busy briefly
            try:
                path.rmdir()
                break
            except OSError as e:
                if e.errno != errno.EBUSY:
                    raise
                time.sleep(0.1)


CHILD = (
    "import sys\n"
    "sys.stdin.readline()\n"  # wait until the parent has moved us into the cgroup
    "from plimsoll.probes import read_snapshot\n"
    "print(read_snapshot().model_dump_json(), flush=True)\n"
    "sys.stdin.readline()\n"  # stay alive so the parent can probe us by pid
)


def snapshot_from_child_in(cgroup: Path) -> tuple[MemorySnapshot, MemorySnapshot]:
    """Start a child Python, move it into ``cgroup``, return (its snapshot, ours of it)."""
    env = {**os.environ, "PYTHONPATH": str(PACKAGE_DIR)}
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert child.stdin is not None and child.stdout is not None
        (cgroup / "cgroup.procs").write_text(str(child.pid))
        child.stdin.write("go\n")
        child.stdin.flush()
        own = MemorySnapshot.model_validate_json(child.stdout.readline())
        by_pid = linux.read_snapshot(pid=child.pid)
        return own, by_pid
    finally:
        child.kill()
        child.wait(timeout=30)


@pytest.mark.impure
def test_real_v1_cgroup_limit_is_the_ceiling() -> None:
    _require_v1_memory_root()
    name = f"plimsoll-test-{uuid.uuid4().hex[:12]}"
    with v1_cgroup(name, limit=512 * MIB) as cg:
        assert (cg / "memory.limit_in_bytes").read_text().strip() == str(512 * MIB)
        own, by_pid = snapshot_from_child_in(cg)
    for s in (own, by_pid):
        assert s.ceiling_bytes == 512 * MIB
        assert s.total_ram_bytes == s.ceiling_bytes
        assert s.ceiling_source == f"cgroup v1 memory.limit_in_bytes of /{name}"
        assert 0 < s.in_use_bytes <= 512 * MIB
        assert s.process_footprint_bytes > 0
    assert by_pid.process_footprint_bytes < 512 * MIB  # the child's RSS, not ours


@pytest.mark.impure
def test_real_v1_parent_limit_binds_an_unlimited_child() -> None:
    _require_v1_memory_root()
    name = f"plimsoll-test-{uuid.uuid4().hex[:12]}"
    with v1_cgroup(name, limit=512 * MIB), v1_cgroup(f"{name}/worker") as child_cg:
        assert int((child_cg / "memory.limit_in_bytes").read_text()) >= 2**62  # no limit
        own, by_pid = snapshot_from_child_in(child_cg)
    for s in (own, by_pid):
        assert s.ceiling_bytes == s.total_ram_bytes == 512 * MIB
        assert s.ceiling_source == (
            f"cgroup v1 memory.limit_in_bytes of /{name} (ancestor of /{name}/worker)"
        )


@pytest.mark.impure
def test_real_v1_child_limit_below_the_parent_binds() -> None:
    _require_v1_memory_root()
    name = f"plimsoll-test-{uuid.uuid4().hex[:12]}"
    with (
        v1_cgroup(name, limit=512 * MIB),
        v1_cgroup(f"{name}/worker", limit=256 * MIB) as child_cg,
    ):
        own, _ = snapshot_from_child_in(child_cg)
    assert own.ceiling_bytes == own.total_ram_bytes == 256 * MIB
    assert own.ceiling_source == f"cgroup v1 memory.limit_in_bytes of /{name}/worker"


def test_snapshot_pressure_levels_are_the_tripwires_defaults() -> None:
    from plimsoll.core.policy import Pressure

    p = Pressure()
    policy_lines = linux.PsiThresholds(p.some_avg10_warn, p.some_avg10_critical,
                                       p.full_avg10_critical)
    assert policy_lines == linux.DEFAULT_PSI_THRESHOLDS
