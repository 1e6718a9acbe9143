"""Link readers: the macOS ifconfig parser on recorded output, the Linux sysfs reader for
real (on a fixture tree and on this host's loopback)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from plimsoll.watcher import link
from plimsoll.watcher.link import (
    LinkState,
    SysfsLink,
    check_interface_name,
    darwin_link_state,
    linux_link_state,
    parse_ifconfig,
    parse_ifconfig_run,
)

pytestmark = pytest.mark.pure

FIXTURES = Path(__file__).parents[1] / "fixtures" / "watcher"


def fx(name: str) -> str:
    return (FIXTURES / name).read_text()


# --- macOS ------------------------------------------------------------------------------


def test_bridge_with_a_peer_is_up():
    ifc = parse_ifconfig(fx("ifconfig_bridge0_active.txt"))
    assert ifc.name == "bridge0" and ifc.flags == 0x8863 and ifc.status == "active"
    assert {"UP", "RUNNING"} <= ifc.flag_names and ifc.members == ("en1", "en2")
    state = darwin_link_state(ifc)
    assert state.up is True
    assert "status=active" in state.detail and "members=en1,en2" in state.detail


def test_bridge_without_a_cable_is_down_although_up_and_running():
    ifc = parse_ifconfig(fx("ifconfig_bridge0_inactive.txt"))
    assert {"UP", "RUNNING"} <= ifc.flag_names and ifc.status == "inactive"
    assert darwin_link_state(ifc).up is False


def test_bridge_administratively_down_is_down():
    ifc = parse_ifconfig(fx("ifconfig_bridge0_admin_down.txt"))
    assert ifc.flags == 0x8822 and "UP" not in ifc.flag_names
    assert darwin_link_state(ifc).up is False


def test_thunderbolt_port_and_loopback():
    en2 = parse_ifconfig(fx("ifconfig_en2_active.txt"))
    assert en2.flags == 0x8963 and darwin_link_state(en2).up is True
    lo0 = parse_ifconfig(fx("ifconfig_lo0.txt"))
    assert lo0.status is None and darwin_link_state(lo0).up is True  # flags decide


def test_flag_hex_matches_the_names_in_every_fixture():
    bits = {"UP": 0x1, "BROADCAST": 0x2, "LOOPBACK": 0x8, "SMART": 0x20, "RUNNING": 0x40,
            "PROMISC": 0x100, "SIMPLEX": 0x800, "MULTICAST": 0x8000}
    for path in FIXTURES.glob("ifconfig_*.txt"):
        ifc = parse_ifconfig(path.read_text())
        assert sum(bits[n] for n in ifc.flag_names) == ifc.flags, path.name


def test_only_the_first_block_counts():
    text = fx("ifconfig_bridge0_inactive.txt") + fx("ifconfig_en2_active.txt")
    ifc = parse_ifconfig(text)
    assert ifc.name == "bridge0" and ifc.status == "inactive"


def test_missing_interface_is_down_and_other_failures_raise():
    assert parse_ifconfig_run(1, "", fx("ifconfig_bridge0_missing.stderr")) is None
    assert darwin_link_state(None) == LinkState(False, "interface does not exist")
    with pytest.raises(OSError):
        parse_ifconfig_run(1, "", "ifconfig: socket: Operation not permitted\n")
    with pytest.raises(ValueError):
        parse_ifconfig("garbage\n")


@pytest.mark.impure
def test_ifconfig_reader_runs_the_command(tmp_path):
    """The reader's runner half, with a stand-in ifconfig that prints a fixture."""
    script = tmp_path / "ifconfig"
    script.write_text(f"#!/bin/sh\n[ \"$1\" = bridge0 ] && exec cat {FIXTURES}/"
                      "ifconfig_bridge0_active.txt\n"
                      f"cat {FIXTURES}/ifconfig_bridge0_missing.stderr >&2; exit 1\n")
    script.chmod(0o755)
    assert link.IfconfigLink("bridge0", ifconfig=str(script)).read().up is True
    assert link.IfconfigLink("bridge9", ifconfig=str(script)).read() == LinkState(
        False, "interface does not exist")
    broken = link.IfconfigLink("bridge0", ifconfig=str(tmp_path / "nope")).read()
    assert broken.up is False and "unreadable" in broken.detail


# --- Linux ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("exists", "carrier", "operstate", "up"),
    [
        (True, "1\n", "up\n", True),
        (True, "0\n", "lowerlayerdown\n", False),  # veth whose peer is down
        (True, None, "down\n", False),  # admin down: reading carrier fails (EINVAL)
        (True, "1\n", "unknown\n", True),  # loopback, tun
        (True, "1\n", "dormant\n", False),
        (True, "0\n", "unknown\n", False),
        (False, None, None, False),
    ],
)
def test_linux_link_state(exists, carrier, operstate, up):
    assert linux_link_state(exists, carrier, operstate).up is up


def test_sysfs_reader_on_a_fixture_tree(tmp_path):
    d = tmp_path / "vA"
    d.mkdir()
    (d / "carrier").write_text("1\n")
    (d / "operstate").write_text("up\n")
    r = SysfsLink("vA", root=str(tmp_path))
    try:
        assert r.read() == LinkState(True, "carrier=1 operstate=up")
        (d / "operstate").write_text("lowerlayerdown\n")
        assert r.read().up is False
        assert SysfsLink("gone0", root=str(tmp_path)).read().up is False
    finally:
        r.close()


def test_sysfs_reader_on_loopback_and_wait_is_bounded():
    r = SysfsLink("lo")
    try:
        assert r.read().up is True
        t0 = time.monotonic()
        r.wait(0.2)
        assert time.monotonic() - t0 < 1.0
    finally:
        r.close()


@pytest.mark.parametrize("bad", ["", "../etc", "..", "a" * 16, "br 0", "x/y"])
def test_interface_names_are_checked(bad):
    with pytest.raises(ValueError):
        check_interface_name(bad)
    assert check_interface_name("bridge0") == "bridge0"
