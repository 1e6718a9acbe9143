"""The scheduler speculating with the checkpoint's MTP head over the real paged engine
(``glm4_moe_mtp``: mlx-lm's glm4_moe with a random nextn layer, CPU), driven step by step on
this thread: three sequences at once, two sharing a prompt prefix, prompts of several chunks.
Greedy output is mlx-lm's own; the head drafts for the three as one batch on its own paged
pool (random weights: acceptance means nothing); the first draft of a sequence that computed
its whole prompt is what the head computes from scratch over the target's own hidden states
of the whole sequence (so the hidden states handed over from the one forward sit at the
right positions across chunks, verifications and their rollbacks, and the head's paged KV
holds what a plain cache would); ended sequences leave nothing behind. A checkpoint without
MTP tensors has no head, with why."""

from __future__ import annotations

import pytest

mx = pytest.importorskip("mlx.core")

from mlx_lm.models.base import create_attention_mask  # noqa: E402
from mlx_lm.models.cache import KVCache  # noqa: E402
from test_worker_paged import BLOCK, Req, drain, load, scheduler  # noqa: E402

from plimsoll.engine import mtp_head  # noqa: E402
from plimsoll.engine.drive import reference, text  # noqa: E402
from plimsoll.worker.mtp import MTPDrafter  # noqa: E402


def from_scratch(eng, head, tokens: list[int]) -> int:
    """The head's first draft after ``tokens`` over the target's hidden states of all of
    them, on a fresh mlx-lm cache."""
    hidden = eng.model.model(mx.array([tokens[:-1]]))  # under the final norm, as handed over
    x = mx.concatenate([head.enorm(eng.model.model.embed_tokens(mx.array([tokens[1:]]))),
                        head.hnorm(hidden)], axis=-1)
    h = head.eh_proj(x)
    out = head.layers[0](h, create_attention_mask(h, None, return_array=True), KVCache())
    return int(mx.argmax(head._logits(out[:, -1:])[0, -1]).item())


@pytest.mark.parametrize("family", ["glm4_moe_mtp", "deepseek_v3_mtp"])  # GQA, and MLA latents
def test_mtp_drafts_from_the_targets_hidden_states_and_changes_nothing(family_dir, family):
    d = family_dir(family)
    eng = load(d, 256)
    runner, why = mtp_head.attach(eng, d)
    assert runner is not None, why
    head = runner.model
    assert head.weights_bytes > 0 and runner.block_bytes > 0
    s = scheduler(eng, 256, prefill=24)
    # probe: every capture kept, so a retry after draft length 0 catches up with no gap
    s.drafter = drafter = MTPDrafter(0, 3, engine=runner, hidden=eng.mtp, chunk=64,
                                     probe=1 << 20)
    seen: list[tuple[list[int], int, int]] = []  # (tokens, first head KV position, draft)
    firsts: dict[int, int] = {}
    prepare, batches = drafter.prepare, []

    def recording(pool, running):
        for sid in running:
            if (first := eng.mtp.first(sid)) is not None:
                firsts.setdefault(sid, first)
        prepare(pool, running)
        batches.append(len(drafter._ready))
        seen.extend((list(running[sid].tokens), firsts[sid], ts[0])
                    for sid, ts in drafter._ready.items())

    drafter.prepare = recording
    system = text(eng.tokenizer, 3 * BLOCK, salt=1)
    prompts = [system + text(eng.tokenizer, 7, salt=2), system + text(eng.tokenizer, 12, salt=3),
               text(eng.tokenizer, 41, salt=4)]
    reqs = [Req(s, p, 40) for p in prompts]
    drain(s)
    assert [r.tokens for r in reqs] == [reference(eng.model, p, 40) for p in prompts]
    fig = s.drafter.figures
    assert fig.proposed > 0 and fig.steps > 0
    report = s.drafter.report()
    assert report["proposer"] == "mtp" and report["by_proposer"]["mtp"]["proposed"] > 0
    from_zero = [(t, first) for t, base, first in seen if base == 0]
    assert len(from_zero) >= 3 and any(base > 0 for _, base, _ in seen)  # a prefix hit too
    agree = sum(from_scratch(eng, head, t) == first for t, first in from_zero)
    assert agree >= 0.9 * len(from_zero), (agree, len(from_zero))
    assert max(batches) >= 2  # sequences drafted together, as one batch of the head
    assert eng.mtp.captured == {} and drafter._seen == {}  # ended sequences forgotten


def test_a_checkpoint_without_mtp_tensors_has_no_head(family_dir):
    tensors, why = mtp_head.find(family_dir("glm4_moe"))
    assert tensors == {} and "num_nextn_predict_layers is 0" in why
    tensors, why = mtp_head.find(family_dir("glm4_moe_mtp"))
    assert why == "" and any(k.endswith(".eh_proj.weight") for k in tensors)


def test_a_head_that_does_not_fit_says_by_how_much():
    from plimsoll.worker.mtp import fit_problem

    fits = dict(weights=100, mtp_weights=10, blocks=4, block_bytes=8, mtp_block_bytes=2,
                transient=5)
    need = 100 + 10 + 4 * (8 + 2) + 5
    assert fit_problem(**fits, limit=need) == ""
    why = fit_problem(**fits, limit=need - 1)
    assert "the MTP head does not fit" in why and "--no-mtp" in why
