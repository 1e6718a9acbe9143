"""Clustered admission, pure: the layer split, per-rank shares and the two-phase decision."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from plimsoll.cluster.plan import (
    ClusterPlanError,
    ClusterRequest,
    Preflight,
    RankProbe,
    classify,
    decide,
    plan_cluster,
    preflight,
    split_layers,
    weight_shares,
)
from plimsoll.core.model_facts import facts_from_config
from plimsoll.demo.model import PRESETS

pytestmark = pytest.mark.pure

GIB = 1 << 30


def probe(rank: int, ceiling_gib: float = 8, budget_gib: float | None = None) -> RankProbe:
    """A Linux-like rank: its whole memory world is its ceiling (cgroup limit)."""
    ceiling = int(ceiling_gib * GIB)
    return RankProbe(rank=rank, ceiling_bytes=ceiling, total_ram_bytes=ceiling,
                     budget_bytes=int((budget_gib or ceiling_gib) * GIB))


def fake_tensors(config: dict, layer_bytes: int = 1000, embed_bytes: int = 50_000) -> dict:
    """Header-like byte counts in mlx-lm naming: embeddings, layers, final norm, head."""
    out = {"model.embed_tokens.weight": embed_bytes, "model.norm.weight": 10}
    for i in range(config["num_hidden_layers"]):
        out[f"model.layers.{i}.self_attn.q_proj.weight"] = layer_bytes
        out[f"model.layers.{i}.mlp.up_proj.weight"] = layer_bytes
    if not config.get("tie_word_embeddings"):
        out["lm_head.weight"] = embed_bytes
    return out


def config_of(preset: str) -> dict:
    return {**PRESETS[preset], "torch_dtype": "float32"}


def facts_of(config: dict, tensors: dict):
    return facts_from_config(config, sum(tensors.values()))


# ---------------------------------------------------------------- the split


@given(st.integers(1, 96), st.lists(st.integers(0, 10**12), min_size=1, max_size=8))
def test_split_is_complete_positive_and_proportional(layers, capacities):
    if layers < len(capacities):
        with pytest.raises(ClusterPlanError, match="fewer ranks"):
            split_layers(layers, capacities)
        return
    split = split_layers(layers, capacities)
    assert sum(split) == layers and all(c >= 1 for c in split)
    total = sum(capacities)
    spare = layers - len(capacities)
    for count, cap in zip(split, capacities, strict=True):
        exact = spare * (cap / total if total else 1 / len(capacities))
        assert abs((count - 1) - exact) < 1  # largest remainder: within one layer of exact
    # monotone: more capacity never gets fewer layers
    for i in range(len(capacities)):
        for j in range(len(capacities)):
            if capacities[i] > capacities[j]:
                assert split[i] >= split[j]


def test_split_examples():
    assert split_layers(4, [1, 1]) == [2, 2]
    assert split_layers(48, [3, 1]) == [36, 12]  # a 96 GiB and a 32 GiB host, say
    assert split_layers(5, [1, 1]) == [3, 2]  # ties go to the lower rank
    assert split_layers(4, [8 * GIB, 1 << 20]) == [3, 1]  # every rank keeps one layer


def test_classify_names():
    assert classify("model.layers.12.mlp.gate_proj.weight") == ("layer", 12)
    assert classify("model.embed_tokens.weight") == ("embed", None)
    assert classify("lm_head.weight") == ("head", None)
    assert classify("model.norm.weight") == ("norm", None)
    assert classify("model.layers.3.input_layernorm.weight") == ("layer", 3)
    assert classify("something.else") == ("other", None)


# ---------------------------------------------------------------- the shares


@pytest.mark.parametrize("tied", [True, False])
def test_embeddings_and_head_sit_on_their_ranks_not_weights_over_ranks(tied):
    config = {**config_of("tiny"), "tie_word_embeddings": tied}
    tensors = fake_tensors(config)
    shares = weight_shares(tensors, [2, 2], tied)
    layers_half = 2 * 2 * 1000
    assert shares[0] == 50_000 + layers_half  # embeddings + layers 0..1
    # last rank: layers 2..3 + norm + head (the tied head is a copy of the embeddings)
    assert shares[1] == layers_half + 10 + 50_000
    assert sum(shares) == sum(tensors.values()) + (50_000 if tied else 0)
    assert shares != [sum(tensors.values()) // 2] * 2


def test_single_rank_share_is_the_whole_model_once():
    config = config_of("tiny")
    tensors = fake_tensors(config)
    assert weight_shares(tensors, [4], True) == [sum(tensors.values())]


def test_middle_ranks_hold_only_layers():
    config = {**config_of("tiny"), "num_hidden_layers": 6}
    shares = weight_shares(fake_tensors(config), [2, 2, 2], True)
    assert shares[1] == 2 * 2 * 1000


def test_unknown_tensors_are_charged_to_every_rank():
    shares = weight_shares({"model.layers.0.w": 5, "model.layers.1.w": 5, "mystery": 7},
                           [1, 1], False)
    assert shares == [12, 12]


def test_a_tensor_past_the_layers_is_an_error():
    with pytest.raises(ClusterPlanError, match="layer 9"):
        weight_shares({"model.layers.9.w": 1}, [1, 1], False)


def test_hybrid_kv_counts_only_each_ranks_full_attention_layers():
    config = config_of("hybrid")  # 8 layers, every 4th full attention
    tensors = fake_tensors(config)
    facts = facts_of(config, tensors)
    plans = plan_cluster(config, facts, tensors, [probe(0), probe(1)], ClusterRequest())
    assert [(p.layer_start, p.layer_end) for p in plans] == [(0, 4), (4, 8)]
    per_full = 2 * facts.num_key_value_heads * facts.head_dim * facts.kv_dtype_bytes
    assert [p.kv_bytes_per_token for p in plans] == [per_full, per_full]
    assert sum(p.kv_bytes_per_token for p in plans) == facts.kv_bytes_per_token
    fixed = [p.per_sequence_fixed_bytes for p in plans]
    assert fixed[0] == fixed[1] and sum(fixed) >= facts.per_sequence_fixed_bytes
    assert plans[0].holds_embeddings and not plans[0].holds_head
    assert plans[1].holds_head and not plans[1].holds_embeddings
    assert all(p.comm_bytes == config["hidden_size"] * 512 * 4 for p in plans)


def test_uneven_budgets_give_uneven_layers_and_shares():
    config = {**config_of("tiny"), "num_hidden_layers": 8}
    tensors = fake_tensors(config, embed_bytes=10)
    facts = facts_of(config, tensors)
    plans = plan_cluster(config, facts, tensors, [probe(0, 24), probe(1, 8)], ClusterRequest())
    assert [p.num_layers for p in plans] == [6, 2]
    assert plans[0].weights_bytes > 2 * plans[1].weights_bytes


def test_a_single_rank_has_no_comm_buffers():
    config = config_of("tiny")
    tensors = fake_tensors(config)
    (plan,) = plan_cluster(config, facts_of(config, tensors), tensors, [probe(0)],
                           ClusterRequest())
    assert plan.comm_bytes == 0 and plan.weights_bytes == sum(tensors.values())


def test_probes_must_be_in_rank_order():
    config = config_of("tiny")
    tensors = fake_tensors(config)
    with pytest.raises(ClusterPlanError, match="in order"):
        plan_cluster(config, facts_of(config, tensors), tensors, [probe(1), probe(0)],
                     ClusterRequest())


# ---------------------------------------------------------------- the two phases


def answers_for(ceilings_gib: list[float], request: ClusterRequest | None = None,
                reserve_ok: bool = True) -> list[Preflight]:
    request = request or ClusterRequest()
    config = config_of("tiny")
    tensors = fake_tensors(config)
    facts = facts_of(config, tensors)
    probes = [probe(r, c) for r, c in enumerate(ceilings_gib)]
    plans = plan_cluster(config, facts, tensors, probes, request)
    out = []
    for p, pr in zip(plans, probes, strict=True):
        a = preflight(p, pr, facts, request)
        out.append(a.model_copy(update={"reserved": a.admitted and reserve_ok}))
    return out


def test_every_rank_admits_so_commit_all():
    d = decide(answers_for([8, 8]), 2)
    assert d.action == "commit" and d.refusing_ranks == [] and d.concurrency >= 1
    assert set(d.reasons) == {0, 1}


def test_one_small_ceiling_rolls_back_all_with_every_ranks_reasons():
    answers = answers_for([8, 1 / 1024])
    assert answers[0].admitted and not answers[1].admitted
    d = decide(answers, 2)
    assert d.action == "rollback" and d.refusing_ranks == [1]
    assert any("ceiling" in r for r in d.reasons[1])
    assert d.reasons[0]  # the admitting rank's figures are reported too
    assert "rank 1" in d.explain()


def test_a_missing_answer_is_a_refusal():
    d = decide(answers_for([8, 8])[:1], 2)
    assert d.action == "rollback" and d.refusing_ranks == [1]
    assert "no preflight answer" in d.reasons[1][0]


def test_admitted_but_unreserved_rolls_back():
    d = decide(answers_for([8, 8], reserve_ok=False), 2)
    assert d.action == "rollback" and d.refusing_ranks == [0, 1]


def test_answers_outside_the_world_are_an_error():
    with pytest.raises(ClusterPlanError, match="outside"):
        decide(answers_for([8, 8]), 1)


def test_commit_takes_the_common_concurrency_and_context():
    # a tight second rank clamps concurrency; the cluster must use the smaller figure
    request = ClusterRequest(concurrency=64, context=32768, max_tokens=512)
    answers = answers_for([8, 0.25], request)
    d = decide(answers, 2)
    assert d.action == "commit"
    assert d.concurrency == min(a.decision.concurrency for a in answers)
    assert d.context == min(a.decision.context for a in answers)
    for a in answers:  # every rank's pool holds the common figures
        blocks = -(-d.context // request.block_tokens) + a.decision.fixed_blocks_per_seq
        assert d.concurrency * blocks <= a.decision.pool_blocks


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from([1 / 1024, 0.05, 0.25, 1, 8]), min_size=1, max_size=4),
       st.booleans())
def test_commit_iff_every_rank_admits_and_reserves(ceilings, reserve_ok):
    answers = answers_for(ceilings, reserve_ok=reserve_ok)
    d = decide(answers, len(ceilings))
    everyone = all(a.admitted for a in answers) and reserve_ok
    assert (d.action == "commit") == everyone
    assert set(d.reasons) == set(range(len(ceilings)))
    assert d.refusing_ranks == [a.rank for a in answers if not (a.admitted and reserve_ok)]
