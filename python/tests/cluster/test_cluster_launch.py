"""The pure parts of clustered serving: rank figures, the proxy's sharded admission, argv,
the status check, the protocol header — no process starts here."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from plimsoll.cluster.backend import transport_bytes
from plimsoll.cluster.launch import (
    GIB,
    admit_sharded,
    cluster_mismatches,
    cluster_serve_argv,
    parse_rank_figures,
    sharded_request,
)
from plimsoll.cluster.protocol import OP_NEW, header
from plimsoll.core.policy import Policy

POLICY = {"schemaVersion": 1, "host": "box", "totalRamGb": 64, "osFloorGb": 4,
          "modes": {"standalone": {"maxLocalLlmGb": 1}, "clustered": {"maxLocalLlmGb": 2}}}


def policy(model: Path, **entry) -> Policy:
    return Policy.model_validate(POLICY | {"models": {"big": {
        "path": str(model), "context": 2048, "maxTokens": 256, "concurrency": 2,
        "sharded": True, **entry}}})


@pytest.mark.pure
def test_rank_figures_parse_and_refuse_with_what_to_write():
    assert parse_rank_figures("4") == (4 * GIB, 4 * GIB, 4 * GIB)
    assert parse_rank_figures("8:16:6") == (8 * GIB, 16 * GIB, 6 * GIB)
    for bad in ("", "x", "4:0", "1:2:3:4", "-1", "inf", "nan"):
        with pytest.raises(ValueError, match=r"GIB|GiB"):
            parse_rank_figures(bad)


@pytest.mark.pure
def test_bad_cluster_rank_flags_are_usage_errors():
    from plimsoll.cli.main import main

    out = CliRunner().invoke(main, ["cluster", "serve", ".", "--rank", "four"])
    assert out.exit_code == 2 and "CEILING_GIB" in out.output
    out = CliRunner().invoke(main, ["serve", "--cluster-rank", "0"])
    assert out.exit_code == 2 and "--cluster-rank" in out.output


def test_the_proxy_admits_a_sharded_model_on_every_ranks_figures(tiny_model):
    pol = policy(tiny_model)
    facts, d0, decision = admit_sharded(tiny_model, pol.models["big"], pol,
                                        (parse_rank_figures("4"), parse_rank_figures("4")))
    assert decision.action == "commit" and d0.admitted
    assert (d0.concurrency, d0.context) == (2, 2048)
    # rank 0's share (with the ring backend's own buffers), not the whole model
    assert d0.weights_bytes - transport_bytes("ring", 2).bytes < facts.weights_bytes
    assert any("rank 0's share" in line for line in d0.reasons)
    # one rank too small: refused before anything starts, with every rank's reasons
    _, d0, decision = admit_sharded(tiny_model, pol.models["big"], pol,
                                    (parse_rank_figures("4"), parse_rank_figures(str(1 / 1024))))
    assert decision.action == "rollback" and decision.refusing_ranks == [1]
    assert not d0.admitted
    assert any("rank 1" in line for line in d0.reasons)
    assert any("rank 0" in line for line in d0.reasons)


def test_cluster_serve_argv_carries_every_figure(tiny_model):
    from plimsoll.launch.spawn import worker_config

    pol = policy(tiny_model)
    ranks = (parse_rank_figures("4"), parse_rank_figures("2.5:8:2"))
    facts, d0, _ = admit_sharded(tiny_model, pol.models["big"], pol, ranks)
    cfg = worker_config(tiny_model, "big", facts, d0, pol.models["big"], pol, port=9123)
    argv = cluster_serve_argv(cfg, ranks, sharded_request(pol.models["big"], pol))
    assert argv[argv.index("--port") + 1] == "9123"
    assert argv[argv.index("--model-name") + 1] == "big"
    assert argv[argv.index("--context") + 1] == "2048"
    assert argv[argv.index("--backend") + 1] == "ring"
    nccl = cluster_serve_argv(cfg, ranks, sharded_request(pol.models["big"], pol, "nccl"))
    assert nccl[nccl.index("--backend") + 1] == "nccl"
    ranks_given = [argv[i + 1] for i, a in enumerate(argv) if a == "--rank"]
    assert [parse_rank_figures(r) for r in ranks_given] == list(ranks)  # exact round trip


def test_the_status_check_names_what_differs(tiny_model):
    from plimsoll.launch.spawn import worker_config

    pol = policy(tiny_model)
    facts, d0, _ = admit_sharded(tiny_model, pol.models["big"], pol, (parse_rank_figures("4"),))
    cfg = worker_config(tiny_model, "big", facts, d0, pol.models["big"], pol, port=9123)
    good = {"context": {"configured": 2048}, "max_num_seqs": 2, "cluster": {
        "decision": {"action": "commit"},
        "ranks": [{"rank": 0, "memory_limit_applied_bytes": 5, "allocation_limit_bytes": 5}]}}
    assert cluster_mismatches(cfg, good) == []
    bad = good | {"max_num_seqs": 1, "cluster": good["cluster"] | {"ranks": [
        {"rank": 0, "memory_limit_applied_bytes": 9, "allocation_limit_bytes": 5}]}}
    problems = cluster_mismatches(cfg, bad)
    assert any("max_num_seqs" in p for p in problems)
    assert any("rank 0: memory limit applied 9" in p for p in problems)
    assert cluster_mismatches(cfg, {})  # no cluster section: not a clustered worker


@pytest.mark.pure
def test_the_header_carries_sampling_exactly():
    head = header(OP_NEW, slot=1, n=7, max_tokens=9, temperature=0.7, top_p=0.95, seed=42)
    assert head == [OP_NEW, 1, 7, 9, 700_000, 950_000, 43]
    assert header(OP_NEW)[-1] == 0  # no seed
    assert all(-(1 << 31) <= v < (1 << 31) for v in header(OP_NEW, seed=(1 << 62)))
