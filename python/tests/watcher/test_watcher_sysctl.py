"""Ceiling writers (file: for real, darwin on a recorded-output runner) and the proxy
admin client's pure half."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from plimsoll.core.units import MIB
from plimsoll.watcher.proxy_client import answer_from_response, check_local_url, read_token
from plimsoll.watcher.sysctl import (
    MLX_CHECK,
    CeilingError,
    CeilingMismatch,
    Completed,
    DarwinSysctl,
    FileCeiling,
    mlx_recommended_bytes,
    open_writer,
    parse_sysctl_write,
    verify,
)

pytestmark = pytest.mark.pure

FIXTURES = Path(__file__).parents[1] / "fixtures" / "watcher"


# --- file: ------------------------------------------------------------------------------


def test_file_backend_writes_and_reads_back(tmp_path):
    w = open_writer(f"file:{tmp_path / 'ceiling'}")
    assert isinstance(w, FileCeiling) and w.read_mib() is None
    applied = w.write_mib(49152)
    assert (tmp_path / "ceiling").read_text() == "49152\n"
    assert (applied.mib, applied.read_back_mib, applied.mlx_bytes) == (49152, 49152, None)
    assert w.read_mib() == 49152
    assert list(tmp_path.iterdir()) == [tmp_path / "ceiling"]  # no temp file left behind


def test_file_backend_refuses_nonsense_and_reports_unwritable(tmp_path):
    w = FileCeiling(tmp_path / "c")
    for bad in (0, -1, True):
        with pytest.raises(CeilingError):
            w.write_mib(bad)
    ro = FileCeiling(tmp_path / "missing-dir" / "c")
    with pytest.raises(CeilingError, match="cannot write"):
        ro.write_mib(1024)


def test_file_backend_mismatch_is_an_error(tmp_path, monkeypatch):
    w = FileCeiling(tmp_path / "c")
    monkeypatch.setattr(w, "read_mib", lambda: 1023)  # something else rewrote it
    with pytest.raises(CeilingMismatch, match="read back 1023 MiB"):
        w.write_mib(1024)


@pytest.mark.parametrize("spec", ["", "file:", "sysfs:/x", "darwin2", "file:/no/such/dir/c"])
def test_bad_specs(spec):
    with pytest.raises(ValueError):
        open_writer(spec)


# --- darwin -----------------------------------------------------------------------------


class SysctlRunner:
    """Plays sysctl(8): ``-w`` answers from the fixture and stores the value; ``-n`` reads it."""

    def __init__(self, value=0, *, deny=False, stuck=False):
        self.value, self.deny, self.stuck, self.calls = value, deny, stuck, []

    def __call__(self, argv: Sequence[str]) -> Completed:
        self.calls.append(list(argv))
        assert argv[0] == "/usr/sbin/sysctl"
        if argv[1] == "-n":
            return Completed(0, f"{self.value}\n", "")
        name, _, new = argv[2].partition("=")
        if self.deny:
            return Completed(1, f"{name}: {self.value}", f"sysctl: {name}: Operation not "
                             "permitted\n")
        out = f"{name}: {self.value} -> {new}\n"
        if not self.stuck:
            self.value = int(new)
        return Completed(0, out, "")


def test_parse_sysctl_write_on_recorded_output():
    assert parse_sysctl_write((FIXTURES / "sysctl_w_iogpu_wired_limit_mb.txt").read_text()) \
        == (0, 49152)
    assert parse_sysctl_write("kern.x: 1 -> 2\n") is None


def test_darwin_writes_with_sysctl_w_and_reads_back_with_n():
    run = SysctlRunner()
    w = DarwinSysctl(run=run, mlx=lambda: 49152 * MIB)
    applied = w.write_mib(49152)
    assert run.calls == [["/usr/sbin/sysctl", "-w", "iogpu.wired_limit_mb=49152"],
                         ["/usr/sbin/sysctl", "-n", "iogpu.wired_limit_mb"]]
    assert applied.read_back_mib == 49152 and applied.mlx_bytes == 49152 * MIB
    assert "MLX max_recommended_working_set_size = 51539607552 B" in applied.detail


def test_darwin_without_root_fails_loudly():
    with pytest.raises(CeilingError, match=r"Operation not permitted.*root"):
        DarwinSysctl(run=SysctlRunner(deny=True), mlx=None).write_mib(49152)


def test_darwin_read_back_or_mlx_mismatch_is_an_error():
    with pytest.raises(CeilingMismatch):
        DarwinSysctl(run=SysctlRunner(stuck=True), mlx=None).write_mib(49152)
    with pytest.raises(CeilingMismatch, match="MLX reports"):
        DarwinSysctl(run=SysctlRunner(), mlx=lambda: 72 * 1024 * MIB).write_mib(49152)


def test_mlx_check_runs_in_a_fresh_interpreter_and_is_skipped_without_metal():
    seen = []

    def run(argv):
        seen.append(argv)
        return Completed(0, "\n", "")  # Linux/CPU MLX: no Metal, nothing to compare

    assert mlx_recommended_bytes(run) is None
    assert seen[0][1:] == ["-c", MLX_CHECK]
    assert mlx_recommended_bytes(lambda argv: Completed(0, "51539607552\n", "")) == 49152 * MIB
    assert mlx_recommended_bytes(lambda argv: Completed(1, "", "boom")) is None


@pytest.mark.impure
def test_mlx_check_script_runs_here(tmp_path):
    """The real script in a real interpreter: on Linux MLX has no Metal, so no value."""
    from plimsoll.watcher.sysctl import run_command

    assert mlx_recommended_bytes(run_command) is None


def test_verify():
    assert verify(1024, 1024, None, "x").read_back_mib == 1024
    with pytest.raises(CeilingMismatch, match="read back nothing"):
        verify(1024, None, None, "x")


# --- proxy client (pure) ----------------------------------------------------------------


def test_answers_map_to_statuses():
    a = answer_from_response("standalone", 200, {"mode": "standalone", "fits": True,
                                                 "in_use_bytes": 5, "envelope_bytes": 9})
    assert a.ok and (a.in_use_bytes, a.envelope_bytes, a.proxy_mode) == (5, 9, "standalone")
    r = answer_from_response("standalone", 409, {
        "error": {"message": "cannot evict in time"}, "mode": "clustered", "fits": False,
        "in_use_bytes": 10, "envelope_bytes": 9})
    assert r.status == "refused" and not r.ok and r.detail == "cannot evict in time"
    assert "HTTP 409" in r.describe() and "envelope" in r.describe()
    assert answer_from_response("clustered", 401, {"error": "bad token"}).status \
        == "unauthorized"
    assert answer_from_response("clustered", 400, None).status == "rejected"
    assert not answer_from_response("clustered", 200, {"mode": "standalone"}).ok
    assert answer_from_response("clustered", 200, {"mode": "clustered", "fits": False}).status \
        == "refused"


@pytest.mark.parametrize("url", ["http://127.0.0.1:8080", "http://localhost:1/",
                                 "http://[::1]:8080", "http://127.0.0.2:9"])
def test_loopback_urls_are_accepted(url):
    assert check_local_url(url) == url.rstrip("/")


@pytest.mark.parametrize("url", ["http://10.0.0.1:8080", "http://example.com", "ftp://127.0.0.1",
                                 "127.0.0.1:8080", "http://0.0.0.0:8080"])
def test_other_urls_are_refused(url):
    with pytest.raises(ValueError):
        check_local_url(url)


def test_token_file(tmp_path):
    (tmp_path / "t").write_text("s3cret\n")
    assert read_token(str(tmp_path / "t")) == "s3cret"
    (tmp_path / "e").write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        read_token(str(tmp_path / "e"))
    with pytest.raises(ValueError):
        read_token(str(tmp_path / "missing"))
