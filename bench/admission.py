"""How long admission takes on a model directory with large safetensors files.

Target: well under 100 ms, because only headers are read. Builds a sparse 40 GiB
safetensors shard set (real headers, holes for data) next to the Qwen3-30B config fixture,
then times, over repeated runs:

- inspect_model (config + headers) and admit(), in process;
- the whole ``plimsoll admit --json`` process, with the anchor ``python -c pass`` (bare
  interpreter start-up) in the same run, so the CLI's own cost is quoted as a ratio.

Writes ``--out-dir``/``--name``.{json,md}. Run: ``python bench/admission.py``
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lib import report

CONFIG = report.BENCH.parent / "python" / "tests" / "fixtures" / "configs" / "Qwen3-30B-A3B.json"
SHARDS, SHARD_BYTES, TENSORS_PER_SHARD = 8, 5 * 1024**3, 2000


def write_sparse_shard(path: Path, index: int) -> dict[str, str]:
    per = SHARD_BYTES // TENSORS_PER_SHARD
    header, names, offset = {}, {}, 0
    for t in range(TENSORS_PER_SHARD):
        name = f"model.layers.{index}.t{t}.weight"
        header[name] = {"dtype": "BF16", "shape": [per // 2],
                        "data_offsets": [offset, offset + per]}
        names[name] = path.name
        offset += per
    blob = json.dumps(header).encode()
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        f.truncate(8 + len(blob) + offset)  # a hole: no data written, file is 5 GiB long
    return names


def timed(fn, repeat: int) -> list[float]:
    out = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t) * 1000)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    report.output_args(ap, "admission")
    ap.add_argument("--repeats", type=int, default=30, help="in-process runs (CLI runs: a third)")
    args = ap.parse_args(argv)
    from plimsoll.core.admission import AdmissionRequest, admit
    from plimsoll.core.model_facts import inspect_model
    from plimsoll.core.units import GIB, MIB

    tmp = Path(tempfile.mkdtemp(prefix="plimsoll-bench-"))
    try:
        shutil.copy(CONFIG, tmp / "config.json")
        weight_map = {}
        for i in range(SHARDS):
            weight_map |= write_sparse_shard(tmp / f"model-{i:05d}-of-{SHARDS:05d}.safetensors", i)
        (tmp / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))

        def in_process():
            f = inspect_model(tmp)
            admit(AdmissionRequest(
                ceiling_bytes=98304 * MIB, total_ram_bytes=128 * GIB, budget_bytes=96 * GIB,
                weights_bytes=f.weights_bytes, kv_bytes_per_token=f.kv_bytes_per_token,
                transient_reserve=0.05, block_tokens=16, concurrency=4, context=32768,
                max_tokens=4096))

        inproc = timed(in_process, args.repeats)
        cli = [sys.executable, "-m", "plimsoll.cli", "admit", str(tmp), "--json",
               "--budget-gib", "96", "--ceiling-mib", "98304", "--total-ram-gib", "128"]
        proc = timed(lambda: subprocess.run(cli, check=True, capture_output=True),
                     max(1, args.repeats // 3))
        anchor = timed(lambda: subprocess.run([sys.executable, "-c", "pass"], check=True),
                       max(1, args.repeats // 3))
    finally:
        shutil.rmtree(tmp)

    med = statistics.median
    result = {
        "command": report.command(), "host": report.host_facts(),
        "weights_bytes_declared": SHARDS * SHARD_BYTES,
        "in_process_ms_median": round(med(inproc), 2),
        "cli_process_ms_median": round(med(proc), 1),
        "anchor_python_start_ms_median": round(med(anchor), 1),
        "cli_over_anchor": round(med(proc) / med(anchor), 2),
    }
    name = args.name or report.default_name("admission")
    report.write(result, args.out_dir, name, markdown)
    print(markdown(result))
    return 0


def markdown(r: dict) -> str:
    return "\n".join([
        "# Admission latency on a 40 GiB sparse shard set", "", f"Command: `{r['command']}`", "",
        *report.table(["measure", "median"], [
            [f"inspect + admit, in process ({SHARDS} × 5 GiB shards)",
             f"{r['in_process_ms_median']} ms"],
            ["`plimsoll admit --json`, whole process", f"{r['cli_process_ms_median']} ms"],
            ["anchor: `python -c pass`", f"{r['anchor_python_start_ms_median']} ms"],
            ["CLI / anchor", f"{r['cli_over_anchor']}×"]])]) + "\n"


if __name__ == "__main__":
    sys.exit(main())
