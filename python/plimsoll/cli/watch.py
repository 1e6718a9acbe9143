"""``plimsoll watch-link``: hold the wired ceiling at the cluster link's mode budget.

Thin: parse flags, build the reader/writer/client, run the loop (plimsoll.watcher.run).
"""

from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path

import click

from plimsoll.cli.check import check_watch_link, with_check
from plimsoll.cli.common import UsageFailure
from plimsoll.core.policy import PolicyError, load_policy


@click.command("watch-link")
@with_check(check_watch_link, "plimsoll watch-link")
@click.option("--policy", "policy_file", type=click.Path(dir_okay=False, path_type=Path),
              help="Host policy (mode budgets, cluster interface, listen address). "
                   "Default: sized from this machine, with equal budgets.")
@click.option("--interface", help="Cluster link interface (default: the policy's "
                                  "cluster.interface, bridge0 = Thunderbolt Bridge).")
@click.option("--sysctl", "sysctl_spec",
              help="Ceiling backend: 'darwin' (sysctl iogpu.wired_limit_mb; the default on "
                   "macOS) or 'file:PATH' (the MiB value in a file; required on Linux).")
@click.option("--proxy", "proxy_url", default="policy", show_default=True,
              help="Local proxy URL for POST /admin/mode; 'policy' = the policy's listen "
                   "address; 'none' manages the ceiling alone.")
@click.option("--admin-token-file", type=click.Path(dir_okay=False),
              help="File holding the proxy's admin token (required with a proxy).")
@click.option("--settle", "settle_s", type=click.FloatRange(0, 60), default=1.0,
              show_default=True, help="Seconds a link change must hold before the mode follows.")
@click.option("--poll", "poll_s", type=click.FloatRange(0.05, 0.5), default=0.5,
              show_default=True, help="Seconds between link reads (link events wake it sooner).")
@click.option("--once", is_flag=True,
              help="Apply the current mode's ceiling, then exit: 0 converged, 1 held.")
def watch_link_command(policy_file, interface, sysctl_spec, proxy_url, admin_token_file,
                       settle_s, poll_s, once) -> None:
    """Follow the cluster link: clustered budget while it is up, standalone while down.

    Upshift raises the ceiling first, then tells the proxy; downshift tells the proxy
    first (it evicts until memory fits) and lowers the ceiling only after it confirms.
    No ceiling is ever written below the memory in use. Runs as root (launchd daemon).
    """
    from plimsoll.probes import read_snapshot
    from plimsoll.watcher.decide import Targets
    from plimsoll.watcher.link import open_reader
    from plimsoll.watcher.proxy_client import AdminClient, check_local_url, read_token
    from plimsoll.watcher.run import EventLog, Timing, Watcher
    from plimsoll.watcher.sysctl import open_writer

    try:
        if policy_file:
            pol, source = load_policy(policy_file), str(policy_file)
        else:
            from plimsoll.launch.defaults import default_policy

            pol, source = default_policy(read_snapshot()), "default policy (this machine)"
    except PolicyError as err:
        raise UsageFailure(str(err)) from None

    spec = sysctl_spec or ("darwin" if sys.platform == "darwin" else None)
    if spec is None:
        raise UsageFailure("--sysctl: no wired ceiling sysctl on this OS; pass file:PATH")
    proxy = None
    try:
        writer = open_writer(spec)
        link = open_reader(interface or pol.cluster.interface)
        if proxy_url != "none":
            url = (f"http://{pol.listen.host}:{pol.listen.port}" if proxy_url == "policy"
                   else proxy_url)
            url = check_local_url(url)
            if not admin_token_file:
                raise ValueError("--admin-token-file is required to talk to the proxy "
                                 "(or pass --proxy none)")
            proxy = AdminClient(url, read_token(admin_token_file))
    except (ValueError, NotImplementedError) as err:
        raise UsageFailure(str(err)) from None

    targets = Targets.from_policy(pol)
    log = EventLog()
    log.emit("INFO", "start", policy=source, interface=link.interface, backend=writer.name,
             standalone_mib=targets.standalone_mib, clustered_mib=targets.clustered_mib,
             proxy=proxy.url if proxy else "none", settle_s=settle_s, poll_s=poll_s,
             msg="watch-link starting")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    watcher = Watcher(targets=targets, link=link, ceiling=writer,
                      in_use=lambda: read_snapshot().in_use_bytes, proxy=proxy, log=log,
                      timing=Timing(poll_s=poll_s, settle_s=settle_s))
    try:
        code = watcher.run(stop, once=once)
    finally:
        link.close()
        if proxy:
            proxy.close()
    sys.exit(code)
