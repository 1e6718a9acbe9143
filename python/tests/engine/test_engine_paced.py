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

from plimsoll.core.transients import PREFILL_LAYER_WINDOW, prefill_transient_bytes  # noqa: E402
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
