"""Every directory plimsoll keeps its files in is this user's alone (created 0700, refused
with the reason otherwise), and a KV block file is used only when its checksum and its key
match: real directories, real files, ``plimsoll serve`` as a process."""

from __future__ import annotations

import hashlib
import json
import os
import stat
import subprocess
import sys

import pytest

from plimsoll.core.paths import UnsafeDirectory, private_dir
from plimsoll.launch.calibration import Measurement, save_measurement
from plimsoll.proxy.admin import load_or_create_token
from plimsoll.worker.disk_tier import DiskStore, encode, tier_key

KEY = tier_key("w" * 64, "float32", 16, 4096)
OTHER_KEYS = [tier_key("x" * 64, "float32", 16, 4096), tier_key("w" * 64, "bfloat16", 16, 4096),
              tier_key("w" * 64, "float32", 32, 4096), tier_key("w" * 64, "float32", 16, 8192)]
NOBODY = 65534


def mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def h(i: int) -> bytes:
    return hashlib.sha256(f"block {i}".encode()).digest()


def test_missing_directories_are_created_0700_whatever_the_umask(tmp_path):
    old = os.umask(0)
    try:
        made = private_dir(tmp_path / "a" / "b" / "c")
    finally:
        os.umask(old)
    assert made.is_dir()
    for d in (tmp_path / "a", tmp_path / "a" / "b", made):
        assert mode(d) == 0o700, d
    assert private_dir(made) == made  # an existing private one is used as it is


@pytest.mark.parametrize("bits", [0o755, 0o750, 0o705, 0o770, 0o777, 0o1777])
def test_wider_permissions_are_refused_with_the_fix(tmp_path, bits):
    d = tmp_path / "shared"
    d.mkdir()
    d.chmod(bits)
    with pytest.raises(UnsafeDirectory) as err:
        private_dir(d, "KV blocks")
    msg = str(err.value)
    assert str(d) in msg and f"{stat.S_IMODE(bits):04o}" in msg and "KV blocks" in msg
    assert f"chmod 700 {d}" in msg
    assert mode(d) == stat.S_IMODE(bits)  # refused, never silently changed


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a directory away needs root")
def test_another_owner_is_refused(tmp_path):
    d = tmp_path / "theirs"
    d.mkdir(mode=0o700)
    os.chown(d, NOBODY, NOBODY)
    with pytest.raises(UnsafeDirectory, match=f"belongs to uid {NOBODY}, not to this user"):
        private_dir(d)


def test_a_file_or_a_dangling_link_is_refused(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(UnsafeDirectory, match="is not a directory"):
        private_dir(tmp_path / "file")
    (tmp_path / "link").symlink_to(tmp_path / "nowhere")
    with pytest.raises(UnsafeDirectory, match="a link to nothing"):
        private_dir(tmp_path / "link")


def test_under_the_cache_the_root_is_checked_too(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    root.mkdir(mode=0o755)
    root.chmod(0o755)
    monkeypatch.setenv("PLIMSOLL_CACHE", str(root))
    with pytest.raises(UnsafeDirectory, match=f"{root} has mode 0755"):
        private_dir(root / "calibration")
    assert not (root / "calibration").exists() or mode(root / "calibration") == 0o700
    root.chmod(0o700)
    assert mode(private_dir(root / "calibration")) == 0o700


def test_the_admin_token_and_calibration_records_go_in_private_dirs(tmp_path, monkeypatch):
    monkeypatch.setenv("PLIMSOLL_CACHE", str(tmp_path / "cache"))
    token, path = load_or_create_token(None, tmp_path / "cache" / "admin-token")
    assert token and mode(path.parent) == 0o700 and mode(path) == 0o600
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o755)
    with pytest.raises(UnsafeDirectory):
        load_or_create_token(None, shared / "admin-token")
    assert not (shared / "admin-token").exists()
    facts = type("Facts", (), {"kv_format": "float32"})()
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "model.safetensors").write_bytes(
        (2).to_bytes(8, "little") + b"{}")
    m = Measurement(concurrency=1, context=64, prompt_tokens=48, max_tokens=16,
                    weights_bytes=1, kv_bytes_peak=0, mlx_peak_bytes=1, rss_hwm_bytes=1,
                    cgroup_max_usage_bytes=None, peak_bytes=1, reserve_bytes=0,
                    formula_footprint_bytes=1, requests_ok=1, seconds=1.0, at="now")
    saved = save_measurement("k" * 32, facts, tmp_path / "model", m, root=tmp_path / "cal")
    assert mode(saved.parent) == 0o700 and json.loads(saved.read_text())["runs"]
    (shared / "calibration").mkdir(mode=0o777)
    (shared / "calibration").chmod(0o777)
    with pytest.raises(UnsafeDirectory, match="calibration records"):
        save_measurement("k" * 32, facts, tmp_path / "model", m, root=shared)


# --- the disk tier ----------------------------------------------------------------------
def test_the_disk_tier_makes_its_directories_private(tmp_path):
    s = DiskStore(tmp_path / "kv", KEY, 1 << 20)
    assert s.state == "on" and mode(tmp_path / "kv") == mode(s.dir) == 0o700
    assert s.put(h(1), b"\1" * 4096)
    s.flush()
    assert mode(s.path(h(1))) == 0o600
    s.close()


@pytest.mark.parametrize("where", ["root", "key"])
def test_a_disk_tier_others_can_reach_stays_off_with_the_reason(tmp_path, where):
    root = tmp_path / "kv"
    (root / KEY).mkdir(parents=True, mode=0o700)
    root.chmod(0o700)
    (root if where == "root" else root / KEY).chmod(0o755)
    s = DiskStore(root, KEY, 1 << 20)
    try:
        assert s.state == "off" and "mode 0755" in s.reason and "chmod 700" in s.reason
        assert not s.put(h(1), b"\1" * 4096) and s.get(h(1)) is None
    finally:
        s.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a directory away needs root")
def test_a_disk_tier_of_another_owner_stays_off(tmp_path):
    (tmp_path / "kv" / KEY).mkdir(parents=True, mode=0o700)
    (tmp_path / "kv").chmod(0o700)
    os.chown(tmp_path / "kv" / KEY, NOBODY, NOBODY)
    s = DiskStore(tmp_path / "kv", KEY, 1 << 20)
    assert s.state == "off" and f"uid {NOBODY}" in s.reason
    s.close()


@pytest.mark.parametrize("other", OTHER_KEYS, ids=["weights", "dtype", "block-tokens",
                                                   "block-bytes"])
def test_a_block_written_under_another_key_is_never_used(tmp_path, other):
    """A file from another model, dtype or block size, put where this key looks for it
    (copied over, or written with this key's name), fails the key check and is deleted."""
    theirs = DiskStore(tmp_path / "kv", other, 1 << 20)
    theirs.put(h(1), b"\2" * 4096)
    theirs.close()
    ours = DiskStore(tmp_path / "kv", KEY, 1 << 20)
    ours.close()
    (ours.dir / theirs.path(h(1)).name).write_bytes(theirs.path(h(1)).read_bytes())
    s = DiskStore(tmp_path / "kv", KEY, 1 << 20)
    assert h(1) in s  # indexed by name ...
    assert s.get(h(1)) is None  # ... but never trusted
    assert s.stats()["corrupt"] == 1 and not s.path(h(1)).exists()
    s.close()


def test_a_tampered_block_with_a_recomputed_header_is_refused_unless_whole(tmp_path):
    s = DiskStore(tmp_path / "kv", KEY, 1 << 20)
    s.put(h(1), b"\3" * 4096)
    s.flush()
    blob = bytearray(s.path(h(1)).read_bytes())
    blob[-1] ^= 1  # one bit of the payload
    s.path(h(1)).write_bytes(bytes(blob))
    assert s.get(h(1)) is None and s.stats()["corrupt"] == 1
    s.path(h(1)).write_bytes(encode(KEY, h(1), b"\4" * 4096))  # a whole file of this key
    s.close()
    t = DiskStore(tmp_path / "kv", KEY, 1 << 20)
    assert t.get(h(1)) == b"\4" * 4096
    t.close()


def test_links_and_fifos_named_like_blocks_are_not_indexed(tmp_path):
    s = DiskStore(tmp_path / "kv", KEY, 1 << 20)
    s.close()
    os.mkfifo(s.path(h(1)))
    s.path(h(2)).symlink_to("/dev/zero")
    t = DiskStore(tmp_path / "kv", KEY, 1 << 20)
    assert h(1) not in t and h(2) not in t and t.get(h(1)) is None
    t.close()


# --- plimsoll serve refuses at start ------------------------------------------------------
def serve(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "plimsoll.cli", "serve", *args, "--port", "1"],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, **env})


def policy(tmp_path, tiny_model, **extra):
    path = tmp_path / "policy.json"
    path.write_text(json.dumps({
        "schemaVersion": 1, "host": "box", "totalRamGb": 64, "osFloorGb": 4,
        "modes": {"standalone": {"maxLocalLlmGb": 4}},
        "models": {"tiny": {"path": str(tiny_model), "context": 1024, "maxTokens": 64}},
        **extra}))
    return path


def test_serve_refuses_a_cache_others_can_reach(tmp_path, tiny_model):
    cache = tmp_path / "cache"
    cache.mkdir()
    cache.chmod(0o755)
    done = serve("--policy", str(policy(tmp_path, tiny_model)),
                 env={"PLIMSOLL_CACHE": str(cache)})
    assert done.returncode == 2, done.stderr
    assert f"{cache} has mode 0755" in done.stderr and "chmod 700" in done.stderr
    assert not (cache / "admin-token").exists()


def test_serve_refuses_a_disk_tier_others_can_reach(tmp_path, tiny_model):
    kv = tmp_path / "kv"
    kv.mkdir()
    kv.chmod(0o777)
    done = serve("--policy", str(policy(tmp_path, tiny_model, diskCache={"path": str(kv)})),
                 env={"PLIMSOLL_CACHE": str(tmp_path / "cache")})
    assert done.returncode == 2, done.stderr
    assert "diskCache of model 'tiny'" in done.stderr and f"{kv} has mode 0777" in done.stderr
