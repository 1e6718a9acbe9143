"""The engine's pure contract (value types) and the transient arithmetic of core.transients
(no mlx)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from plimsoll.core.model_facts import facts_from_config
from plimsoll.core.transients import (
    LAYERS_IN_FLIGHT,
    gather_transient_bytes,
    prefill_chunk_tokens,
    prefill_transient_bytes,
)
from plimsoll.demo.model import PRESETS
from plimsoll.engine.work import Sampling, Step, Work

pytestmark = pytest.mark.pure

FACTS = facts_from_config({**PRESETS["qwen3-0.6b"], "torch_dtype": "float32"}, 0)


@pytest.mark.impure
def test_importing_the_contract_imports_no_mlx():
    code = ("import sys, plimsoll.engine, plimsoll.engine.work; "
            "from plimsoll.engine import Step, Work; "
            "assert 'mlx' not in sys.modules and 'mlx_lm' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_value_types():
    w = Work(3, None, 10, (0,), True)
    assert w.length == 1 and w.sampling == Sampling() and w.sampling.greedy
    assert Work(3, (1, 2, 3), 0, (0,), False).length == 3
    assert Step() == Step((), ())
    assert not Sampling(temperature=0.7).greedy


def test_facts_carry_the_activation_shape():
    assert (FACTS.num_attention_heads, FACTS.hidden_size, FACTS.intermediate_size) == \
        (16, 1024, 3072)


def test_gather_is_one_layers_k_and_v_twice():
    per_layer_token = 2 * FACTS.num_key_value_heads * FACTS.head_dim * 4
    assert gather_transient_bytes(FACTS, 1000) == 2 * per_layer_token * 1000
    assert gather_transient_bytes(FACTS, 0) == 0


@given(context=st.integers(1, 200_000), bound=st.integers(0, 8 << 30))
def test_prefill_chunk_stays_under_the_bound(context, bound):
    chunk = prefill_chunk_tokens(FACTS, context, bound)
    assert 0 <= chunk <= min(context, 2048)
    if chunk:
        assert prefill_transient_bytes(FACTS, chunk, context) <= bound
        if chunk >= 16 and chunk + 16 <= min(context, 2048):
            assert prefill_transient_bytes(FACTS, chunk + 16, context) > bound
    else:
        assert prefill_transient_bytes(FACTS, 1, context) > bound


def test_prefill_chunk_shrinks_as_context_grows():
    bound = 3 << 30
    chunks = [prefill_chunk_tokens(FACTS, c, bound) for c in (2048, 8192, 32768)]
    assert chunks[0] == 2048 > chunks[1] > chunks[2] > 0
    assert prefill_chunk_tokens(FACTS, 65536, bound) == 0  # the gather alone fills the bound


def test_growth_transient_is_one_array_of_the_pool():
    from plimsoll.core.transients import growth_transient_bytes

    assert growth_transient_bytes(32768, 100, 4) == 32768 * 100 // 8
    assert growth_transient_bytes(32768, 100, 0) == 0


@given(context=st.integers(1, 100_000), bound=st.integers(0, 8 << 30))
def test_a_fused_prefill_takes_a_chunk_at_least_as_big_and_stays_under_the_bound(context, bound):
    fused = prefill_chunk_tokens(FACTS, context, bound, fused=True)
    assert fused >= prefill_chunk_tokens(FACTS, context, bound)
    if fused:
        assert prefill_transient_bytes(FACTS, fused, context, fused=True) <= bound


def test_a_fused_prefill_holds_no_scores():
    # the difference between the two transients is exactly the score matrix and its softmax
    unfused = prefill_transient_bytes(FACTS, 512, 8192)
    fused = prefill_transient_bytes(FACTS, 512, 8192, fused=True)
    one_layer = 512 * 2 * FACTS.num_attention_heads * 8192 * 4
    assert unfused - fused == LAYERS_IN_FLIGHT * one_layer  # each layer a paced step holds


def test_a_step_is_paced_from_the_tokens_a_layer_touches():
    from plimsoll.core.transients import PACE_FROM_TOKENS, paced

    assert not paced(1, 0) and not paced(0, PACE_FROM_TOKENS - 1)  # a decode at a short context
    assert paced(PACE_FROM_TOKENS, 0) and paced(16, PACE_FROM_TOKENS)  # a long chunk; a gather


def test_the_default_chunk_follows_the_backend():
    from plimsoll.core.transients import PREFILL_CHUNK, PREFILL_CHUNK_FUSED, default_prefill_chunk

    assert default_prefill_chunk(False) == PREFILL_CHUNK < default_prefill_chunk(True) == \
        PREFILL_CHUNK_FUSED


def test_a_decode_read_in_place_charges_no_gather():
    """With the checked paged decode kernel the rows read the pool in place: the decode's
    transient is the kernel's partial results and the rows' activations, no gather copy and
    no score matrix (both of which the gathered read charges)."""
    from plimsoll.core.transients import (
        DECODE_KERNEL_SPLIT,
        decode_kernel_partials_bytes,
        decode_transient_bytes,
    )

    rows, longest = 32, 16_000
    gathered = decode_transient_bytes(FACTS, rows, longest)
    in_place = decode_transient_bytes(FACTS, rows, longest, gathered=False)
    splits = -(-longest // DECODE_KERNEL_SPLIT)
    partials = rows * FACTS.num_attention_heads * splits * (FACTS.head_dim + 2) * 4
    assert decode_kernel_partials_bytes(FACTS, rows, longest) == partials
    assert in_place < gathered - gather_transient_bytes(FACTS, rows * longest)
    assert decode_transient_bytes(FACTS, 0, longest, gathered=False) == 0
