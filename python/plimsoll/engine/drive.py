"""An in-process driver of the :class:`~plimsoll.engine.core.Engine`, without the HTTP worker
or its scheduler: for the engine's tests and the in-process benchmarks (``bench/engine.py``).

It is a deliberately plain planner, not a model of the worker's scheduler: :func:`plan_step`
builds the next :class:`Step` from a list of :class:`Seq` (every running sequence decodes one
token, and the first sequence still waiting prefills one chunk) and :func:`drive` runs such
steps until every sequence has its tokens, synchronously or pipelined (step n+1 submitted
before step n's result is read, its decodes naming ``tokens=None``). Block ids come from
:class:`Blocks`, in order or shuffled, so a caller chooses whether tables are contiguous;
nothing here sizes a pool or admits.

Beside it, the references a test compares against: :func:`reference` (mlx-lm's own greedy
generation with its own KV cache), :func:`text` and :func:`family_prompts` (deterministic
prompts), :func:`sharpen` (random weights scaled so greedy output varies token to token) and
:func:`engine_cache` (one loaded Engine per model family and load options).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import mlx.core as mx
from mlx.utils import tree_map
from mlx_lm.generate import generate_step

from plimsoll.engine.core import Engine
from plimsoll.engine.work import Sampling, Step, TokenConstraint, Work

WORDS = "import os\nclass Foo:\n    def bar(self, x):\n        return x + %d\n"


def text(tokenizer, n: int, salt: int = 0) -> list[int]:
    ids: list[int] = []
    i = salt
    while len(ids) < n:
        ids += tokenizer.encode(WORDS % i)
        i += 1
    return ids[:n]


def sharpen(model, scale: float = 4.0) -> None:
    """Scale the random matrices so greedy output varies from token to token (at scale 1
    the tiny demo repeats one token, which would make equality tests weak)."""
    model.update(tree_map(lambda w: w * scale if w.ndim == 2 else w, model.parameters()))
    mx.eval(model.parameters())


def reference(model, prompt: list[int], n: int) -> list[int]:
    """mlx-lm's own greedy generation, with its own KVCache."""
    return [t for t, _ in generate_step(mx.array(prompt), model, max_tokens=n)]


class Blocks:
    """Hands out block ids: in order, or shuffled (so tables are not consecutive)."""

    def __init__(self, total: int, shuffle: bool = False, seed: int = 0):
        self.free = list(range(total))
        if shuffle:
            random.Random(seed).shuffle(self.free)

    def take(self, n: int) -> tuple[int, ...]:
        out, self.free = tuple(self.free[:n]), self.free[n:]
        return out


@dataclass
class Seq:
    seq_id: int
    prompt: list[int]
    new: int
    table: tuple[int, ...]
    written: int = 0  # prompt tokens submitted
    out: list[int] = field(default_factory=list)
    planned: int = 0  # tokens sampled, as planned (known before their values)
    sampling: Sampling = field(default_factory=Sampling)
    constraint: TokenConstraint | None = None


def seqs_for(prompts: list[list[int]], new: int, block_tokens: int, blocks: Blocks,
             shared: dict[int, tuple[int, ...]] | None = None) -> list[Seq]:
    """One Seq per prompt with a table covering prompt + new; ``shared[i]`` = leading blocks."""
    out = []
    for i, p in enumerate(prompts):
        lead = (shared or {}).get(i, ())
        need = math.ceil((len(p) + new) / block_tokens) - len(lead)
        out.append(Seq(i, p, new, lead + blocks.take(need)))
    return out


def plan_step(seqs: list[Seq], chunk: int, concrete: bool) -> Step | None:
    """The next Step, updating each Seq's bookkeeping as planned; None when all are done.
    ``concrete``: decodes name the last sampled token (else None, for a pipelined step)."""
    decodes = []
    for s in seqs:
        if s.written == len(s.prompt) and 0 < s.planned < s.new:
            pos = len(s.prompt) + s.planned - 1
            tokens = (s.out[-1],) if concrete else None
            decodes.append(Work(s.seq_id, tokens, pos, s.table, True, s.sampling, s.constraint))
    prefills = []
    waiting = next((s for s in seqs if s.written < len(s.prompt)), None)
    if waiting is not None:
        piece = waiting.prompt[waiting.written:waiting.written + chunk]
        last = waiting.written + len(piece) == len(waiting.prompt)
        prefills.append(Work(waiting.seq_id, tuple(piece), waiting.written, waiting.table,
                             last, waiting.sampling, waiting.constraint))
    if not decodes and not prefills:
        return None
    for w in (*decodes, *prefills):
        s = seqs[w.seq_id]
        if w in prefills:
            s.written += len(w.tokens)
        if w.sample:
            s.planned += 1
    return Step(tuple(decodes), tuple(prefills))


def drive(engine, seqs: list[Seq], chunk: int, pipelined: bool = False) -> list[list[int]]:
    """Run every sequence to ``new`` tokens: each step decodes all running sequences and
    prefills one chunk of the first waiting one. Pipelined: step n+1 is submitted before
    step n's result is read (its decodes name tokens=None)."""
    by_id = {s.seq_id: s for s in seqs}
    assert list(by_id) == list(range(len(seqs)))
    pending = None
    for _ in range(10_000):
        step = plan_step(seqs, chunk, concrete=not pipelined)
        if pipelined:
            nxt = engine.run_async(step) if step is not None else None
            if pending is not None:
                for sid, tok in pending.result().items():
                    by_id[sid].out.append(tok)
            pending = nxt
            if step is None:
                break
        else:
            if step is None:
                break
            for sid, tok in engine.run(step).items():
                by_id[sid].out.append(tok)
    for s in seqs:
        engine.free_state(s.seq_id)
    return [s.out for s in seqs]


def family_prompts(*lengths: int) -> list[list[int]]:
    """Deterministic prompts of the given lengths (token ids below 501)."""
    return [[(7 * i + 3 * n) % 500 + 1 for i in range(n)] for n in lengths]


def engine_cache(family_dir, block_tokens: int, max_blocks: int):
    """``get(name, **load_kwargs)``: an Engine of family ``name``, loaded once per kwargs."""
    built: dict[str, Engine] = {}

    def get(name: str, **kw) -> Engine:
        key = f"{name}{sorted(kw.items())}"
        if key not in built:
            built[key] = Engine.load(family_dir(name), block_tokens=block_tokens,
                                     max_blocks=max_blocks, **kw)
        return built[key]
    get.family_dir = family_dir
    return get
