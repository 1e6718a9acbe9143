"""Load-time admission: DESIGN.md's arithmetic, by example and by property."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from plimsoll.core.admission import AdmissionRequest, admit, blocks_for
from plimsoll.core.units import GIB, KIB, MIB

pytestmark = pytest.mark.pure

QWEN3_30B_KV = 96 * KIB  # bytes per token, bf16 (48 layers × 4 heads × 128)


def req(**kw) -> AdmissionRequest:
    base = dict(
        ceiling_bytes=72 * GIB,
        total_ram_bytes=96 * GIB,
        budget_bytes=72 * GIB,
        weights_bytes=int(32.5e9),  # decimal GB, as a model card gives it
        kv_bytes_per_token=QWEN3_30B_KV,
        transient_reserve=0.05,
        block_tokens=16,
        concurrency=2,
        context=65536,
        max_tokens=8192,
    )
    base.update(kw)
    return AdmissionRequest(**base)


def test_studio_96gib_standalone_figures():
    d = admit(req())
    assert d.decision == "admit"
    # ceiling / RAM − 0.05 = 72/96 − 0.05
    assert math.isclose(d.band_high, 0.70)
    assert math.isclose(d.gpu_memory_utilization, 0.68)
    assert d.allocation_limit_bytes == math.floor(0.68 * 72 * GIB)
    assert d.trip_bytes == math.floor(0.73 * 96 * GIB)
    assert d.transient_reserve_bytes == math.floor(0.05 * 72 * GIB)
    assert d.block_bytes == 96 * KIB * 16
    expected_pool = (math.floor(0.66 * 72 * GIB) - int(32.5e9) - d.transient_reserve_bytes) // (
        96 * KIB * 16
    )
    assert d.pool_blocks == expected_pool
    assert d.footprint_bytes <= 0.66 * 72 * GIB < 49 * GIB
    assert d.footprint_bytes < d.trip_bytes < d.ceiling_bytes


def test_concurrency_clamped_before_context():
    d = admit(req(concurrency=64))
    assert d.decision == "clamp"
    assert d.context == 65536  # context kept
    assert 1 <= d.concurrency < 64
    per_seq = d.blocks_per_seq
    assert d.concurrency * per_seq <= d.pool_blocks < (d.concurrency + 1) * per_seq
    assert any("concurrency clamped from 64" in r for r in d.reasons)


def test_context_clamped_when_one_sequence_does_not_fit():
    d = admit(req(context=1_000_000, max_tokens=1024, concurrency=4))
    assert d.decision == "clamp"
    assert d.concurrency == 1
    assert d.context < 1_000_000
    assert blocks_for(d.context, 16) <= d.pool_blocks
    assert blocks_for(d.context + 16, 16) > d.pool_blocks  # the largest context that fits


def test_native_max_context_clamps():
    d = admit(req(context=65536, native_max_context=40960))
    assert d.decision == "clamp"
    assert d.context == 40960
    assert any("model-native maximum 40960" in r for r in d.reasons)


def test_refuses_model_that_cannot_hold_one_minimal_sequence():
    d = admit(req(weights_bytes=47 * GIB))
    assert d.decision == "refuse"
    assert d.pool_blocks * d.block_bytes < 2048 * QWEN3_30B_KV
    text = " ".join(d.reasons)
    assert "does not fit" in text and "smaller" in text and "raise the ceiling" in text


def test_empty_band_names_the_remedy():
    # a ceiling of 5 % of RAM leaves no u at all: ceiling/RAM − 0.05 = 0
    d = admit(req(ceiling_bytes=int(0.05 * 96 * GIB), budget_bytes=4 * GIB, weights_bytes=GIB))
    assert d.decision == "refuse"
    assert any("empty u band" in r and "raise the ceiling" in r for r in d.reasons)


def test_output_reservation_must_fit_context():
    d = admit(req(context=1024, max_tokens=1024))
    assert d.decision == "refuse"
    assert any("output reservation" in r for r in d.reasons)


def test_budget_binds_when_ceiling_is_above_it():
    # Linux with no cgroup limit: ceiling = RAM = 24 GiB, budget 8 GiB.
    d = admit(req(ceiling_bytes=24 * GIB, total_ram_bytes=24 * GIB, budget_bytes=8 * GIB,
                  weights_bytes=GIB, context=8192, max_tokens=1024))
    assert math.isclose(d.band_high, 0.95)
    assert d.footprint_bytes <= 8 * GIB
    assert any("budget binds" in r for r in d.reasons)
    assert d.decision == "admit"


def test_co_resident_workers_share_the_envelope():
    alone = admit(req())
    shared = admit(req(resident_bytes=8 * GIB))
    lost = alone.pool_blocks - shared.pool_blocks
    assert lost in (8 * GIB // alone.block_bytes, math.ceil(8 * GIB / alone.block_bytes))
    assert shared.footprint_bytes + 8 * GIB <= math.floor(0.66 * 72 * GIB)


def test_fixed_per_sequence_state_costs_blocks():
    plain = admit(req(concurrency=64))
    fixed = admit(req(concurrency=64, per_sequence_fixed_bytes=50 * MIB))
    assert fixed.fixed_blocks_per_seq == math.ceil(50 * MIB / fixed.block_bytes)
    assert fixed.blocks_per_seq == plain.blocks_per_seq + fixed.fixed_blocks_per_seq


def test_ceiling_above_ram_is_clamped():
    d = admit(req(ceiling_bytes=128 * GIB))
    assert d.ceiling_bytes == 96 * GIB
    assert any("clamped to total RAM" in r for r in d.reasons)


# --- properties ---------------------------------------------------------------------------

gib = st.integers(min_value=1, max_value=512)


@st.composite
def requests(draw) -> AdmissionRequest:
    total = draw(gib) * GIB
    ceiling = draw(st.integers(min_value=1, max_value=total // MIB)) * MIB  # MiB, exact
    budget = draw(st.integers(min_value=1, max_value=max(1, total // MIB))) * MIB
    context = draw(st.integers(min_value=256, max_value=262_144))
    max_tokens = draw(st.integers(min_value=1, max_value=context + 8))
    kv_per_token = 2 * draw(st.integers(1, 96)) * draw(st.integers(1, 16)) * draw(
        st.sampled_from([64, 128, 256])) * draw(st.sampled_from([2, 4]))
    return AdmissionRequest(
        ceiling_bytes=ceiling,
        total_ram_bytes=total,
        budget_bytes=budget,
        resident_bytes=draw(st.integers(0, 4 * GIB)),
        weights_bytes=draw(st.integers(0, total)),
        kv_bytes_per_token=kv_per_token,
        per_sequence_fixed_bytes=draw(st.sampled_from([0, 0, 4 * MIB, 300 * MIB])),
        native_max_context=draw(st.sampled_from([None, 4096, 40960, 131072])),
        transient_reserve=draw(st.floats(0, 0.5)),
        trip_offset=draw(st.floats(0.01, 0.2)),
        u_margin=draw(st.floats(0.005, 0.1)),
        block_tokens=draw(st.sampled_from([1, 16, 32, 256])),
        concurrency=draw(st.integers(1, 256)),
        context=context,
        max_tokens=max_tokens,
        min_context=draw(st.sampled_from([256, 2048, 8192])),
    )


@settings(max_examples=400, deadline=None)
@given(requests())
def test_pool_never_exceeds_the_budget(r):
    d = admit(r)
    assert d.pool_bytes <= r.budget_bytes
    assert d.pool_bytes == d.pool_blocks * d.block_bytes
    if d.admitted:
        assert d.footprint_bytes + r.resident_bytes <= r.budget_bytes


@settings(max_examples=400, deadline=None)
@given(requests())
def test_admitted_sequences_fit_the_pool(r):
    d = admit(r)
    if d.admitted:
        assert d.concurrency >= 1
        assert d.concurrency * d.blocks_per_seq <= d.pool_blocks
        assert d.context > d.output_reservation
        assert d.concurrency <= r.concurrency and d.context <= r.context


@settings(max_examples=400, deadline=None)
@given(requests())
def test_refuse_iff_one_minimal_sequence_does_not_fit(r):
    d = admit(r)
    context = min(r.context, r.native_max_context or r.context)
    floor = max(min(r.min_context, context), r.max_tokens + 1)
    fits = context > r.max_tokens and blocks_for(floor, r.block_tokens,
                                                 d.fixed_blocks_per_seq) <= d.pool_blocks
    assert d.admitted == fits


@settings(max_examples=400, deadline=None)
@given(requests())
def test_footprint_below_trip_below_ceiling_when_admitted(r):
    d = admit(r)
    if d.admitted:
        assert d.footprint_bytes + r.resident_bytes < d.trip_bytes < d.ceiling_bytes
        assert d.band_low < d.gpu_memory_utilization < d.band_high
        assert d.footprint_bytes + r.resident_bytes <= d.allocation_limit_bytes


@given(st.integers(1, 2**20))
def test_mib_ceiling_is_exact(mib):
    r = req(ceiling_bytes=mib * MIB, total_ram_bytes=max(mib * MIB, 96 * GIB))
    d = admit(r)
    assert d.ceiling_bytes == mib * 1024 * 1024
    assert d.ceiling_bytes % MIB == 0


def test_decimal_gb_weights_are_not_gib():
    # 32.5 GB (model card, decimal) is 30.27 GiB: mixing units would shift the pool.
    d_dec = admit(req(weights_bytes=int(32.5e9)))
    d_bin = admit(req(weights_bytes=int(32.5 * GIB)))
    delta = int(32.5 * GIB) - int(32.5e9)
    assert d_dec.pool_blocks - d_bin.pool_blocks in (
        delta // d_dec.block_bytes, delta // d_dec.block_bytes + 1)
