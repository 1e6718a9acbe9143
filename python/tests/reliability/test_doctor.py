"""``plimsoll doctor``: each warning from constructed values, then one real run on this host.

The pure tests build snapshots (including macOS ones), policies and admission decisions by
hand, so every finding — and the fix it names — is checked without a Mac or a big model.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from click.testing import CliRunner

from plimsoll.cli.doctor import ask_proxy, doctor_command
from plimsoll.core.admission import AdmissionRequest, admit
from plimsoll.core.policy import parse_policy
from plimsoll.core.units import GIB, MIB
from plimsoll.probes import MemorySnapshot, read_snapshot
from plimsoll.reliability.doctor import (
    Line,
    ModelCheck,
    ProxyView,
    RunningWorker,
    diagnose,
    exit_status,
    parse_running,
    render,
)

pytestmark = pytest.mark.pure

DEFAULT_SOURCE = "MLX max_recommended_working_set_size (wired limit 0: macOS default)"


def policy(standalone: float = 72, clustered: float = 88, total: float = 96, floor: float = 8,
           **extra):
    return parse_policy({
        "schemaVersion": 1, "host": "studio", "totalRamGb": total, "osFloorGb": floor,
        "modes": {"standalone": {"maxLocalLlmGb": standalone},
                  "clustered": {"maxLocalLlmGb": clustered}},
        **extra,
    })


def mac(ceiling: int, source: str, total: int = 96 * GIB, wired: int = 10 * GIB):
    return MemorySnapshot(platform="darwin", total_ram_bytes=total, ceiling_bytes=ceiling,
                          ceiling_source=source, in_use_bytes=wired,
                          process_footprint_bytes=0, pressure="normal")


def linux(ceiling: int, total: int, source: str):
    return MemorySnapshot(platform="linux", total_ram_bytes=total, ceiling_bytes=ceiling,
                          ceiling_source=source, in_use_bytes=GIB, process_footprint_bytes=0)


def decision(ceiling=72 * GIB, total=96 * GIB, budget=72 * GIB, weights=4 * GIB,
             concurrency=1, context=8192, max_tokens=1024, native=None):
    """A real admission (pure) for a Qwen3-30B-shaped KV: 96 KiB per token."""
    return admit(AdmissionRequest(
        ceiling_bytes=ceiling, total_ram_bytes=total, budget_bytes=budget,
        weights_bytes=weights, kv_bytes_per_token=96 * 1024, native_max_context=native,
        transient_reserve=0.05, block_tokens=16, concurrency=concurrency, context=context,
        max_tokens=max_tokens,
    ))


def warnings(lines: list[Line]) -> list[str]:
    return [ln.text for ln in lines if ln.level != "ok"]


SET = mac(72 * GIB, "sysctl iogpu.wired_limit_mb=73728")
BIG_LINUX = linux(64 * GIB, 64 * GIB, "MemTotal (no cgroup memory limit)")


def test_all_well_on_a_mac_with_the_sysctl_on_the_budget():
    lines = diagnose(SET, policy(), "standalone",
                     [ModelCheck("qwen", "/m/qwen", decision=decision())], None, "p.json")
    assert warnings(lines) == [] and exit_status(lines) == 0
    text = render(lines)
    assert "ceiling 72.00 GiB" in text and "sysctl iogpu.wired_limit_mb=73728" in text
    assert "standalone 72 GiB (73728 MiB), clustered 88 GiB (90112 MiB)" in text
    assert "wired limit iogpu.wired_limit_mb=73728 matches the standalone budget" in text
    model = next(ln.text for ln in lines if ln.text.startswith("model qwen"))
    assert "u band" in model and "u = 0.6800" in model and "pool" in model
    assert text.splitlines()[-1].startswith("ok    loaded: not checked")


def test_sysctl_unset_on_a_mac_names_the_exact_command():
    snap = mac(72 * GIB - 5 * MIB, DEFAULT_SOURCE)
    (w,) = warnings(diagnose(snap, policy(), "standalone", []))
    assert "iogpu.wired_limit_mb is unset" in w
    assert "set it: sudo sysctl iogpu.wired_limit_mb=73728, or install the link watcher" in w


def test_sysctl_below_and_above_the_budget():
    (below,) = warnings(diagnose(mac(64 * GIB, "sysctl iogpu.wired_limit_mb=65536"),
                                 policy(), "standalone", []))
    assert "below the standalone budget 72 GiB" in below
    assert "raise it: sudo sysctl iogpu.wired_limit_mb=73728" in below
    (above,) = warnings(diagnose(mac(80 * GIB, "sysctl iogpu.wired_limit_mb=81920"),
                                 policy(), "standalone", []))
    assert "is above the standalone budget" in above
    assert "lower it: sudo sysctl iogpu.wired_limit_mb=73728" in above
    # The same 80 GiB limit is below the clustered budget: raise it to 88 GiB.
    (clustered,) = warnings(diagnose(mac(80 * GIB, "sysctl iogpu.wired_limit_mb=81920"),
                                     policy(), "clustered", []))
    assert "raise it: sudo sysctl iogpu.wired_limit_mb=90112" in clustered


def test_ventura_sysctl_name_gets_its_own_fix_in_bytes():
    snap = mac(60 * GIB, f"sysctl debug.iogpu.wired_limit={60 * GIB}")
    (w,) = warnings(diagnose(snap, policy(), "standalone", []))
    assert f"sudo sysctl debug.iogpu.wired_limit={72 * GIB}" in w


def test_wired_memory_in_use_above_the_budget():
    snap = mac(72 * GIB, "sysctl iogpu.wired_limit_mb=73728", wired=75 * GIB)
    (w,) = warnings(diagnose(snap, policy(), "standalone", []))
    assert "wired memory in use 75.00 GiB is above the standalone budget" in w
    assert "POST /unload" in w


def test_linux_ceiling_below_the_budget():
    cg = linux(32 * GIB, 64 * GIB, "cgroup v2 memory.max of /user.slice")
    (w,) = warnings(diagnose(cg, policy(48, 48, 64, 8), "standalone", []))
    assert "ceiling 32.00 GiB is below the standalone budget 48 GiB" in w
    assert "MemoryMax=" in w and "lower modes.standalone.maxLocalLlmGb to at most 32.00" in w
    ram = linux(16 * GIB, 16 * GIB, "MemTotal (no cgroup memory limit)")
    (w,) = warnings(diagnose(ram, policy(48, 48, 64, 8), "standalone", []))
    assert "lower modes.standalone.maxLocalLlmGb to at most 16.00 GiB (this host's RAM)" in w


def test_linux_ceiling_above_the_budget_is_fine():
    snap = linux(64 * GIB, 64 * GIB, "MemTotal (no cgroup memory limit)")
    lines = diagnose(snap, policy(48, 48, 64, 8), "standalone", [])
    assert exit_status(lines) == 0
    assert any("the budget binds" in ln.text for ln in lines)


def test_empty_band_names_raising_the_ceiling():
    # A 4 GiB wired ceiling on a 96 GiB Mac: ceiling/RAM − 0.05 < 0, no u exists.
    snap = mac(4 * GIB, "sysctl iogpu.wired_limit_mb=4096")
    d = decision(ceiling=4 * GIB, weights=GIB)
    assert d.decision == "refuse"
    lines = diagnose(snap, policy(), "standalone", [ModelCheck("qwen", "/m", decision=d)])
    band = next(w for w in warnings(lines) if w.startswith("model qwen"))
    assert "empty u band" in band
    assert "sudo sysctl iogpu.wired_limit_mb=73728" in band and "smaller" in band


def test_empty_band_when_weights_exceed_it_with_the_sysctl_already_on_the_budget():
    d = decision(weights=70 * GIB)  # weights + reserve above u × ceiling: footprint/ceiling > u
    (w,) = warnings(diagnose(SET, policy(), "standalone", [ModelCheck("big", "/m", decision=d)]))
    assert "model big: empty u band 1.02" in w
    assert "raise modes.standalone.maxLocalLlmGb and the wired limit with it" in w


def test_model_that_cannot_fit_one_sequence():
    # The band exists (0.658 < u < 0.70) but (u − margin) × ceiling leaves < 128 blocks.
    d = decision(weights=int(43.8 * GIB))
    assert d.decision == "refuse" and 0 < d.pool_blocks < 128
    (w,) = warnings(diagnose(SET, policy(), "standalone",
                             [ModelCheck("big", "/m/big", decision=d)]))
    assert w.startswith("model big cannot fit one sequence of 2048 tokens (128 blocks")
    assert "raise modes.standalone.maxLocalLlmGb and the wired limit" in w
    assert "models.big.maxTokens" in w


def test_model_that_cannot_fit_one_sequence_under_a_binding_budget_on_linux():
    d = decision(ceiling=64 * GIB, total=64 * GIB, budget=8 * GIB, weights=int(7.5 * GIB))
    assert d.decision == "refuse"
    (w,) = warnings(diagnose(BIG_LINUX, policy(8, 8, 64, 8), "standalone",
                             [ModelCheck("big", "/m", decision=d)]))
    assert "cannot fit one sequence" in w and "raise modes.standalone.maxLocalLlmGb," in w


def test_model_that_cannot_fit_its_configured_context():
    # 4 GiB of weights on an 8 GiB budget: ~3.4 GiB of KV at 96 KiB/token ≈ 37k tokens.
    d = decision(ceiling=64 * GIB, total=64 * GIB, budget=8 * GIB, context=131072,
                 max_tokens=4096)
    assert d.decision == "clamp" and d.context < 131072
    lines = diagnose(BIG_LINUX, policy(8, 8, 64, 8), "standalone",
                     [ModelCheck("q", "/m/q", decision=d)])
    band = next(ln for ln in lines if ln.text.startswith("model q: u band"))
    assert band.level == "ok"
    (ctx,) = warnings(lines)
    assert f"can't fit its configured context 131072: only {d.context} tokens" in ctx
    assert f"set models.q.context to {d.context} or raise modes.standalone.maxLocalLlmGb" in ctx


def test_native_maximum_and_concurrency_clamps():
    d = decision(ceiling=64 * GIB, total=64 * GIB, budget=8 * GIB, context=65536,
                 native=32768, concurrency=8, max_tokens=1024)
    lines = diagnose(BIG_LINUX, policy(8, 8, 64, 8), "standalone",
                     [ModelCheck("q", "/m/q", decision=d)])
    native, conc = warnings(lines)
    assert "exceeds the model-native maximum 32768: set models.q.context to 32768" in native
    assert f"set models.q.concurrency to {d.concurrency}" in conc and d.concurrency < 8


def test_missing_model_directory_is_one_clear_line():
    lines = diagnose(SET, policy(), "standalone",
                     [ModelCheck("gone", "/nowhere", error="/nowhere is not a directory")])
    (err,) = [ln for ln in lines if ln.level == "error"]
    assert "model gone at /nowhere cannot be inspected" in err.text
    assert "fix models.gone.path" in err.text
    assert exit_status(lines) == 1 and render(lines).count("ERROR") == 1


def test_loaded_lines():
    def loaded(proxy):
        return [ln for ln in diagnose(SET, policy(), "standalone", [], proxy)
                if ln.text.startswith("loaded")]

    (down,) = loaded(ProxyView("http://h:1", error="ConnectError"))
    assert down == Line("ok", "loaded: no proxy reachable at http://h:1 (ConnectError)")
    assert "nothing" in loaded(ProxyView("http://h:1"))[0].text
    workers = (RunningWorker("qwen", "ready", 42, 5 * GIB), RunningWorker("llama"))
    assert [ln.text for ln in loaded(ProxyView("http://h:1", workers))] == [
        "loaded: qwen ready, pid 42, 5.00 GiB", "loaded: llama ?"]


def test_parse_running_shapes():
    proxy_item = {"model": "qwen", "state": "ready", "pid": 7, "observed_bytes": 3,
                  "memory": {"rss_bytes": 4}, "admitted": {"footprint_bytes": 5}}
    want = (RunningWorker("qwen", "ready", 7, 3),)
    stopped = {"model": "llama", "state": "stopped"}
    assert parse_running({"workers": [proxy_item, stopped]}) == want
    assert parse_running({"running": [proxy_item]}) == want
    assert parse_running([{"name": "q", "admitted": {"footprint_bytes": 5}}]) == (
        RunningWorker("q", memory_bytes=5),)
    assert parse_running({"workers": [stopped]}) == ()
    for bad in ({"status": "ok"}, ["qwen"], "x"):
        with pytest.raises(ValueError):
            parse_running(bad)


# --- the real command on this machine ---------------------------------------------------------


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> Path:
    from plimsoll.demo.model import build_demo_model

    return build_demo_model(tmp_path_factory.mktemp("doctor") / "tiny", preset="tiny")


def write_policy(tmp_path: Path, models: dict) -> Path:
    live = read_snapshot()
    budget = min(1.0, round(live.ceiling_bytes / GIB / 2, 2))  # always under this host's line
    path = tmp_path / "policy.json"
    path.write_text(json.dumps({
        "schemaVersion": 1, "host": "ci", "totalRamGb": 16, "osFloorGb": 2,
        "modes": {"standalone": {"maxLocalLlmGb": budget},
                  "clustered": {"maxLocalLlmGb": budget}},
        "models": models,
    }))
    return path


@pytest.mark.impure
def test_cli_on_this_host_with_a_demo_model(demo, tmp_path):
    pol = write_policy(tmp_path, {"tiny": {"path": str(demo), "context": 4096,
                                           "concurrency": 2, "maxTokens": 512}})
    res = CliRunner().invoke(doctor_command, ["--policy", str(pol), "--proxy",
                                              "http://127.0.0.1:9"])
    assert res.exit_code == 0, res.output
    out = res.output.splitlines()
    assert out[0].startswith("ok    ceiling ") and "(linux)" in out[0]
    assert any(ln.startswith("ok    model tiny: u band 0.") for ln in out)
    assert out[-1].startswith("ok    loaded: no proxy reachable at http://127.0.0.1:9")

    res = CliRunner().invoke(doctor_command, ["--policy", str(pol), "--json"])
    got = json.loads(res.output)
    assert res.exit_code == 0 and got["ok"] is True and got["exit_status"] == 0
    assert {ln["level"] for ln in got["lines"]} == {"ok"}


@pytest.mark.impure
def test_cli_warns_and_exits_1_for_a_missing_model_and_a_native_overreach(demo, tmp_path):
    pol = write_policy(tmp_path, {
        "tiny": {"path": str(demo), "context": 1_000_000, "maxTokens": 512},
        "gone": {"path": str(tmp_path / "absent"), "context": 4096, "maxTokens": 512},
    })
    res = CliRunner().invoke(doctor_command, ["--policy", str(pol)])
    assert res.exit_code == 1, res.output
    assert "WARN  model tiny: configured context 1000000 exceeds the model-native" in res.output
    assert "ERROR model gone at" in res.output and "fix models.gone.path" in res.output


def test_cli_bad_policy_is_exit_2(tmp_path):
    bad = tmp_path / "p.json"
    bad.write_text("{")
    res = CliRunner().invoke(doctor_command, ["--policy", str(bad)])
    assert res.exit_code == 2 and "not valid JSON" in res.output


@pytest.mark.impure
def test_cli_without_a_policy_uses_the_default():
    res = CliRunner().invoke(doctor_command, [])
    assert res.exit_code == 0, res.output
    assert "budgets from the default policy sized from this machine" in res.output
    assert "models: none registered" in res.output


class _Running(BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({"workers": [{"model": "tiny", "state": "ready", "pid": 7}]})
        wants_key = self.path == "/keyed/running"
        if wants_key and self.headers.get("Authorization") != "Bearer k":
            self.send_response(401)
        else:
            self.send_response(200 if self.path in ("/running", "/keyed/running") else 404)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, *args):
        pass


def test_ask_proxy_reads_running_and_turns_failures_into_one_line(monkeypatch):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Running)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        assert ask_proxy(url + "/") == ProxyView(url, (RunningWorker("tiny", "ready", 7),))
        assert ask_proxy(url + "/nope").error == "GET /running answered HTTP 404"
        monkeypatch.delenv("PLIMSOLL_API_KEY", raising=False)
        assert "set PLIMSOLL_API_KEY" in ask_proxy(url + "/keyed").error
        monkeypatch.setenv("PLIMSOLL_API_KEY", "k")
        assert ask_proxy(url + "/keyed").workers == (RunningWorker("tiny", "ready", 7),)
    finally:
        server.shutdown()
        server.server_close()
    assert ask_proxy(url).error.startswith("ConnectError")
    assert ask_proxy("not a url").error
