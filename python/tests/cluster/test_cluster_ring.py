"""Clustered mode for real: two ranks on 127.0.0.1 over MLX's ring backend.

Each rank is its own process with its own figures on its command line (standing in for
two hosts); the supervisor (:class:`plimsoll.cluster.runner.Cluster`) starts them as
``mlx.launch --backend ring`` would (``MLX_RANK`` + the ring hostfile in ``MLX_HOSTFILE``)
and watches them itself, since ``mlx.launch`` exits 0 even when ranks fail.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import worker_env

from plimsoll.cluster.plan import ClusterRequest
from plimsoll.cluster.runner import (
    Cluster,
    ClusterError,
    ClusterRankFailed,
    ClusterRefused,
    RankSpec,
    ring_hostfile,
)
from plimsoll.web.serve import free_port

GIB = 1 << 30
REQUEST = ClusterRequest(concurrency=1, context=2048, max_tokens=512, min_context=1024,
                         stage="loop")  # the per-layer loop (the engine: test_cluster_engine)

_PROBE = textwrap.dedent("""
    import mlx.core as mx
    g = mx.distributed.init(backend="ring", strict=True)
    x = mx.distributed.all_sum(mx.array([1.0]), group=g)
    mx.eval(x)
    print(int(x.item()))
""")


@pytest.fixture(scope="module")
def ring_ok(tmp_path_factory) -> None:
    """Skip (with the reason) if two ring ranks cannot all-sum on 127.0.0.1 here."""
    d = tmp_path_factory.mktemp("ring")
    hostfile = d / "hosts.json"
    hostfile.write_text(ring_hostfile([("127.0.0.1", free_port()), ("127.0.0.1", free_port())]))
    procs = [subprocess.Popen([sys.executable, "-c", _PROBE], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, start_new_session=True,
                              env=os.environ | {"MLX_RANK": str(r), "MLX_HOSTFILE": str(hostfile)})
             for r in range(2)]
    outs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
                q.wait(5)
            pytest.skip("the ring backend did not initialise within 30 s on 127.0.0.1")
        outs.append((p.returncode, out.strip(), err.strip()[-300:]))
    if any(code != 0 or out != "2" for code, out, _ in outs):
        pytest.skip(f"the ring backend cannot initialise here: {outs}")


@pytest.fixture(scope="module")
def hybrid_model(tmp_path_factory):
    from plimsoll.demo.model import build_demo_model

    # float32: mlx's CPU backend runs the MoE layers in float32 only
    return build_demo_model(tmp_path_factory.mktemp("models") / "hybrid", preset="hybrid")


def chat_prompt(model_dir) -> list[int]:
    """The chat-templated "def main():" through the model's own tokenizer.json."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    return tok.encode("<|im_start|>user\ndef main():<|im_end|>\n<|im_start|>assistant\n").ids


@pytest.fixture(scope="module")
def prompt(tiny_model) -> list[int]:
    return chat_prompt(tiny_model)


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1].startswith("Z")  # a zombie holds no memory
    except FileNotFoundError:
        return True


def ranks(*ceilings_gib: float) -> list[RankSpec]:
    return [RankSpec(ceiling_bytes=int(c * GIB), total_ram_bytes=int(c * GIB),
                     budget_bytes=int(c * GIB)) for c in ceilings_gib]


def run(model, specs, prompts, max_tokens=16):
    """Start, serve ``prompts`` then one request past the committed context, shut down."""
    with Cluster(model, specs, REQUEST, env=worker_env()) as c:
        decision = c.start(timeout=60)
        outs = [c.generate(p, max_tokens, timeout=30) for p in prompts]
        with pytest.raises(ClusterError) as too_long:
            c.generate([1] * REQUEST.context, 100, timeout=30)
        outs.append(c.generate(prompts[0], max_tokens, timeout=30))  # still serving after it
        ready = dict(c.ready)
        pids = c.pids
    assert all(gone(pid) for pid in pids)
    return decision, outs, ready, str(too_long.value)


# tiny (qwen3, 4 layers, tied head): even budgets → a 2 + 2 split.
# hybrid (qwen3_next, 8 layers, every 4th full attention, MoE): 6 GiB and 2 GiB ranks → 6 + 2.
SHARDED = {"tiny": ((4, 4), [[0, 2], [2, 4]]), "hybrid": ((6, 2), [[0, 6], [6, 8]])}


@pytest.fixture(scope="module", params=sorted(SHARDED))
def served(request, ring_ok):
    """The same prompts through one rank and through two ranks (a layer split)."""
    model = request.getfixturevalue(f"{request.param}_model")
    prompt = chat_prompt(model)
    prompts = [prompt, [10, 20, 30, 40, 50, 60], prompt[:5]]
    ceilings, _ = SHARDED[request.param]
    return (request.param, model, prompt, run(model, ranks(4), prompts),
            run(model, ranks(*ceilings), prompts))


def test_sharded_greedy_output_equals_one_rank(served, record_property):
    preset, model, _, (single_d, single, single_ready, _), (sharded_d, sharded, ready, _) = served
    assert single_d.action == sharded_d.action == "commit"
    assert sharded[-1].tokens == sharded[0].tokens  # a fresh cache per request
    for one, two in zip(single, sharded, strict=True):
        assert len(one.tokens) == 16
        assert two.tokens == one.tokens
    # each rank loaded exactly its planned share (from the headers), on its budget's layers
    assert [ready[r]["layers"] for r in (0, 1)] == SHARDED[preset][1]
    for event in ready.values():
        assert event["loaded_bytes"] == event["planned_weights_bytes"]
    # together: the model once, plus the embedding matrix again as the last rank's tied head
    config = json.loads((model / "config.json").read_text())
    tied = config.get("tie_word_embeddings", False)
    embed = config["vocab_size"] * config["hidden_size"] * 4 if tied else 0
    assert sum(e["loaded_bytes"] for e in ready.values()) == single_ready[0]["loaded_bytes"] + embed
    record_property("tokens_per_s", {"single": single[0].tokens_per_s,
                                     "sharded": sharded[0].tokens_per_s})


def test_sharded_matches_mlx_lm_itself(served):
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    _, model_dir, prompt, _, (_, sharded, _, _) = served
    model, _ = load(str(model_dir))
    reference = [int(y) for y, _ in generate_step(mx.array(prompt), model, max_tokens=16)]
    assert sharded[0].tokens == reference


def test_a_rank_too_small_refuses_the_whole_load(ring_ok, tiny_model):
    c = Cluster(tiny_model, ranks(4, 1 / 1024), REQUEST, env=worker_env())
    try:
        with pytest.raises(ClusterRefused) as refused:
            c.start(timeout=60)
    finally:
        c.kill()
    err = refused.value
    assert err.decision.action == "rollback" and err.decision.refusing_ranks == [1]
    assert set(err.reasons) == {0, 1}  # every rank's figures and reasons reach the caller
    assert any("ceiling" in line or "does not fit" in line for line in err.reasons[1])
    assert "rank 1" in str(err)
    # every rank rolled back by itself (exit 3), loaded nothing, and no process remains
    assert [p.returncode for p in c.procs] == [3, 3]
    assert all(gone(pid) for pid in c.pids)
    assert c.ready == {}
    c.close()


def test_killing_a_rank_mid_request_tears_down_the_other(ring_ok, tiny_model, prompt):
    c = Cluster(tiny_model, ranks(4, 4), REQUEST, env=worker_env())
    seen: list[int] = []

    def kill_rank_1_after_a_few(token: int) -> None:
        seen.append(token)
        if len(seen) == 4:
            os.kill(c.pids[1], 9)

    try:
        c.start(timeout=60)
        with pytest.raises(ClusterRankFailed) as failed:
            c.generate(prompt, 500, timeout=30, on_token=kill_rank_1_after_a_few)
    finally:
        c.close()
    err = failed.value
    assert 4 <= len(seen) < 500
    assert "rank(s) [1]" in str(err) and "torn down" in str(err)
    assert any("signal 9" in line for line in err.reasons[1])
    assert any("lost a peer" in line for line in err.reasons[0])
    assert all(p.returncode is not None for p in c.procs)
    assert all(gone(pid) for pid in c.pids)


def test_requests_past_the_committed_context_are_refused(served):
    *_, (_, _, _, refusal) = served
    assert "committed context 2048" in refusal


def test_under_mlx_launch_the_ranks_roll_back_though_it_exits_0(ring_ok, tiny_model):
    """The same rank module under ``mlx.launch --backend ring``: one command line for both
    ranks, each picking its own figures by MLX_RANK. mlx.launch itself reports success even
    though both ranks exit 3 — which is why :class:`Cluster` watches the ranks itself."""
    launcher = Path(sys.executable).parent / "mlx.launch"
    if not launcher.exists():
        pytest.skip(f"no mlx.launch beside {sys.executable}")
    figures = [{"ceiling_bytes": 4 * GIB, "total_ram_bytes": 4 * GIB},
               {"ceiling_bytes": 1 << 20, "total_ram_bytes": 1 << 20}]
    argv = [str(launcher), "--backend", "ring", "--hosts", "127.0.0.1,127.0.0.1",
            "--starting-port", str(free_port()), "--", sys.executable, "-m",
            "plimsoll.cluster.rank", "--model", str(tiny_model),
            "--figures-by-rank", json.dumps(figures)]
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=worker_env(),
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the session this test started, nothing else
        proc.communicate(timeout=10)
        pytest.fail("mlx.launch did not finish within 60 s")
    events = []
    for line in out.splitlines():  # mlx.launch relays both ranks' output through one pipe
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    decisions = [e["decision"] for e in events if e.get("event") == "decision"]
    assert decisions, f"no decision relayed by mlx.launch: {out[-2000:]!r} {err[-2000:]!r}"
    assert all(d == decisions[0] for d in decisions)
    assert decisions[0]["action"] == "rollback" and decisions[0]["refusing_ranks"] == [1]
    assert not any(e.get("event") == "ready" for e in events)
    assert proc.returncode == 0  # mlx.launch's own status says nothing about the ranks
    assert err.count("exited with code 3") == 2, err[-2000:]


def test_a_rank_that_runs_out_tears_down_every_peer(ring_ok, tiny_model, prompt):
    """Rank 1 (a 64 MiB host) spikes 64 MiB mid-request: it stops itself, and the ring with it."""
    specs = ranks(4, 1 / 16)
    specs[1].env = {"PLIMSOLL_CLUSTER_FAULT_BYTES": str(64 << 20),
                    "PLIMSOLL_CLUSTER_FAULT_AT": "3"}
    c = Cluster(tiny_model, specs, REQUEST, env=worker_env())
    try:
        assert c.start(timeout=60).action == "commit"
        with pytest.raises(ClusterRankFailed) as failed:
            c.generate(prompt, 200, timeout=30)
    finally:
        c.close()
    err = failed.value
    assert "rank(s) [1]" in str(err)
    assert any("exited 6 (ran out of its admitted memory)" in line for line in err.reasons[1])
    assert any("ran out of its admitted memory at decode step 3" in line
               for line in err.reasons[1])
    assert all(p.returncode is not None for p in c.procs)
    assert all(gone(pid) for pid in c.pids)
