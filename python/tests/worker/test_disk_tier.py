"""The disk tier's store (pure Python, real files): keys, checks, atomic writes, the LRU cap,
bad disks (a read-only directory, a full tmpfs mounted for the test)."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import time

import pytest

from plimsoll.worker.disk_tier import MAGIC, DiskStore, decode, encode, tier_key

pytestmark = pytest.mark.pure

KEY = tier_key("w" * 64, "float32", 16, 4096)


def h(i: int) -> bytes:
    return hashlib.sha256(f"block {i}".encode()).digest()


def payload(i: int, n: int = 4096) -> bytes:
    return bytes((i + j) % 251 for j in range(n))


def store(root, cap=1 << 20, **kw) -> DiskStore:
    return DiskStore(root, KEY, cap, **kw)


def test_round_trip_and_counters(tmp_path):
    s = store(tmp_path)
    assert s.put(h(1), payload(1))
    s.flush()
    assert h(1) in s and s.files == 1
    assert s.get(h(1)) == payload(1)
    assert s.get(h(2)) is None
    st = s.stats()
    assert (st["hits"], st["misses"], st["files_written"]) == (1, 1, 1)
    assert st["bytes_written"] == st["bytes_read"] == st["size_bytes"] > 4096
    assert not [p for p in s.dir.iterdir() if p.name.startswith(".tmp-")]
    s.close()


def test_the_key_separates_models_dtypes_and_block_sizes():
    keys = {tier_key("a", "float32", 16, 64), tier_key("b", "float32", 16, 64),
            tier_key("a", "float16", 16, 64), tier_key("a", "float32", 32, 64),
            tier_key("a", "float32", 16, 128)}
    assert len(keys) == 5


@pytest.mark.parametrize("damage", ["flip", "truncate", "key", "hash", "magic", "empty"])
def test_a_damaged_file_is_deleted_and_missed(tmp_path, damage):
    s = store(tmp_path)
    s.put(h(1), payload(1))
    s.flush()
    path = s.path(h(1))
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[-7] ^= 0xFF
    elif damage == "truncate":
        data = data[:-100]
    elif damage == "key":
        data = bytearray(encode(tier_key("other", "float32", 16, 4096), h(1), payload(1)))
    elif damage == "hash":
        data = bytearray(encode(KEY, h(2), payload(1)))
    elif damage == "magic":
        data[:len(MAGIC)] = b"X" * len(MAGIC)
    else:
        data = bytearray()
    path.write_bytes(bytes(data))
    assert s.get(h(1)) is None
    assert not path.exists() and h(1) not in s
    assert s.stats()["corrupt"] == 1 and s.stats()["size_bytes"] == 0
    s.close()


def test_decode_refuses_what_encode_did_not_make():
    blob = encode(KEY, h(1), payload(1))
    assert decode(blob, KEY, h(1)) == payload(1)
    assert decode(blob[:20], KEY, h(1)) is None
    assert decode(blob, KEY, h(3)) is None


def test_the_cap_holds_and_evicts_oldest_first(tmp_path):
    one = len(encode(KEY, h(0), payload(0)))
    s = store(tmp_path, cap=5 * one)
    for i in range(12):
        s.put(h(i), payload(i), wait=True)
        if i == 3:
            s.flush()
            assert s.get(h(0)) == payload(0)  # read: now the most recent
    s.flush()
    on_disk = sum(p.stat().st_size for p in s.dir.iterdir())
    assert on_disk <= 5 * one and s.size_bytes == on_disk and s.files == 5
    assert s.stats()["evicted_files"] == 7
    assert h(0) not in s and all(h(i) in s for i in range(7, 12))
    s.close()


def test_the_index_is_rebuilt_in_lru_order_and_temp_files_swept(tmp_path):
    one = len(encode(KEY, h(0), payload(0)))
    s = store(tmp_path, cap=10 * one)
    for i in range(4):
        s.put(h(i), payload(i), wait=True)
        s.flush()
        time.sleep(0.01)
    s.get(h(0))  # touched: survives the next trim
    s.close()
    (s.dir / ".tmp-999-1").write_bytes(b"half a file")
    t = store(tmp_path, cap=2 * one)
    assert t.files == 2 and h(0) in t and h(3) in t
    assert not (t.dir / ".tmp-999-1").exists()
    assert t.get(h(3)) == payload(3)
    t.close()


def test_a_full_buffer_drops_writes_without_waiting(tmp_path):
    s = store(tmp_path, buffer_bytes=4096)
    s._lock.acquire()  # the writer cannot take anything: the queue stays full
    try:
        s._queue.append((h(9), payload(9)))
        s._queued = 4096
    finally:
        s._lock.release()
    assert not s.put(h(1), payload(1))
    assert s.stats()["dropped_writes"] == 1
    with s._lock:
        s._room.notify_all()  # now the writer takes the queued block, and close() need not wait
    s.close()


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through read-only modes")
def test_an_unwritable_directory_turns_the_tier_off(tmp_path):
    s = store(tmp_path)
    s.dir.chmod(0o500)
    try:
        s.put(h(1), payload(1))
        s.flush()
        assert s.state == "off" and "EACCES" in s.reason
    finally:
        s.dir.chmod(0o700)
    s.close()


@pytest.fixture
def small_fs(tmp_path):
    """A real 1 MiB tmpfs (root only), unmounted after the test."""
    if os.geteuid() != 0 or not shutil.which("mount"):
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "small"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=0700", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    yield mnt
    subprocess.run(["umount", str(mnt)], check=False)


@pytest.mark.impure
def test_a_full_disk_turns_the_tier_off_with_one_reason(small_fs):
    s = store(small_fs, cap=64 << 20)  # the cap is larger than the disk
    for i in range(400):
        s.put(h(i), payload(i, 8192), wait=True)
    s.flush()
    st = s.stats()
    assert st["state"] == "off" and "ENOSPC" in st["reason"]
    assert not s.put(h(1000), payload(1))
    assert not [p for p in s.dir.iterdir() if p.name.startswith(".tmp-")]
    assert s.get(h(0)) is None  # off: every read misses, nothing raises
    s.close()


@pytest.mark.impure
def test_a_read_only_filesystem_turns_the_tier_off(small_fs):
    s = store(small_fs)
    subprocess.run(["mount", "-o", "remount,ro", str(small_fs)], check=True)
    try:
        s.put(h(1), payload(1))
        s.flush()
        assert s.state == "off" and "EROFS" in s.reason
    finally:
        subprocess.run(["mount", "-o", "remount,rw", str(small_fs)], check=False)
    s.close()


def test_the_policy_disk_cache_reaches_the_worker_flags(tmp_path):
    """diskCache: the model's own, else the host's, else off; launch's flags win."""
    from pathlib import Path

    from plimsoll.core.admission import AdmissionRequest, admit
    from plimsoll.core.model_facts import facts_from_config
    from plimsoll.core.policy import PolicyError, parse_policy
    from plimsoll.core.units import GIB, KIB, MIB
    from plimsoll.demo.model import PRESETS
    from plimsoll.launch.spawn import worker_argv, worker_config

    facts = facts_from_config({**PRESETS["tiny"], "torch_dtype": "float32"}, 10 * MIB)
    d = admit(AdmissionRequest(ceiling_bytes=8 * GIB, total_ram_bytes=8 * GIB,
                               budget_bytes=8 * GIB, weights_bytes=GIB,
                               kv_bytes_per_token=64 * KIB, transient_reserve=0.05,
                               block_tokens=16, concurrency=1, context=4096, max_tokens=256))
    base = {"schemaVersion": 1, "host": "h", "totalRamGb": 16, "osFloorGb": 4,
            "modes": {"standalone": {"maxLocalLlmGb": 8}, "clustered": {"maxLocalLlmGb": 8}},
            "diskCache": {"path": str(tmp_path / "host")},
            "models": {"a": {"path": "/a", "context": 8192},
                       "b": {"path": "/b", "context": 8192,
                             "diskCache": {"path": "~/kv-b", "maxGb": 2.5}}}}
    pol = parse_policy(base)

    def cfg(name, **kw):
        return worker_config(Path("/m"), name, facts, d, pol.models[name], pol, port=1, **kw)

    a, b = cfg("a"), cfg("b")
    assert (a.disk_cache_dir, a.disk_cache_gb) == (tmp_path / "host", 10)
    assert (b.disk_cache_dir, b.disk_cache_gb) == (Path("~/kv-b").expanduser(), 2.5)
    argv = worker_argv(b)
    assert argv[argv.index("--disk-cache-dir") + 1] == str(Path("~/kv-b").expanduser())
    assert argv[argv.index("--disk-cache-gb") + 1] == "2.5"
    flag = cfg("a", disk_cache_dir=tmp_path / "flag", disk_cache_gb=1.0)
    assert (flag.disk_cache_dir, flag.disk_cache_gb) == (tmp_path / "flag", 1.0)
    off = worker_config(Path("/m"), "m", facts, d, None, None, port=1)
    assert off.disk_cache_dir is None and "--disk-cache-dir" not in worker_argv(off)
    assert "--compile-decode" not in worker_argv(off)  # launch's flag passes through, else off
    assert "--compile-decode" in worker_argv(cfg("a", compile_decode=True))
    # the MTP head: on unless the flag or the policy entry says otherwise
    assert off.mtp and "--mtp" in worker_argv(off) and "--no-mtp" not in worker_argv(off)
    assert "--no-mtp" in worker_argv(cfg("a", mtp=False))
    no_head = parse_policy({**base, "models": {"a": {"path": "/a", "context": 8192,
                                                     "mtp": False}}})
    assert not worker_config(Path("/m"), "a", facts, d, no_head.models["a"], no_head,
                             port=1).mtp
    assert worker_config(Path("/m"), "a", facts, d, no_head.models["a"], no_head, port=1,
                         mtp=True).mtp
    with pytest.raises(PolicyError, match="maxGb"):
        parse_policy({**base, "diskCache": {"path": "/x", "maxGb": 0}})


def test_metrics_carry_the_disk_tier_per_model():
    from conftest import gauge_text

    disk = {"state": "off", "reason": "ENOSPC", "hits": 7, "misses": 2, "corrupt": 1,
            "bytes_read": 700, "bytes_written": 900, "files": 3, "size_bytes": 900,
            "cap_bytes": 1000}
    text = gauge_text({"m": {"disk": disk}, "n": {"disk": None}})
    assert 'plimsoll_disk_tier_hits{model="m"} 7.0' in text
    assert 'plimsoll_disk_tier_on{model="m"} 0.0' in text
    assert 'plimsoll_disk_tier_cap_bytes{model="m"} 1000.0' in text
    assert 'model="n"' not in "\n".join(x for x in text.splitlines() if "disk_tier" in x)
