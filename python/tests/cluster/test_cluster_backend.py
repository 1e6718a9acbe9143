"""The cluster's MLX backend: chosen from what MLX reports, refused with a reason when a named
one is not available, launched with each backend's environment, counted in admission, and
carried by the Nix module into every member's command.

The pure choice is checked on hand-built availabilities (so jaccl and nccl hosts are covered
on this CPU box); the rest runs for real: this host's MLX (ring only: no CUDA, no RDMA),
the CLI as a process, and Nix evaluation of the module (pure ``cluster.nix``, and the
nix-darwin module itself when NIX_DARWIN_SRC / NIXPKGS_LIB name local snapshots).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from plimsoll.cluster import plan as cp
from plimsoll.cluster.backend import (
    Availability,
    backend_from_env,
    choose,
    launches,
    read_availability,
    transport_bytes,
    world_refusal,
)

REPO = Path(__file__).resolve().parents[3]
GIB = 1 << 30
MAC = Availability(mlx="0.32.4", ring=True, jaccl=True)
CUDA = Availability(mlx="0.32.4", ring=True, nccl=True, cuda=True)
CPU = Availability(mlx="0.32.4", ring=True)


# ---- the choice (pure) ---------------------------------------------------------------------


def test_auto_takes_the_first_available_ring_last():
    assert choose("auto", CUDA, setting="s").backend == "nccl"
    assert choose("auto", MAC, setting="s").backend == "jaccl"
    assert choose("auto", CPU, setting="s").backend == "ring"
    # nccl built but no device: not available
    assert choose("auto", CUDA.model_copy(update={"cuda": False}), setting="s").backend == "ring"
    # every rank on this host: jaccl (which links separate Macs) is out, ring is taken
    local = choose("auto", MAC, setting="s", local=True)
    assert local.backend == "ring" and "jaccl" in local.reason


def test_a_named_backend_that_is_not_available_is_refused_with_what_to_change():
    refused = choose("nccl", CPU, setting="settings.cluster.backend")
    assert refused.backend is None
    assert "settings.cluster.backend is 'nccl'" in refused.reason
    assert "not its CUDA build" in refused.reason
    assert 'set settings.cluster.backend to "auto" or \'ring\'' in refused.reason
    jaccl = choose("jaccl", CUDA, setting="--backend")
    assert jaccl.backend is None and "rdma_ctl enable" in jaccl.reason
    assert "'nccl' or 'ring'" in jaccl.reason
    assert choose("nccl", CUDA, setting="s").backend == "nccl"
    broken = Availability(error="ModuleNotFoundError: No module named 'mlx'")
    assert choose("auto", broken, setting="s").backend is None
    assert "install MLX" in choose("ring", broken, setting="s").reason


def test_this_hosts_mlx_offers_ring_and_not_nccl():
    import mlx.core as mx

    here = read_availability()  # a child process, as the CLI and the proxy ask it
    assert here.error is None and here.mlx == mx.__version__
    assert here.ring and here.usable("ring")
    assert here.usable("nccl") == (mx.distributed.is_available(backend="nccl")
                                   and mx.cuda.is_available())
    if here.usable("nccl"):
        pytest.skip("this host has CUDA: the refusal below needs one without")
    assert choose("auto", here, setting="s", local=True).backend == "ring"
    assert choose("nccl", here, setting="s").backend is None


def test_nccl_pairs_two_ranks_only():
    assert world_refusal("nccl", 2) == "" and world_refusal("ring", 8) == ""
    assert "pairs two ranks only, not 3" in world_refusal("nccl", 3)


# ---- what each backend reads, and costs ----------------------------------------------------


def test_each_backend_gets_the_environment_mlx_reads():
    addrs = [("10.0.0.1", 5000), ("10.0.0.2", 5001)]
    ring = launches("ring", addrs)
    assert [r.env for r in ring] == [{"MLX_RANK": "0"}, {"MLX_RANK": "1"}]
    assert json.loads(ring[1].files["MLX_HOSTFILE"]) == [["10.0.0.1:5000"], ["10.0.0.2:5001"]]
    nccl = launches("nccl", addrs, visible_devices=["3"])
    assert nccl[1].env == {"MLX_RANK": "1", "MLX_WORLD_SIZE": "2", "NCCL_HOST_IP": "10.0.0.1",
                           "NCCL_PORT": "5000", "CUDA_VISIBLE_DEVICES": "3"}
    assert launches("nccl", addrs, visible_devices=["0", "1"])[1].env["CUDA_VISIBLE_DEVICES"] == "1"
    devices = [[None, "rdma_en5"], ["rdma_en5", None]]
    jaccl = launches("jaccl", addrs, rdma_devices=devices)
    assert jaccl[1].env == {"MLX_RANK": "1", "MLX_JACCL_COORDINATOR": "10.0.0.1:5000"}
    assert json.loads(jaccl[0].files["MLX_IBV_DEVICES"]) == devices
    with pytest.raises(ValueError, match="RDMA device"):
        launches("jaccl", addrs)
    assert launches("ring", addrs[:1])[0].env == {}  # one rank: no group
    for launch in (ring, nccl, jaccl):  # each is what the rank recognises it as
        env = launch[1].env | {k: "/tmp/f" for k in launch[1].files}
        assert backend_from_env(env) == {id(ring): "ring", id(nccl): "nccl",
                                         id(jaccl): "jaccl"}[id(launch)]
    assert backend_from_env({}) is None


def test_admission_counts_each_backends_buffers(tiny_model):
    from plimsoll.cluster.weights import read_config, tensor_bytes
    from plimsoll.core.model_facts import inspect_model

    facts = inspect_model(tiny_model)
    probes = [cp.RankProbe(rank=r, ceiling_bytes=4 * GIB, total_ram_bytes=4 * GIB,
                           budget_bytes=4 * GIB) for r in range(2)]
    config, tensors = read_config(tiny_model), tensor_bytes(tiny_model)
    footprints = {}
    for backend in ("ring", "jaccl", "nccl"):
        # split by layers on every backend (auto splits every layer over nccl and jaccl):
        # the same shares, so only the buffers differ
        request = cp.ClusterRequest(context=2048, max_tokens=256, min_context=1024,
                                    backend=backend, parallel="pipeline")
        plans = cp.plan_cluster(config, facts, tensors, probes, request)
        cost = transport_bytes(backend, 2)
        assert all(p.transport_bytes == cost.bytes > 0 for p in plans)
        answer = cp.preflight(plans[0], probes[0], facts, request)
        assert answer.admitted
        assert any(f"{backend} buffers {cost.bytes} B" in line for line in answer.reasons)
        footprints[backend] = answer.decision
    # the same model and figures: what is resident differs by exactly the buffers, and the
    # pool that fills the rest of the budget shrinks by as much
    ring, nccl = footprints["ring"], footprints["nccl"]
    more = transport_bytes("nccl", 2).bytes - transport_bytes("ring", 2).bytes
    assert nccl.weights_bytes - ring.weights_bytes == more
    assert (ring.pool_blocks - nccl.pool_blocks) * ring.block_bytes >= more - ring.block_bytes
    assert transport_bytes("ring", 2).bytes == 32 << 20  # 2 sockets x 2 x 8 MiB
    assert transport_bytes("ring", 1).bytes == 0


# ---- the CLI: refused up front, with the reason -------------------------------------------


def plimsoll(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "plimsoll.cli", *args], capture_output=True,
                          text=True, timeout=120)


def cpu_only() -> None:
    if read_availability().usable("nccl"):
        pytest.skip("this host has CUDA: nccl is available here")


def policy_file(tmp_path: Path, model: Path, backend: str) -> Path:
    data = {"schemaVersion": 1, "host": "h", "totalRamGb": 64, "osFloorGb": 4,
            "modes": {"standalone": {"maxLocalLlmGb": 8}, "clustered": {"maxLocalLlmGb": 8}},
            "cluster": {"backend": backend},
            "models": {"m": {"path": str(model), "context": 2048, "maxTokens": 256,
                             "sharded": True}}}
    p = tmp_path / f"policy-{backend}.json"
    p.write_text(json.dumps(data))
    return p


def test_serve_check_refuses_nccl_here_and_passes_auto(tmp_path, tiny_model):
    cpu_only()
    ranks = ["--cluster-rank", "4", "--cluster-rank", "4", "--mode", "clustered"]
    done = plimsoll("serve", "--check", "--policy", str(policy_file(tmp_path, tiny_model,
                                                                    "nccl")), *ranks)
    assert done.returncode == 2, done.stdout
    assert "the policy's cluster.backend is 'nccl' but MLX here is not its CUDA build" \
        in done.stdout
    assert "set the policy's cluster.backend to \"auto\" or 'ring'" in done.stdout
    auto = policy_file(tmp_path, tiny_model, "auto")
    done = plimsoll("serve", "--check", "--policy", str(auto), *ranks)
    assert done.returncode == 0, done.stdout
    assert "ok   cluster backend ring (auto: ring" in done.stdout
    # the flag overrides the policy, and is refused the same way
    done = plimsoll("serve", "--check", "--policy", str(auto), "--cluster-backend", "nccl", *ranks)
    assert done.returncode == 2 and "--cluster-backend is 'nccl'" in done.stdout


def test_cluster_commands_refuse_nccl_here_before_any_rank_starts(tiny_model):
    cpu_only()
    done = plimsoll("cluster", "generate", str(tiny_model), "--rank", "4", "--rank", "4",
                    "--prompt", "hi", "--backend", "nccl")
    assert done.returncode == 2
    assert "--backend is 'nccl' but MLX here is not its CUDA build" in done.stderr
    # a plan may price a backend this host does not have
    done = plimsoll("cluster", "plan", str(tiny_model), "--rank", "4", "--rank", "4",
                    "--context", "2048", "--max-tokens", "256", "--backend", "nccl")
    assert done.returncode == 0, done.stderr
    assert f"nccl {transport_bytes('nccl', 2).bytes} B" in done.stdout


def test_the_doctor_shows_the_backend(tmp_path, tiny_model):
    cpu_only()
    done = plimsoll("doctor", "--json", "--policy", str(policy_file(tmp_path, tiny_model, "nccl")))
    lines = {ln["text"]: ln["level"] for ln in json.loads(done.stdout)["lines"]}
    (line,) = [t for t in lines if t.startswith("cluster backend")]
    assert lines[line] == "error" and "sharded model(s) m cannot load clustered" in line
    assert "is 'nccl' but MLX here is not its CUDA build" in line
    done = plimsoll("doctor", "--json", "--policy", str(policy_file(tmp_path, tiny_model, "auto")))
    (line,) = [ln for ln in json.loads(done.stdout)["lines"]
               if ln["text"].startswith("cluster backend")]
    assert line["level"] == "ok" and line["text"].startswith("cluster backend ring (auto: ring")
    assert "ring yes" in line["text"]


# ---- Nix: the module carries the backend into every member's command ---------------------

NIX = shutil.which("nix-instantiate")
NIX_ENV = {**os.environ, "NIX_CONFIG": "experimental-features = nix-command flakes\n"
           "substituters =\nbuild-users-group =\nsandbox = false"}


def nix_json(*args: str) -> object:
    done = subprocess.run([NIX, "--eval", "--strict", "--json", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=300, env=NIX_ENV)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.skipif(NIX is None, reason="nix-instantiate not installed")
def test_cluster_nix_gives_both_members_the_backend():
    expr = """let c = import ./modules/cluster.nix; hosts = import ./hosts;
      on = b: d: if (d.settings or { }) ? cluster
        then d // { settings = d.settings
          // { cluster = d.settings.cluster // { backend = b; }; }; }
        else d;
      all = b: builtins.mapAttrs (_: on b) hosts;
    in { ring = builtins.mapAttrs (_: d: c.rankArgs d hosts) hosts;
         nccl = builtins.mapAttrs (_: d: c.rankArgs d (all "nccl")) (all "nccl");
         mixed = c.errors (on "jaccl" hosts.studio) hosts; }"""
    got = nix_json("--expr", expr)
    assert got["ring"] == {
        "studio": ["--cluster-backend", "ring", "--cluster-rank", "80:96:80",
                   "--cluster-rank", "52:64:52"],
        "studio-b": ["--cluster-backend", "ring", "--cluster-rank", "52:64:52",
                     "--cluster-rank", "80:96:80"],
        "macbook": []}
    assert [a[:2] for a in got["nccl"].values() if a] == [["--cluster-backend", "nccl"]] * 2
    assert got["mixed"] == [
        'host studio: cluster peer studio-b declares settings.cluster.backend "ring", this '
        'host "jaccl": one cluster runs on one backend, declare the same on both hosts']


# ---- the path nccl takes, run over ring ----------------------------------------------------


def test_messages_as_all_sums_give_the_same_tokens(tiny_model):
    """MLX's nccl has no send/recv: there every pipeline message is an all-sum. The same
    path, forced over ring (``PLIMSOLL_CLUSTER_COLLECTIVE=1``), gives the same greedy tokens
    as send/recv, and each rank reports which path it took."""
    from conftest import worker_env

    from plimsoll.cluster.runner import Cluster, RankSpec

    request = cp.ClusterRequest(context=2048, max_tokens=256, min_context=1024)
    prompt = [10, 20, 30, 40, 50, 60]

    def run(env: dict[str, str]) -> tuple[list[int], list[dict]]:
        specs = [RankSpec(ceiling_bytes=4 * GIB, total_ram_bytes=4 * GIB, budget_bytes=4 * GIB,
                          env=env) for _ in range(2)]
        with Cluster(tiny_model, specs, request, env=worker_env()) as c:
            c.start(timeout=60)
            out = c.generate(prompt, 12, timeout=60).tokens
            return out, [c.ready[r] for r in sorted(c.ready)]

    p2p, p2p_ready = run({})
    summed, summed_ready = run({"PLIMSOLL_CLUSTER_COLLECTIVE": "1"})
    assert len(p2p) == 12 and summed == p2p
    assert [(e["backend"], e["messages"]) for e in p2p_ready] == [("ring", "send/recv")] * 2
    assert [(e["backend"], e["messages"]) for e in summed_ready] == [("ring", "all-sum")] * 2
