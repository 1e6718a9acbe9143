"""``plimsoll doctor``: read the live probe, the policy and each model; print what to fix.

The judgement is :func:`plimsoll.reliability.doctor.diagnose` (pure); this module only gathers its
inputs: the snapshot, the policy (or the default sized from this machine), one
admission per registered model (alone against the envelope), the MLX this interpreter
would give a worker (Metal or not, and its distributed backends, each read in a child
process) and, with ``--proxy``, the proxy's ``GET /running``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import click

from plimsoll.cli.common import UsageFailure
from plimsoll.core.policy import Mode, Policy, PolicyError, load_policy
from plimsoll.launch.live_admission import (
    MemoryOverrides,
    Wanted,
    memory_figures,
    plan,
    resolve_model,
)
from plimsoll.probes.snapshot import MemorySnapshot
from plimsoll.reliability.doctor import (
    MlxView,
    ModelCheck,
    ProxyView,
    diagnose,
    exit_status,
    parse_running,
    render,
)

PROXY_TIMEOUT_S = 3.0


def check_models(policy: Policy, mode: Mode, snapshot: MemorySnapshot) -> list[ModelCheck]:
    """Admit each registered model on its own with the live figures; a broken one is a line."""
    figures = memory_figures(policy, mode, MemoryOverrides(), lambda: snapshot)
    checks = []
    for name in policy.models:
        model_dir, entry = resolve_model(name, policy)
        try:
            _facts, _req, decision = plan(model_dir, entry, policy, figures, Wanted())
        except (OSError, ValueError) as err:  # ModelInspectionError is a ValueError
            checks.append(ModelCheck(name, str(model_dir), error=str(err)))
        else:
            checks.append(ModelCheck(name, str(model_dir), decision=decision))
    return checks


def ask_proxy(url: str) -> ProxyView:
    """``GET {url}/running`` (with ``PLIMSOLL_API_KEY`` as a bearer token when set); anything
    but a readable answer is an ``error``, never a raise."""
    import httpx

    url = url.rstrip("/")
    key = os.environ.get("PLIMSOLL_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        resp = httpx.get(f"{url}/running", headers=headers, timeout=PROXY_TIMEOUT_S)
        if resp.status_code == 401:
            return ProxyView(url, error="GET /running answered HTTP 401: set PLIMSOLL_API_KEY")
        if resp.status_code != 200:
            return ProxyView(url, error=f"GET /running answered HTTP {resp.status_code}")
        return ProxyView(url, workers=parse_running(resp.json()))
    except (httpx.HTTPError, httpx.InvalidURL) as err:
        return ProxyView(url, error=f"{type(err).__name__}: {err}" if str(err)
                         else type(err).__name__)
    except ValueError as err:
        return ProxyView(url, error=str(err))


# Run in a child: mlx is imported only at the engine edge, and a broken build cannot take
# the doctor down with it.
# The kernels' self-check runs on a Qwen3-4B-like decode shape (the worker checks its own
# model's at start and reports it in /v1/plimsoll/status).
MLX_PROBE = """
import json
try:
    import mlx.core as mx
    out = {"version": getattr(mx, "__version__", "?"), "metal":
           bool(mx.metal.is_available()), "device": str(mx.default_device().type).split(".")[-1]}
except Exception as err:
    print(json.dumps({"error": f"{type(err).__name__}: {err}"}))
else:
    try:
        from plimsoll.engine import backend, kernels
        from plimsoll.engine.paged import FullAttention
        dtype = mx.bfloat16 if backend.gpu() else mx.float32
        pool = [FullAttention(8, 128, 128, dtype, 16, 64, 64)]
        gather = kernels.check_gather(pool)
        out["kernels"] = kernels.select(dtype, 32, [(8, 128, 128)]).report() + [
            kernels.check_write(pool, False, gather).as_dict(), gather.as_dict()]
    except Exception as err:
        out["kernels"] = [{"name": "self-check", "device": "?", "used": False,
                           "reason": f"failed: {type(err).__name__}: {err}"}]
    print(json.dumps(out))
"""


def read_mlx() -> MlxView:
    """What this interpreter's MLX reports (version, Metal, default device) and the engine's
    kernel self-check on it."""
    try:
        done = subprocess.run([sys.executable, "-c", MLX_PROBE], capture_output=True,
                              text=True, timeout=120)
        seen = json.loads(done.stdout.strip().splitlines()[-1])
        return MlxView(**{**seen, "kernels": tuple(seen.get("kernels", ()))})
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError, TypeError) as err:
        return MlxView(error=f"the MLX probe failed: {type(err).__name__}: {err}")


@click.command("doctor")
@click.option("--policy", "policy_file", type=click.Path(dir_okay=False, path_type=Path),
              help="Host policy (default: one sized from this machine, no models).")
@click.option("--mode", type=click.Choice(["standalone", "clustered"]), default="standalone",
              show_default=True, help="Which mode's budget to check against.")
@click.option("--proxy", "proxy_url", metavar="URL",
              help="Ask a running proxy what is loaded (GET URL/running; "
                   "PLIMSOLL_API_KEY is sent if set).")
@click.option("--json", "as_json", is_flag=True,
              help="Print one JSON object: {ok, exit_status, lines: [{level, text}]}.")
def doctor_command(policy_file, mode, proxy_url, as_json) -> None:
    """Check this host against its policy: ceiling, budgets, each model's u band, what is loaded.

    One line per finding; every warning names its fix (the exact sysctl, the policy
    field to change). Exit status: 0 nothing to fix, 1 warnings or errors,
    2 bad input (an unreadable policy, no memory probe for this platform).
    """
    from plimsoll.probes import read_snapshot

    try:
        pol = load_policy(policy_file) if policy_file else None
    except PolicyError as err:
        raise UsageFailure(str(err)) from None
    try:
        snapshot = read_snapshot()
    except NotImplementedError as err:
        raise UsageFailure(str(err)) from None
    if pol is None:
        from plimsoll.launch.defaults import default_policy

        pol, source = default_policy(snapshot), "the default policy sized from this machine"
    else:
        source = str(policy_file)
    proxy = ask_proxy(proxy_url) if proxy_url else None
    from plimsoll.cluster.backend import read_availability

    lines = diagnose(snapshot, pol, mode, check_models(pol, mode, snapshot), proxy, source,
                     read_mlx(), read_availability())
    status = exit_status(lines)
    if as_json:
        click.echo(json.dumps({"ok": status == 0, "exit_status": status,
                               "lines": [{"level": ln.level, "text": ln.text} for ln in lines]},
                              indent=2))
    else:
        click.echo(render(lines))
    raise SystemExit(status)
