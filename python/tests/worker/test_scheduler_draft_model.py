"""The scheduler speculating with a draft model over the real paged engine (mlx-lm, the tiny
demo sharpened, CPU), driven step by step on this thread: three sequences (two sharing a
prompt prefix) at once, a draft catch-up chunk of 8 tokens so a prompt's catch-up spans many
draft steps. Greedy output is mlx-lm's own; the model as its own draft accepts (nearly)
everything; no scheduler step's draft catch-up computes more than its chunk (a catch-up that
does not fit goes on at the next step); a different-seed draft changes nothing but the
acceptance, and its retries catch up no more than their probe (the last tokens, a gap left
behind)."""

from __future__ import annotations

import itertools

import pytest

mx = pytest.importorskip("mlx.core")

from test_worker_paged import BLOCK, Req, drain, load, scheduler  # noqa: E402

from plimsoll.demo.model import build_demo_model  # noqa: E402
from plimsoll.engine.drive import reference, text  # noqa: E402
from plimsoll.worker.draft_model import DraftModel  # noqa: E402

CHUNK = 8
PROBE = 4


class Recording:
    """The draft engine, its steps' token counts recorded, and the catch-up tokens (given,
    not pipelined) per scheduler step."""

    def __init__(self, eng, clock):
        self.eng, self.clock, self.tokens, self.catch_up = eng, clock, [], {}
        self.given: list[tuple[int, int, int]] = []  # (seq id, start, tokens) of each catch-up

    def run_async(self, step):
        works = (*step.decodes, *step.prefills)
        self.tokens.append(sum(w.length for w in works))
        given = sum(w.length for w in works if w.tokens is not None)
        self.given += [(w.seq_id, w.start, w.length) for w in works if w.tokens is not None]
        self.catch_up[self.clock()] = self.catch_up.get(self.clock(), 0) + given
        return self.eng.run_async(step)

    def __getattr__(self, name):
        return getattr(self.eng, name)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("draft-sched")
    return (build_demo_model(root / "t", preset="tiny"),
            build_demo_model(root / "o", preset="tiny", seed=1))


def run(target_dir, draft_dir, n=48):
    eng = load(target_dir, 256)
    s = scheduler(eng, 256, prefill=32)
    draft = Recording(load(draft_dir, 256), lambda: s._steps)
    s.drafter = DraftModel(0, 3, engine=draft, chunk=CHUNK, probe=PROBE,
                           vocab=eng.model.args.vocab_size)
    system = text(eng.tokenizer, 3 * BLOCK, salt=1)
    prompts = [system + text(eng.tokenizer, 7, salt=2), system + text(eng.tokenizer, 12, salt=3),
               text(eng.tokenizer, 41, salt=4)]
    reqs = [Req(s, p, n) for p in prompts]
    drain(s)
    want = [reference(eng.model, p, n) for p in prompts]
    return s, draft, [r.tokens for r in reqs], want, reqs


def test_the_model_as_its_own_draft(dirs):
    s, draft, got, want, reqs = run(dirs[0], dirs[0])
    assert got == want
    fig = s.drafter.figures
    assert fig.proposed > 40 and fig.accepted >= 0.95 * fig.proposed
    assert sum(r.gen.drafted for r in reqs) == fig.proposed
    assert max(draft.tokens) <= CHUNK  # every draft step within the catch-up chunk
    assert max(draft.catch_up.values()) <= CHUNK  # and all of a step's catch-up together
    assert s.drafter._seen == {} and s.drafter._ready == {}  # ended sequences forgotten
    assert s.drafter.report()["by_proposer"]["draft_model"]["accepted"] == fig.accepted


def test_a_different_draft_changes_only_the_acceptance(dirs):
    s, draft, got, want, reqs = run(dirs[0], dirs[1], 64)
    assert got == want
    fig = s.drafter.figures
    assert fig.proposed > 0 and fig.accepted < 0.3 * fig.proposed
    assert max(draft.tokens) <= CHUNK
    # a retry catches up the last PROBE tokens only: a gap in the draft KV before them (the
    # full catch-up of the stretch decoded at draft length 0 would leave none)
    retries = []
    for r in reqs:
        own = [(start, n) for sid, start, n in draft.given if sid == r.gen.id]
        retries += [b for a, b in itertools.pairwise(own) if b[0] > a[0] + a[1]]
    assert retries and max(n for _, n in retries) <= PROBE
