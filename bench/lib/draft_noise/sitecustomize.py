"""Controlled acceptance for bench/speculative.py ``--noise``: a worker started with this
directory first on its PYTHONPATH (Python imports ``sitecustomize`` at start-up, in the API
process and in the engine process it spawns) and ``PLIMSOLL_BENCH_DRAFT_NOISE=F`` has each
prompt-lookup draft token (the host's, and those the engine drafts on the device) replaced by
a wrong one (the next token id) with probability ``F`` (a fixed seed). With the ``repeat``
regime's drafts all right, a draft is then right with probability ``1 - F``: the acceptance
the bench plots speed against. Nothing else changes; without the variable this does
nothing."""

import os

if noise := float(os.environ.get("PLIMSOLL_BENCH_DRAFT_NOISE") or 0):
    import random

    from plimsoll.worker import speculate

    _rng = random.Random(0)
    _lookup = speculate.Drafter.lookup
    _predicting = False

    def _noisy(self, seq_id, tokens, k, *ahead):  # ahead: tokens assumed (a lookahead)
        found = _lookup(self, seq_id, tokens, k, *ahead)
        if _predicting:  # the prediction's own lookup: noised below, on its own stream
            return found
        return tuple(t + 1 if _rng.random() < noise else t for t in found)

    speculate.Drafter.lookup = _noisy
    if hasattr(speculate.Drafter, "expect"):  # the token predicted after a step's drafts
        _expect, _prng = speculate.Drafter.expect, random.Random(1)  # (a lookup draft too)

        def _noisy_expect(self, *args):
            global _predicting
            _predicting = True
            try:
                out = _expect(self, *args)
            finally:
                _predicting = False
            if out and _prng.random() < noise:
                out = (*out[:-1], out[-1] + 1)
            return out

        speculate.Drafter.expect = _noisy_expect

    try:  # drafts the engine makes on the device (engine/chain.py): noised there alike
        from plimsoll.engine import chain
    except ImportError:  # the code before it (--before-code) or no mlx
        chain = None
    if chain is not None and hasattr(chain, "drafts"):
        import mlx.core as mx

        _drafts, _key = chain.drafts, [mx.random.key(2)]

        def _noisy_drafts(history, length, longest, k):
            found = _drafts(history, length, longest, k)
            _key[0], sub = mx.random.split(_key[0])
            wrong = mx.random.uniform(shape=(k,), key=sub) < noise
            return mx.where(wrong & (found >= 0), found + 1, found)

        chain.drafts = _noisy_drafts
