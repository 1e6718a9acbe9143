"""A rank's layers on the worker's engine: two ranks over ring on 127.0.0.1, the worker's
scheduler on rank 0 driving every rank's own engine (``ClusterRequest(stage="engine")``,
the default).

Greedy output at concurrency 2 (two sequences running, a third queued; pipelined in two
micro-batches, the default, and in one: both batched in one decode) must equal mlx-lm's own
generation on the unsplit model, for the tiny (qwen3, tied head) and
hybrid (qwen3_next: linear attention state + full attention, MoE) demos; also over the
all-sum path MLX's nccl backend takes. The wire format and the per-stage facts are
checked purely.
"""

from __future__ import annotations

import pytest
from conftest import sharpened_model, worker_env
from hypothesis import given
from hypothesis import strategies as st

from plimsoll.cluster import plan as cp
from plimsoll.cluster import wire
from plimsoll.cluster.rank_facts import stage_facts
from plimsoll.cluster.runner import Cluster, RankSpec
from plimsoll.engine.work import Sampling, Step, Work

GIB = 1 << 30
REQUEST = cp.ClusterRequest(concurrency=2, context=2048, max_tokens=256, min_context=1024,
                            stage="engine")
#: tiny: even budgets → layers 2 + 2; hybrid: 6 GiB and 2 GiB → layers 6 + 2 (both ranks
#: hold linear-attention state and a full-attention layer)
SPLITS = {"tiny": ((4, 4), [[0, 2], [2, 4]]), "hybrid": ((6, 2), [[0, 6], [6, 8]])}
NEW = 12


@pytest.fixture(scope="module")
def sharp_tiny(tiny_model, tmp_path_factory):
    """The tiny demo with its matrices scaled, saved as a model (conftest.sharpened_model)."""
    return sharpened_model(tiny_model, tmp_path_factory.mktemp("models") / "tiny-sharp")


@pytest.fixture(scope="module")
def hybrid_model(tmp_path_factory):
    from plimsoll.demo.model import build_demo_model

    return build_demo_model(tmp_path_factory.mktemp("models") / "hybrid", preset="hybrid")


def prompts_for(model_dir) -> list[list[int]]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    long = tok.encode("import os\nclass Foo:\n    def bar(self, x):\n        return x + 1\n"
                      "def main():\n    print(Foo().bar(2))\n").ids
    return [long, [10, 20, 30, 40, 50, 60], long[:5]]  # 3 prompts, 2 at a time


def reference(model_dir, prompts: list[list[int]]) -> list[list[int]]:
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    model, _ = load(str(model_dir))
    return [[int(y) for y, _ in generate_step(mx.array(p), model, max_tokens=NEW)]
            for p in prompts]


def serve(model_dir, preset: str, env: dict[str, str] | None = None, request=REQUEST):
    ceilings, _ = SPLITS[preset]
    specs = [RankSpec(ceiling_bytes=c * GIB, total_ram_bytes=c * GIB, budget_bytes=c * GIB,
                      env=env or {}) for c in ceilings]
    with Cluster(model_dir, specs, request, env=worker_env()) as c:
        decision = c.start(timeout=120)
        done = c.generate_many(prompts_for(model_dir), NEW, timeout=120, ignore_eos=True)
        again = c.generate_many(prompts_for(model_dir)[:1], NEW, timeout=120, ignore_eos=True)
        return decision, done, again, dict(c.ready)


def test_the_engine_is_the_default_stage_pipelined_in_two_micro_batches():
    assert (cp.ClusterRequest().stage, cp.ClusterRequest().micro_batches) == ("engine", 2)


@pytest.mark.parametrize("preset", sorted(SPLITS))
def test_the_stage_on_the_engine_equals_the_unsplit_model(preset, request):
    """Pipelined (the default): the two sequences decode in alternate steps, one on rank 0
    while the other is on rank 1."""
    model_dir = request.getfixturevalue("sharp_tiny" if preset == "tiny" else "hybrid_model")
    decision, done, again, ready = serve(model_dir, preset)
    assert decision.action == "commit" and decision.concurrency == 2
    assert decision.pool_blocks > 0
    assert [ready[r]["layers"] for r in (0, 1)] == SPLITS[preset][1]
    assert {ready[r]["stage"] for r in (0, 1)} == {"engine"}
    want = reference(model_dir, prompts_for(model_dir))
    assert len(set(map(tuple, want))) == 3 and len(set(want[0])) > 1  # a meaningful check
    assert done["outputs"] == want
    assert done["most_rows"] == 1  # alternate halves of the two running sequences
    assert done["overlapped"] >= NEW  # a step went out while the one before was on rank 1
    assert again["outputs"] == want[:1]  # freed state and blocks: the next request is fresh


def test_one_micro_batch_decodes_both_sequences_in_each_step(sharp_tiny):
    one = REQUEST.model_copy(update={"micro_batches": 1})
    _, done, _, _ = serve(sharp_tiny, "tiny", request=one)
    assert done["outputs"] == reference(sharp_tiny, prompts_for(sharp_tiny))
    assert done["most_rows"] == 2  # two sequences decoded in one step: the concurrency
    assert done["overlapped"] == 0


def test_the_all_sum_path_on_the_engine_gives_the_same_tokens(hybrid_model):
    _, done, _, ready = serve(hybrid_model, "hybrid", {"PLIMSOLL_CLUSTER_COLLECTIVE": "1"})
    assert {ready[r]["messages"] for r in (0, 1)} == {"all-sum"}
    assert done["outputs"] == reference(hybrid_model, prompts_for(hybrid_model))
    assert done["overlapped"] == 0  # all-sums pair in order: never pipelined


# ---- pure parts ------------------------------------------------------------------------------

works = st.builds(
    Work, seq_id=st.integers(0, 1 << 30), tokens=st.lists(st.integers(0, 1000), min_size=1,
                                                          max_size=5).map(tuple),
    start=st.integers(0, 1 << 20), block_table=st.lists(st.integers(0, 1 << 30),
                                                        max_size=6).map(tuple),
    sample=st.booleans(), sampling=st.builds(
        Sampling, temperature=st.floats(0, 5), top_p=st.floats(0, 1),
        seed=st.one_of(st.none(), st.integers(0, (1 << 64) - 1)),
        top_k=st.integers(0, 1000), min_p=st.floats(0, 1)))


@given(st.lists(st.tuples(works, works), min_size=1, max_size=3), st.booleans())
def test_steps_cross_the_wire_exactly(pairs, tokens):
    """Every field but the token ids, which go only where every rank embeds (tensor)."""
    sent, received = wire.Tables(), wire.Tables()
    for decode, prefill in pairs:
        prefill = Work(seq_id=decode.seq_id + 1, tokens=prefill.tokens, start=prefill.start,
                       block_table=prefill.block_table, sample=prefill.sample,
                       sampling=prefill.sampling)
        step = Step(decodes=(decode,), prefills=(prefill,))
        payload = wire.encode_step(step, sent, tokens=tokens)
        assert all(-(1 << 31) <= v < (1 << 31) for v in payload)  # int32 on the wire
        got = wire.decode_step(payload, received, tokens=tokens)
        for w, g in zip((decode, prefill), (*got.decodes, *got.prefills), strict=True):
            assert (g.seq_id, g.start, g.block_table, g.sample, g.sampling) == (
                w.seq_id, w.start, w.block_table, w.sample, w.sampling)
            assert g.tokens == (w.tokens if tokens else (0,) * len(w.tokens))
        assert wire.sampled(got) == wire.sampled(step)


def test_a_growing_table_sends_only_its_new_blocks():
    sent = wire.Tables()
    step = Step(decodes=(Work(1, (5,), 40, (7, 3, 9), True),))
    first = wire.encode_step(step, sent)
    again = wire.encode_step(step, sent)
    grown = wire.encode_step(Step(decodes=(Work(1, (5,), 48, (7, 3, 9, 4), True),)), sent)
    assert first[-5:] == [0, 3, 7, 3, 9] and again[-2:] == [3, 0] and grown[-3:] == [3, 1, 4]
    with pytest.raises(ValueError, match="names its tokens"):
        wire.encode_step(Step(decodes=(Work(1, None, 48, (7,), True),)), sent)


@pytest.mark.parametrize("preset", sorted(SPLITS))
def test_stage_facts_add_up_to_the_model(preset, request):
    from plimsoll.core.model_facts import inspect_model

    model_dir = request.getfixturevalue("tiny_model" if preset == "tiny" else "hybrid_model")
    facts = inspect_model(model_dir)
    parts = [stage_facts(facts, a, b, 1) for a, b in SPLITS[preset][1]]
    assert sum(p.num_layers for p in parts) == facts.num_layers
    assert sum(p.kv_bytes_per_token for p in parts) == facts.kv_bytes_per_token
    assert sum(p.per_sequence_fixed_bytes for p in parts) == facts.per_sequence_fixed_bytes
    assert sum(p.kv_layers for p in parts) == facts.kv_layers
    for p, (a, b) in zip(parts, SPLITS[preset][1], strict=True):
        assert {i for c in p.caches for i in c.layers} == set(range(b - a))


# ---- over HTTP: the worker's API, two requests at once -------------------------------------


@pytest.mark.parametrize("stage", ["engine", "loop", "tensor"])
def test_http_on_the_engine_answers_what_a_single_worker_answers(tiny_model, stage):
    """``plimsoll cluster serve`` (the engine stage, the default; ``--stage loop`` still
    selectable; ``--parallel tensor`` on the engine): two requests in flight at once get
    what a single-process worker gives each, and the status says which stage every rank
    runs, pipelined on the engine split by layers."""
    import concurrent.futures

    from conftest import Worker
    from test_cluster_serve import ClusterServe, complete

    prompts = ("def main():", "hello world, this is a test")
    single = Worker(tiny_model)
    try:
        one = [complete(single.url, p, 24)["choices"][0]["text"] for p in prompts]
    finally:
        single.stop()
    served = ClusterServe(tiny_model, "4", "4",
                          extra={"loop": ["--stage", "loop"],
                                 "tensor": ["--parallel", "tensor"]}.get(stage))
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            two = list(pool.map(lambda p: complete(served.url, p, 24), prompts))
        status = served.status()
    finally:
        assert served.stop() == 0
    assert [t["choices"][0]["text"] for t in two] == one
    assert status["cluster"]["stage"] == ("loop" if stage == "loop" else "engine")
    assert status["cluster"]["parallel"] == ("tensor" if stage == "tensor" else "pipeline")
    assert status["max_num_seqs"] == 2
    assert status["cluster"]["pipelined"] is (stage == "engine")
    assert [r["messages"] for r in status["cluster"]["ranks"]] == ["send/recv"] * 2


def test_a_rank_that_runs_out_on_the_engine_tears_down_every_peer(tiny_model):
    """Rank 1 (a 64 MiB host) spikes 64 MiB at its fourth step: it stops itself (exit 6)
    before running it, and the ring with it; rank 0 fails the request with the reason."""
    from test_cluster_ring import gone

    from plimsoll.cluster.exits import ClusterRankFailed

    specs = [RankSpec(ceiling_bytes=c, total_ram_bytes=c, budget_bytes=c)
             for c in (4 * GIB, GIB // 16)]
    specs[1].env = {"PLIMSOLL_CLUSTER_FAULT_BYTES": str(64 << 20),
                    "PLIMSOLL_CLUSTER_FAULT_AT": "3"}
    c = Cluster(tiny_model, specs, REQUEST, env=worker_env())
    try:
        assert c.start(timeout=120).action == "commit"
        with pytest.raises(ClusterRankFailed) as failed:
            c.generate_many([[10, 20, 30, 40, 50, 60]], 200, timeout=60)
    finally:
        c.close()
    err = failed.value
    assert "rank(s) [1]" in str(err)
    assert any("exited 6 (ran out of its admitted memory)" in line for line in err.reasons[1])
    assert any("ran out of its admitted memory at step 3" in line for line in err.reasons[1])
    assert all(gone(pid) for pid in c.pids)


@pytest.mark.parametrize("rank", [0, 1])
def test_a_stage_names_its_weights_as_the_engine_reads_them(tiny_model, rank):
    """The engine reads the model's parameter names where a decode kernel is on (a GPU):
    a stage answers ``parameters()`` with exactly its own layers' weights (and the head
    on the last rank)."""
    from types import SimpleNamespace

    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm import load

    from plimsoll.cluster.engine_stage import StageModel

    model, _ = load(str(tiny_model))
    n = len(model.model.layers)
    start, end = (0, n // 2) if rank == 0 else (n // 2, n)
    plan = SimpleNamespace(layer_start=start, layer_end=end)
    stage = StageModel(mx, SimpleNamespace(rank=rank, size=2), model, plan,
                       [None] * n)
    names = {name for name, _ in tree_flatten(stage.parameters())}
    mine = {f"layers.{i - start}.{name}" for i in range(start, end)
            for name, _ in tree_flatten(model.model.layers[i].parameters())}
    assert mine and mine <= names
    assert all(name.startswith(("layers.", "lm_head.")) for name in names)
    assert names - mine == ({name for name in names if name.startswith("lm_head.")})


@given(st.integers(1, 9), st.integers(1, 40))
def test_split_decodes_take_disjoint_halves_and_starve_none(n, steps):
    """The scheduler's ``split_decodes`` (pure: its plan over runs, no engine): each step
    decodes only sequences with no token in flight, at most half of them rounded up, and
    every sequence decodes at least every other step (so two steps overlap across ranks)."""
    from plimsoll.worker.events import GenRequest, SchedulerLimits
    from plimsoll.worker.scheduler import Scheduler
    from plimsoll.worker.waiting import Run

    sched = Scheduler.__new__(Scheduler)
    sched.limits = SchedulerLimits(n, 1, 1.0, 0, split_decodes=True)
    sched._running = {}
    for _ in range(n):
        req = GenRequest(prompt=[1], max_tokens=1000, sink=lambda _e: None)
        sched._running[req.id] = Run(req, [1], 1, 1, 0)
    inflight: set[int] = set()
    last = {seq: -1 for seq in sched._running}
    for step in range(steps):
        chosen = {run.req.id for run in sched._decoding()}
        # one sequence alone waits out its own token: every other step is empty
        assert (chosen or n == 1) and not chosen & inflight and len(chosen) <= -(-n // 2)
        for seq in chosen:
            sched._running[seq].pending = 1
            last[seq] = step
        for seq in inflight:  # the step before is read after this one is submitted
            sched._running[seq].pending = 0
        inflight = chosen
        assert all(step - s <= 2 for s in last.values())  # none waits two steps


# ---- tensor parallel ------------------------------------------------------------------------


def test_tensor_parallel_on_the_engine_equals_the_unsplit_model(sharp_tiny):
    """Every layer split across the two ranks by mlx-lm's ``shard`` (1 of the 2 KV heads
    each, two all-sums a layer): the same greedy tokens as the unsplit model, both
    sequences in one decode step, each rank loaded with its half of every projection."""
    tensor = REQUEST.model_copy(update={"parallel": "tensor"})
    decision, done, again, ready = serve(sharp_tiny, "tiny", request=tensor)
    assert decision.action == "commit" and decision.concurrency == 2
    assert {ready[r]["parallel"] for r in (0, 1)} == {"tensor"}
    assert [ready[r]["layers"] for r in (0, 1)] == [[0, 4], [0, 4]]
    want = reference(sharp_tiny, prompts_for(sharp_tiny))
    assert done["outputs"] == want and again["outputs"] == want[:1]
    assert done["most_rows"] == 2 and done["overlapped"] == 0
    from plimsoll.cluster.weights import tensor_bytes

    whole = sum(tensor_bytes(sharp_tiny).values())
    for r in (0, 1):  # what each rank evaluated is the share the plan admitted, under whole
        assert ready[r]["loaded_bytes"] == ready[r]["planned_weights_bytes"] < whole


def test_a_tensor_plan_halves_the_kv_and_the_projections_and_refuses_what_does_not_divide(
        tiny_model, hybrid_model):
    from plimsoll.cluster.rank_facts import tensor_facts
    from plimsoll.cluster.weights import read_config, tensor_bytes
    from plimsoll.core.model_facts import inspect_model

    tensor = REQUEST.model_copy(update={"parallel": "tensor"})
    probes = [cp.RankProbe(rank=r, ceiling_bytes=4 * GIB, total_ram_bytes=4 * GIB,
                           budget_bytes=4 * GIB) for r in (0, 1)]
    config, facts, sizes = read_config(tiny_model), inspect_model(tiny_model), \
        tensor_bytes(tiny_model)
    plans = cp.plan_cluster(config, facts, sizes, probes, tensor)
    projections = sum(b for n, b in sizes.items() if "_proj." in n)
    assert [p.weights_bytes for p in plans] == [sum(sizes.values()) - projections // 2] * 2
    assert {p.kv_bytes_per_token for p in plans} == {facts.kv_bytes_per_token // 2}
    assert {(p.layer_start, p.layer_end, p.holds_embeddings, p.holds_head)
            for p in plans} == {(0, 4, True, True)}
    mine = tensor_facts(facts, 2, plans[0].weights_bytes)
    assert (mine.num_key_value_heads, mine.kv_bytes_per_token) == (
        facts.num_key_value_heads // 2, facts.kv_bytes_per_token // 2)
    three = [*probes, probes[0].model_copy(update={"rank": 2})]
    with pytest.raises(cp.ClusterPlanError, match="num_attention_heads = 8 does not divide by 3"):
        cp.plan_cluster(config, facts, sizes, three, tensor)
    with pytest.raises(cp.ClusterPlanError, match="qwen3_next: tensor parallelism serves"):
        cp.plan_cluster(read_config(hybrid_model), inspect_model(hybrid_model),
                        tensor_bytes(hybrid_model), probes, tensor)
    with pytest.raises(cp.ClusterPlanError, match="engine stage"):
        cp.plan_cluster(config, facts, sizes, probes, tensor.model_copy(update={"stage": "loop"}))


def test_auto_splits_every_layer_only_over_a_fast_link_and_where_the_model_splits(
        tiny_model, hybrid_model):
    """``--parallel auto`` (the default): tensor over nccl or jaccl where the model splits on
    the engine stage; layers over ring, for a model tensor parallelism does not serve, for
    ranks its heads do not divide by, on the loop stage; a named split is kept. The plan
    follows the choice (a tensor plan gives every rank every layer)."""
    from plimsoll.cluster.weights import read_config, tensor_bytes
    from plimsoll.core.model_facts import inspect_model

    config, facts = read_config(tiny_model), inspect_model(tiny_model)
    hybrid = read_config(hybrid_model), inspect_model(hybrid_model)
    assert REQUEST.parallel == "auto"

    def chosen(request, ranks=2, model=(config, facts)):
        return cp.resolve_parallel(request, *model, ranks).parallel

    nccl, jaccl = (REQUEST.model_copy(update={"backend": b}) for b in ("nccl", "jaccl"))
    assert chosen(nccl) == chosen(jaccl) == "tensor"
    assert chosen(REQUEST) == "pipeline"  # ring
    assert chosen(nccl, model=hybrid) == "pipeline"  # qwen3_next: not split by tensor
    assert chosen(nccl, ranks=3) == "pipeline"  # 8 heads do not divide by 3
    assert chosen(nccl, ranks=1) == "pipeline"
    assert chosen(nccl.model_copy(update={"stage": "loop"})) == "pipeline"
    assert chosen(nccl.model_copy(update={"parallel": "pipeline"})) == "pipeline"
    assert chosen(REQUEST.model_copy(update={"parallel": "tensor"})) == "tensor"
    probes = [cp.RankProbe(rank=r, ceiling_bytes=4 * GIB, total_ram_bytes=4 * GIB,
                           budget_bytes=4 * GIB) for r in (0, 1)]
    plans = cp.plan_cluster(config, facts, tensor_bytes(tiny_model), probes, nccl)
    assert {(p.layer_start, p.layer_end) for p in plans} == {(0, 4)}
    plans = cp.plan_cluster(config, facts, tensor_bytes(tiny_model), probes, REQUEST)
    assert [(p.layer_start, p.layer_end) for p in plans] == [(0, 2), (2, 4)]
