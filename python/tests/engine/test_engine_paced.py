"""A heavy step keeps only a few layers in flight, and admission counts what it holds.

Real engine on the tiny demo model (CPU, float32): one prompt prefilled in chunks at a
growing cached prefix. Unpaced (``prefill_window`` 0) MLX lets a chunk's layers pile up, so
the step's peak above the memory active before it grows with the context; paced (the
default) it stays flat, it stays within the transient admission charges for that chunk
(core/transients.prefill_transient_bytes), and the tokens are the same.
"""

from __future__ import annotations

import pytest

mx = pytest.importorskip("mlx.core")

from plimsoll.core.transients import (  # noqa: E402
    PREFILL_LAYER_WINDOW,
    decode_fits_unpaced,
    prefill_transient_bytes,
)
from plimsoll.demo.model import build_demo_model  # noqa: E402
from plimsoll.engine import Engine  # noqa: E402
from plimsoll.engine.work import Step, Work  # noqa: E402

BLOCK, CHUNK, PROMPT = 16, 512, 3072
PROMPT_IDS = tuple((i * 7919) % 250 + 3 for i in range(PROMPT))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_demo_model(tmp_path_factory.mktemp("tiny"), "tiny")


def chunk_peaks(model_dir, window: int) -> tuple[list[int], list[int], object]:
    """Each chunk's MLX peak above the memory active before it (bytes), the tokens of four
    decode steps after the prompt beside a second prompt's chunk, and the engine."""
    eng = Engine.load(model_dir, block_tokens=BLOCK, max_blocks=PROMPT // BLOCK * 2 + 8)
    eng.prefill_window = window
    table = tuple(range(PROMPT // BLOCK + 4))
    other = tuple(range(PROMPT // BLOCK + 4, 2 * (PROMPT // BLOCK) + 8))
    peaks = []
    for start in range(0, PROMPT, CHUNK):
        mx.synchronize()
        before = mx.get_active_memory()
        mx.reset_peak_memory()
        last = start + CHUNK == PROMPT
        out = eng.run(Step(prefills=(Work(0, PROMPT_IDS[start:start + CHUNK], start, table,
                                          last),)))
        mx.synchronize()
        peaks.append(mx.get_peak_memory() - before)
    tokens = [out[0]]
    eng.run(Step(prefills=(Work(1, PROMPT_IDS[:CHUNK], 0, other, False),)))
    for k in range(4):  # decodes beside a chunk at a prefix: one forward, several groups
        out = eng.run(Step(decodes=(Work(0, (tokens[-1],), PROMPT + k, table, True),),
                           prefills=(Work(1, PROMPT_IDS[CHUNK * (k + 1):CHUNK * (k + 2)],
                                          CHUNK * (k + 1), other, False),)))
        tokens.append(out[0])
    return peaks, tokens, eng


def test_a_paced_chunk_holds_what_admission_counts_and_not_more_as_the_context_grows(tiny_dir):
    unpaced, plain_tokens, _ = chunk_peaks(tiny_dir, 0)
    paced, paced_tokens, eng = chunk_peaks(tiny_dir, PREFILL_LAYER_WINDOW)
    assert paced_tokens == plain_tokens  # the same computation, only waited for
    # the control: unpaced, the chunks at a longer prefix hold more (layers pile up)
    assert unpaced[-1] > 1.5 * unpaced[1], unpaced
    # paced: flat as the context grows, and within the transient counted for that chunk
    assert paced[-1] < 1.25 * paced[1] and paced[-1] < unpaced[-1] / 2, (paced, unpaced)
    for k, peak in enumerate(paced):
        counted = prefill_transient_bytes(eng.facts, CHUNK, (k + 1) * CHUNK, BLOCK,
                                          fused=eng.fused_prefill)
        assert peak <= counted, (k, peak, counted)


def test_a_decode_whose_whole_forward_fits_the_reserve_is_not_paced():
    step = 3 * 1000  # decode_transient_bytes counts LAYERS_IN_FLIGHT (3) layers
    assert decode_fits_unpaced(step, 28, 28 * 1000)
    assert not decode_fits_unpaced(step, 28, 28 * 1000 - 1)
    assert not decode_fits_unpaced(step, 28, None)  # the reserve unknown: paced as before


def test_a_long_decode_runs_unpaced_within_the_reserve_and_paced_past_it(tiny_dir):
    """One row at a 3k-token context gathers enough to be paced by the token rule; with a
    reserve that holds its whole forward it runs unpaced (its peak on bytes measured stays
    within that reserve), with one that does not it is paced; the tokens are the same."""
    from plimsoll.core.transients import decode_transient_bytes
    from plimsoll.engine import forward

    eng = Engine.load(tiny_dir, block_tokens=BLOCK, max_blocks=PROMPT // BLOCK + 8)
    table = tuple(range(PROMPT // BLOCK + 4))
    out = eng.run(Step(prefills=(Work(0, PROMPT_IDS, 0, table, True),)))
    step_bytes = decode_transient_bytes(eng.facts, 1, PROMPT + 1, BLOCK,
                                        gathered=eng.decode_gathers)
    whole = -(-step_bytes // 3) * eng.facts.num_layers

    def decode(budget, token, at):
        eng.transient_budget = budget
        step = Step(decodes=(Work(0, (token,), at, table, True),))
        pace = forward.groups_of(eng, step)[-1].batch.pace
        mx.synchronize()
        before = mx.get_active_memory()
        mx.reset_peak_memory()
        got = eng.run(step)[0]
        mx.synchronize()
        return pace, got, mx.get_peak_memory() - before

    assert eng.decode_gathers  # the CPU reads through a gather: the token rule paces it
    paced_pace, paced_token, _ = decode(whole - 1, out[0], PROMPT)
    assert paced_pace is not None
    eng.free_state(0)
    out = eng.run(Step(prefills=(Work(0, PROMPT_IDS, 0, table, True),)))
    free_pace, free_token, peak = decode(whole, out[0], PROMPT)
    assert free_pace is None and free_token == paced_token
    assert peak <= whole, (peak, whole)
