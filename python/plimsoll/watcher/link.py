"""Link readers: is the cluster link up? One interface, one reader per OS.

macOS: the Thunderbolt Bridge (``bridge0`` by default) as ``ifconfig IF`` prints it. The
bridge itself stays ``UP,RUNNING`` with no cable in; its ``status:`` line (the media
status, ``active`` when a member has a carrier) is what follows the cable. Linux:
``/sys/class/net/IF/carrier`` and ``operstate``. An interface that does not exist is a
link that is down.

Shape (as the probes): ``parse_*``/``*_link_state`` are pure functions of command output
or file text, tested on recorded fixtures; the readers are thin. Readers also offer
``wait(timeout)``, which returns early when the OS signals a link change (rtnetlink on
Linux, the routing socket on macOS) and otherwise sleeps, so a change is seen at once
and polling only bounds the delay.
"""

from __future__ import annotations

import contextlib
import re
import select
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

IFCONFIG = "/sbin/ifconfig"  # absolute: a launchd daemon's PATH has no /sbin
SYS_CLASS_NET = "/sys/class/net"
# IFNAMSIZ is 16 with the NUL on both kernels; names go into argv and a sysfs path.
_IFNAME = re.compile(r"^(?!\.{1,2}$)[A-Za-z0-9_.:-]{1,15}$")
# <net/if.h> IFF_UP and IFF_RUNNING, the same bits on Darwin and Linux.
IFF_UP = 0x1
IFF_RUNNING = 0x40
RTMGRP_LINK = 0x1  # <linux/rtnetlink.h>: link up/down/changed notifications


@dataclass(frozen=True)
class LinkState:
    up: bool
    detail: str  # the raw figures behind ``up``, for the log


class LinkReader(Protocol):
    interface: str

    def read(self) -> LinkState: ...

    def wait(self, timeout: float) -> None:
        """Sleep up to ``timeout`` s; return earlier when the OS reports a link change."""

    def close(self) -> None: ...


def check_interface_name(name: str) -> str:
    if not _IFNAME.match(name):
        raise ValueError(
            f"invalid interface name {name!r}: 1-15 characters of letters, digits, '_.:-'"
        )
    return name


# --- macOS: ifconfig --------------------------------------------------------------------


@dataclass(frozen=True)
class Ifconfig:
    """The parts of one interface's ``ifconfig`` block that say whether it carries."""

    name: str
    flags: int  # printed in hex by printb("flags", ...)
    flag_names: frozenset[str]
    status: str | None  # "active"/"inactive" from media_status(); None without media
    members: tuple[str, ...] = ()  # bridge members (``member: en2 flags=...``)


_HEADER = re.compile(r"^(?P<name>[^\s:]+): flags=(?P<hex>[0-9a-fA-F]+)<(?P<names>[^>]*)>")


def parse_ifconfig(text: str) -> Ifconfig:
    """``ifconfig IF`` output → name, flags, media status, bridge members.

    The format is network_cmds' ifconfig.tproj: a header ``NAME: flags=%x<UP,...> mtu N``
    (printb), then tab-indented lines; ``\\tstatus: active|inactive`` is printed by
    media_status() only when the driver reports a valid media status (IFM_AVALID).
    """
    lines = text.splitlines()
    if not lines or (m := _HEADER.match(lines[0])) is None:
        raise ValueError(f"not ifconfig output for one interface: {text[:80]!r}")
    names = frozenset(n for n in m.group("names").split(",") if n)
    status: str | None = None
    members: list[str] = []
    for line in lines[1:]:
        if not line.startswith("\t"):
            break  # the next interface's block (ifconfig -a): stop at ours
        body = line.strip()
        if body.startswith("status: "):
            status = body.removeprefix("status: ").strip()
        elif body.startswith("member: "):
            members.append(body.split()[1])
    return Ifconfig(m.group("name"), int(m.group("hex"), 16), names, status, tuple(members))


def darwin_link_state(ifc: Ifconfig | None) -> LinkState:
    """Up = administratively UP, RUNNING, and (when reported) media status active."""
    if ifc is None:
        return LinkState(False, "interface does not exist")
    up_flags = bool(ifc.flags & IFF_UP) and bool(ifc.flags & IFF_RUNNING)
    carrier = ifc.status in (None, "active")
    detail = f"flags={ifc.flags:x}<{','.join(sorted(ifc.flag_names))}> status={ifc.status}"
    if ifc.members:
        detail += f" members={','.join(ifc.members)}"
    return LinkState(up_flags and carrier, detail)


def parse_ifconfig_run(returncode: int, stdout: str, stderr: str) -> Ifconfig | None:
    """One ``ifconfig IF`` run → its block, or None when the interface does not exist.

    ifconfig says ``ifconfig: interface bridge0 does not exist`` (errx, status 1).
    """
    if returncode != 0:
        if "does not exist" in stderr:
            return None
        raise OSError(f"ifconfig failed with status {returncode}: {stderr.strip()}")
    return parse_ifconfig(stdout)


class IfconfigLink:
    """macOS reader: runs ``/sbin/ifconfig IF``; wakes on the routing socket (PF_ROUTE),
    which carries RTM_IFINFO when an interface's flags or link state change."""

    def __init__(self, interface: str, ifconfig: str = IFCONFIG) -> None:
        self.interface = check_interface_name(interface)
        self._ifconfig = ifconfig
        self._sock = _open_socket(getattr(socket, "AF_ROUTE", None), socket.SOCK_RAW, 0)

    def read(self) -> LinkState:
        try:
            done = subprocess.run([self._ifconfig, self.interface], capture_output=True,
                                  text=True, timeout=5)
            return darwin_link_state(parse_ifconfig_run(done.returncode, done.stdout,
                                                        done.stderr))
        except (OSError, subprocess.TimeoutExpired, ValueError) as err:
            return LinkState(False, f"ifconfig unreadable ({err}); treated as down")

    def wait(self, timeout: float) -> None:
        _wait_socket(self._sock, timeout)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()


# --- Linux: sysfs -----------------------------------------------------------------------


def linux_link_state(exists: bool, carrier: str | None, operstate: str | None) -> LinkState:
    """``/sys/class/net/IF`` → up. RFC 2863 operstate ``up`` is up; ``unknown`` (drivers
    that do not track it, e.g. tun, loopback) counts only with carrier 1. Reading
    ``carrier`` fails (EINVAL) while the interface is administratively down: None."""
    if not exists:
        return LinkState(False, "interface does not exist")
    c = (carrier or "").strip() or None
    op = (operstate or "").strip() or None
    up = c == "1" and op in ("up", "unknown")
    return LinkState(up, f"carrier={c} operstate={op}")


class SysfsLink:
    """Linux reader: sysfs for the truth, rtnetlink (RTMGRP_LINK) to wake up at once.

    Under ``ip netns exec`` sysfs and the netlink socket are both the namespace's.
    """

    def __init__(self, interface: str, root: str = SYS_CLASS_NET) -> None:
        self.interface = check_interface_name(interface)
        self._dir = Path(root) / self.interface
        self._sock = _open_socket(getattr(socket, "AF_NETLINK", None), socket.SOCK_RAW,
                                  getattr(socket, "NETLINK_ROUTE", 0), bind_groups=RTMGRP_LINK)

    def read(self) -> LinkState:
        return linux_link_state(self._dir.is_dir(), _read(self._dir / "carrier"),
                                _read(self._dir / "operstate"))

    def wait(self, timeout: float) -> None:
        _wait_socket(self._sock, timeout)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:  # ENOENT (gone), EINVAL (carrier of an admin-down interface)
        return None


def _open_socket(family: int | None, kind: int, proto: int,
                 bind_groups: int | None = None) -> socket.socket | None:
    """A non-blocking event socket, or None where the OS has none (then: polling only)."""
    if family is None:
        return None
    try:
        sock = socket.socket(family, kind, proto)
        if bind_groups is not None:
            sock.bind((0, bind_groups))
        sock.setblocking(False)
        return sock
    except OSError:
        return None


def _wait_socket(sock: socket.socket | None, timeout: float) -> None:
    if timeout <= 0:
        return
    if sock is None:
        time.sleep(timeout)
        return
    ready, _, _ = select.select([sock], [], [], timeout)
    if ready:
        # Drain everything queued: the message is only a wake-up; sysfs/ifconfig is read.
        with contextlib.suppress(OSError):
            while sock.recv(65536):
                pass


def open_reader(interface: str, platform: str = sys.platform) -> LinkReader:
    """The reader for this OS."""
    if platform == "darwin":
        return IfconfigLink(interface)
    if platform.startswith("linux"):
        return SysfsLink(interface)
    raise NotImplementedError(f"no link reader for platform {platform!r}")

