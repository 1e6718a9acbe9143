"""Prefill chunks through the paged engine on the GPU: per-chunk ms with attention and with
attention replaced by the identity (what the rest of the layer costs). Results in
bench/results/cuda-attention-h200.md.

    python3 bench/gpu_model.py /tmp/m && python3 bench/cuda_prefill_chunks.py /tmp/m
"""
import sys
import time

from plimsoll.engine import Engine
from plimsoll.engine import attention as A
from plimsoll.engine.work import Step, Work

eng = Engine.load(sys.argv[1], block_tokens=16, max_blocks=2000)
ids = tuple((i * 104729) % 150000 + 10 for i in range(12000))
def go(sid, chunks):
    table = tuple(range(sid*700, sid*700+700)); start = 0; out = []
    for n in chunks:
        t0 = time.perf_counter(); eng.run(Step(prefills=(Work(sid, ids[start:start+n], start, table, False),)))
        out.append(round((time.perf_counter()-t0)*1000, 1)); start += n
    eng.free_state(sid); return out
print("warm", go(0, [2048, 512, 512, 2048]))
print("real", go(1, [2048, 512, 512, 512, 2048, 2048]))
orig = A.PagedView.attend
A.PagedView.attend = lambda self, q, scale, sinks: (setattr(self.batch, "attended", self.batch.attended + 1), q)[1]
print("no-attn", go(2, [2048, 512, 512, 512, 2048, 2048]))
A.PagedView.attend = orig
