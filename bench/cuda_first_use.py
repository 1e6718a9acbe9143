"""First-use cost of the paged engine on the GPU: the same prefill schedule three times, then a
long prompt in big chunks, with MLX and NVML memory after each. Results in
bench/results/cuda-attention-h200.md.

    python3 bench/gpu_model.py /tmp/m && python3 bench/cuda_first_use.py /tmp/m
"""
import subprocess
import sys
import time

import mlx.core as mx
from plimsoll.engine import Engine
from plimsoll.engine.work import Step, Work


def nv():
    out = subprocess.run(["nvidia-smi","--query-gpu=memory.used","--format=csv,noheader,nounits"],capture_output=True,text=True).stdout
    return int(out.split()[0])/1024
def mem(tag):
    print(f"  [{tag}] active {mx.get_active_memory()/2**30:.2f} cache {mx.get_cache_memory()/2**30:.2f} peak {mx.get_peak_memory()/2**30:.2f} nvml {nv():.2f} GiB", flush=True)
base = nv()
print("nvml before load", base)
eng = Engine.load(sys.argv[1], block_tokens=16, max_blocks=3000)
mx.set_cache_limit(256<<20)
mem("loaded")
vocab = 150000
def prompt(n, seed): return tuple((seed*7919 + i*104729) % vocab + 10 for i in range(n))
def run_seq(sid, ids0, chunks, table):
    times=[]; start=0
    for k, n in enumerate(chunks):
        toks = ids0[start:start+n]
        t=time.perf_counter()
        eng.run(Step(prefills=(Work(sid, toks, start, table, k == len(chunks)-1),)))
        times.append(round(time.perf_counter()-t,3)); start += n
    return times
for rep in range(3):
    ids = prompt(8192, rep)
    table = tuple(range(rep*520, rep*520+520))
    print(f"rep {rep}: first chunk 2720 @0, then 512-chunks", flush=True)
    print("  times", run_seq(rep, ids, [2720]+[512]*5+[300, 256, 128], table), flush=True)
    mem(f"rep{rep}")
    # decode 2 rows different lengths
    t=time.perf_counter()
    for j in range(8):
        eng.run(Step(decodes=(Work(rep, (5,), 2720+512*5+300+256+128+j, table, True),)))
    print("  decode1 x8", round(time.perf_counter()-t,3), flush=True)
    eng.free_state(rep)
mx.clear_cache(); mem("cleared")
# big transient: 4096-token chunk against 20k context
ids = prompt(24000, 9); table = tuple(range(1560, 1560+1500))
t=time.perf_counter(); print("long", run_seq(9, ids, [4096]*4+[2048]*2+[1024], table), round(time.perf_counter()-t,2)); mem("long"); mx.clear_cache(); mem("long-cleared")
