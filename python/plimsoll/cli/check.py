"""``--check`` for the long-running commands (``serve``, ``watch-link``): validate, start nothing.

A launchd job that cannot start is respawned forever and says so only in a log file, so
every command line the nix-darwin module generates is run with ``--check`` in CI, and a user
can run the same before ``darwin-rebuild switch``. A check reads the arguments, the policy
and every file they name, prints one line per finding and exits 0 when the command would
start (warnings included: a model directory that is not there yet is a request-time 503,
not a start failure), 2 with the reasons otherwise. Nothing is bound, spawned or written.

:func:`with_check` adds the flag to a click command: the command's own option parsing
(types, ranges, ``exists=True``) runs first, then the checker instead of the command.
"""

from __future__ import annotations

import functools
import os
import stat
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import click

Level = Literal["ok", "warn", "fail"]
GIB = 1 << 30


@dataclass(frozen=True)
class Finding:
    level: Level
    text: str


def ok(text: str) -> Finding:
    return Finding("ok", text)


def warn(text: str) -> Finding:
    return Finding("warn", text)


def fail(text: str) -> Finding:
    return Finding("fail", text)


def with_check(checker: Callable[..., list[Finding]], what: str):
    """Decorate a click command's function (under ``@click.command``) with ``--check``."""

    def decorate(command: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(command)
        def run(*args: Any, check: bool = False, **kwargs: Any) -> Any:
            if check:
                raise SystemExit(report(checker(**kwargs), what))
            return command(*args, **kwargs)

        return click.option(
            "--check", is_flag=True,
            help=f"Validate the arguments, the policy and every file named, then exit "
                 f"(0: {what} would start; 2: what to fix). Starts nothing.")(run)

    return decorate


def report(findings: list[Finding], what: str) -> int:
    """Print the findings (stdout), the verdict last; 0 when nothing failed, else 2."""
    for f in findings:
        click.echo(f"{f.level:<4} {f.text}")
    failed = [f for f in findings if f.level == "fail"]
    if failed:
        click.echo(f"check failed: {what} would not start ({len(failed)} problem(s) above)")
        return 2
    warned = sum(f.level == "warn" for f in findings)
    click.echo(f"check passed: {what} would start" + (f" ({warned} warning(s))" if warned else ""))
    return 0


# ---- shared pieces --------------------------------------------------------------------------


def policy_findings(policy_file: Path | None) -> tuple[Any, list[Finding]]:
    """The policy (None when it does not load) and what was found."""
    from plimsoll.core.policy import PolicyError, load_policy

    if policy_file is None:
        return None, [ok("no --policy: the embedded default (sized from this machine at start)")]
    try:
        pol = load_policy(policy_file)
    except PolicyError as err:
        return None, [fail(f"policy: {err}")]
    return pol, [ok(f"policy {policy_file}: host {pol.host}, standalone "
                    f"{pol.modes.standalone.max_local_llm_gb:g} GiB, clustered "
                    f"{pol.modes.clustered.max_local_llm_gb:g} GiB, "
                    f"{len(pol.models)} model(s)")]


def secret_file_findings(path: Path, what: str) -> list[Finding]:
    """A token file: a regular file this user can read, not empty, writable by nobody else."""
    try:
        st = path.stat()
    except OSError as err:
        return [fail(f"{what} {path}: {err.strerror}")]
    if not stat.S_ISREG(st.st_mode):
        return [fail(f"{what} {path}: not a regular file")]
    try:
        token = path.read_text().strip()
    except (OSError, UnicodeDecodeError) as err:
        why = err.strerror if isinstance(err, OSError) else "not text"
        return [fail(f"{what} {path}: cannot read it as this user ({why}); it must be "
                     "readable by the account the service runs as")]
    if not token:
        return [fail(f"{what} {path} is empty: write a token into it (or delete it and "
                     "re-run the activation, which creates one)")]
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return [fail(f"{what} {path} is writable by group or others (mode "
                     f"{stat.S_IMODE(st.st_mode):04o}): chmod go-w {path}")]
    out = [ok(f"{what} {path}: readable, {len(token)} characters")]
    if st.st_mode & stat.S_IROTH:
        out.append(warn(f"{what} {path} is readable by every user (mode "
                        f"{stat.S_IMODE(st.st_mode):04o}): chmod o-r {path}"))
    return out


# ---- plimsoll serve --check -----------------------------------------------------------------


def check_serve(parse_idle_ttls: Callable[..., Any], parse_cluster_ranks: Callable[..., Any], *,
                policy_file: Path | None = None, admin_token_file: Path | None = None,
                mode: str = "standalone", idle_ttls: tuple[str, ...] = (),
                cluster_ranks: tuple[str, ...] = (), cluster_backend: str | None = None,
                **_: Any) -> list[Finding]:
    """What ``plimsoll serve`` with these arguments would meet at start. The command's own
    parsers are passed in (``serve`` imports this module, never the reverse)."""
    from plimsoll.cli.common import UsageFailure

    pol, out = policy_findings(policy_file)
    if pol is not None:
        if not pol.models:
            out.append(fail(f"{policy_file}: the policy lists no models: add one under "
                            "'models'"))
        out += [model_dir_finding(name, entry.path) for name, entry in sorted(pol.models.items())]
        out.append(ok(f"listen on {pol.listen.host}:{pol.listen.port} (--host/--port override)"))
    if admin_token_file is not None:
        out += secret_file_findings(admin_token_file, "admin token file")
    else:
        from plimsoll.core.paths import cache_dir

        out.append(ok(f"no --admin-token-file: a token is generated at start into "
                      f"{cache_dir() / 'admin-token'} (a root link watcher cannot read it)"))
    try:
        if pol is not None:
            parse_idle_ttls(idle_ttls, set(pol.models))
        ranks = parse_cluster_ranks(cluster_ranks)
    except UsageFailure as err:
        return [*out, fail(err.message)]
    if idle_ttls:
        out.append(ok(f"--idle-ttl {' '.join(idle_ttls)}"))
    out += cluster_findings(pol, mode, ranks)
    if len(ranks) >= 2:
        out += backend_findings(pol, cluster_backend, len(ranks))
    return out


def backend_setting(flag: str | None) -> str:
    """Where the cluster backend was set, for a refusal's fix."""
    return "--cluster-backend" if flag else "the policy's cluster.backend"


def backend_findings(pol: Any, flag: str | None, world: int) -> list[Finding]:
    """The ranks' MLX backend as ``plimsoll serve`` would resolve it: a named backend MLX
    does not report available here fails, with what to change."""
    from plimsoll.cluster.backend import choose, read_availability, world_refusal

    wanted = flag or (pol.cluster.backend if pol is not None else "auto")
    setting = backend_setting(flag)
    available = read_availability()
    choice = choose(wanted, available, setting=setting, local=True)
    if choice.backend is None:
        return [fail(choice.reason)]
    if why := world_refusal(choice.backend, world):
        return [fail(f"{setting} {wanted!r}: {why}")]
    return [ok(f"cluster backend {choice.backend} ({choice.reason}; {available.summary()})")]


def model_dir_finding(name: str, path: str) -> Finding:
    p = Path(path)
    if (p / "config.json").is_file():
        return ok(f"model {name}: {p} holds config.json")
    why = "does not exist" if not p.exists() else "holds no config.json"
    return warn(f"model {name}: {p} {why} (the proxy starts; requests for {name} answer 503 "
                "until it does)")


def cluster_findings(pol: Any, mode: str, ranks: tuple[tuple[int, int, int], ...]
                     ) -> list[Finding]:
    out = [ok(f"mode at start: {mode}")]
    sharded = sorted(n for n, e in pol.models.items() if e.sharded) if pol is not None else []
    if not ranks:
        if sharded:
            out.append(warn(f"sharded model(s) {', '.join(sharded)} but no --cluster-rank: "
                            "they are served unsharded on this host"))
        return out
    if len(ranks) < 2:
        out.append(fail("--cluster-rank given once: a sharded model needs two ranks or more"))
        return out
    desc = ", ".join(f"rank {r}: ceiling {c / GIB:g} GiB, RAM {t / GIB:g} GiB, budget "
                     f"{b / GIB:g} GiB" for r, (c, t, b) in enumerate(ranks))
    out.append(ok(f"{len(ranks)} cluster ranks ({desc})"))
    if pol is not None:
        own = pol.modes.clustered.max_local_llm_gb * GIB
        c0, t0, b0 = ranks[0]
        if b0 > own or c0 > own:
            out.append(fail(f"rank 0 is this host ({pol.host}) but is sized above its clustered "
                            f"budget of {own / GIB:g} GiB (ceiling {c0 / GIB:g}, budget "
                            f"{b0 / GIB:g}): lower rank 0's figures or raise "
                            "maxLocalLlmGb.clustered"))
        if t0 > pol.total_ram_gb * GIB:
            out.append(fail(f"rank 0 is this host ({pol.host}) but claims {t0 / GIB:g} GiB of "
                            f"RAM; the policy declares {pol.total_ram_gb:g} GiB"))
        if not sharded:
            out.append(warn("--cluster-rank given but no model is marked sharded: the ranks "
                            "are unused"))
    if any(t != ranks[0][1] for _, t, _ in ranks[1:]):
        out.append(warn("ranks 1.. are sized for other hosts, but the proxy starts every rank "
                        "as a process on this host (plimsoll cluster serve): across hosts, "
                        "start them with mlx.launch (README, clustered mode)"))
    return out


# ---- plimsoll watch-link --check ------------------------------------------------------------


def check_watch_link(*, policy_file: Path | None = None, interface: str | None = None,
                     sysctl_spec: str | None = None, proxy_url: str = "policy",
                     admin_token_file: str | None = None, **_: Any) -> list[Finding]:
    """What ``plimsoll watch-link`` with these arguments would meet at start."""
    from plimsoll.watcher.proxy_client import check_local_url

    pol, out = policy_findings(policy_file)
    if pol is None and policy_file is not None:
        return out
    if pol is None:
        from plimsoll.launch.defaults import default_policy
        from plimsoll.probes import read_snapshot

        pol = default_policy(read_snapshot())
    out.append(interface_finding(interface or pol.cluster.interface))
    out += sysctl_findings(sysctl_spec)
    if proxy_url == "none":
        out.append(ok("--proxy none: the ceiling is managed alone (no proxy is told)"))
        return out
    url = (f"http://{pol.listen.host}:{pol.listen.port}" if proxy_url == "policy"
           else proxy_url)
    try:
        url = check_local_url(url)
    except ValueError as err:
        return [*out, fail(str(err))]
    out.append(ok(f"proxy {url} (POST /admin/mode; while it does not answer the watcher raises "
                  "the ceiling alone and lowers it only once the proxy confirms it fits)"))
    if not admin_token_file:
        out.append(fail("--admin-token-file is required to talk to the proxy (or pass "
                        "--proxy none)"))
    else:
        out += secret_file_findings(Path(admin_token_file), "admin token file")
    return out


def interface_finding(name: str) -> Finding:
    import psutil

    if name in psutil.net_if_stats():
        return ok(f"link interface {name}: present")
    return warn(f"link interface {name}: not present now (read as link down: standalone "
                "mode until it appears)")


def sysctl_findings(spec: str | None) -> list[Finding]:
    spec = spec or ("darwin" if sys.platform == "darwin" else None)
    if spec is None:
        return [fail("--sysctl: no wired ceiling sysctl on this OS; pass file:PATH")]
    if spec == "darwin":
        if sys.platform != "darwin":
            return [ok("ceiling backend darwin (sysctl iogpu.wired_limit_mb; read on macOS "
                       "only, this is " + sys.platform + ")")]
        from plimsoll.watcher.sysctl import open_writer

        try:
            mib = open_writer(spec).read_mib()
        except Exception as err:  # any failure to read it is the finding
            return [fail(f"ceiling backend darwin: cannot read iogpu.wired_limit_mb: {err}")]
        out = [ok(f"ceiling backend darwin: iogpu.wired_limit_mb = {mib} MiB now")]
        if os.geteuid() != 0:
            out.append(warn("not root: the daemon (root) can write iogpu.wired_limit_mb; this "
                            "user cannot"))
        return out
    if spec.startswith("file:") and len(spec) > len("file:"):
        path = Path(spec.removeprefix("file:"))
        if not path.parent.is_dir():
            return [fail(f"--sysctl {spec}: directory {path.parent} does not exist")]
        return [ok(f"ceiling backend file {path}")]
    return [fail(f"--sysctl {spec!r}: use 'darwin' or 'file:PATH'")]
