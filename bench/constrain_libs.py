"""Which constrained-decoding library: mask time per token, compile time, install size.

Run by hand (see bench/README.md): each candidate library is driven through the same
realistic JSON document (a schema with nested objects, arrays, enums, a pattern and
numbers, the document tokenized with the demo model's tokenizer), and at every token the
full vocabulary mask is computed and turned into a numpy bool array (what plimsoll's
``TokenConstraint.allowed()`` returns). Reported: grammar compile time, tokenizer setup
time, and the per-token mask time (median, p95, mean) over the document.

    python bench/constrain_libs.py --model DIR [--xgrammar-path DIR] [--out-dir bench/results]

``--xgrammar-path`` adds a directory to ``sys.path`` for xgrammar (it hard-depends on
torch, which is not installed here; a numpy stand-in is enough for its mask calls).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from lib import report

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "status": {"enum": ["active", "inactive", "pending"]},
        "score": {"type": "number"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                           "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["street", "city", "zip"], "additionalProperties": False},
        "verified": {"type": "boolean"},
    },
    "required": ["name", "age", "status", "tags", "address", "verified"],
    "additionalProperties": False,
}
DOC = {"name": "Ada Lovelace", "age": 36, "status": "active", "score": 98.5,
       "tags": ["math", "engines", "poetry"],
       "address": {"street": "12 St James's Square", "city": "London", "zip": "10001"},
       "verified": True}


def _stats(times: list[float]) -> dict[str, float]:
    ms = sorted(t * 1000 for t in times)
    return {"tokens": len(ms), "median_ms": round(statistics.median(ms), 4),
            "p95_ms": round(ms[int(0.95 * (len(ms) - 1))], 4),
            "mean_ms": round(statistics.fmean(ms), 4)}


def bench_llguidance(tok_json: str, eos: int, ids: list[int], vocab: int) -> dict:
    import llguidance

    t0 = time.perf_counter()
    lt = llguidance.LLTokenizer(tok_json, eos_token=eos)
    t1 = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        json.dumps(SCHEMA), defaults={"whitespace_flexible": False})
    m = llguidance.LLMatcher(lt, grammar, log_level=0)
    t2 = time.perf_counter()
    assert not m.is_error(), m.get_error()
    times = []
    for t in ids:
        s = time.perf_counter()
        bits = np.frombuffer(m.compute_bitmask(), dtype=np.uint8)
        mask = np.unpackbits(bits, bitorder="little")[:vocab].astype(bool)
        times.append(time.perf_counter() - s)
        assert mask[t], f"llguidance refused token {t}"
        m.consume_token(t)
    s = time.perf_counter()
    bits = np.frombuffer(m.compute_bitmask(), dtype=np.uint8)
    end_ok = bool(np.unpackbits(bits, bitorder="little")[eos])
    times.append(time.perf_counter() - s)
    return {"tokenizer_s": round(t1 - t0, 4), "compile_s": round(t2 - t1, 4),
            "accepts_doc": end_ok or m.is_accepting(), **_stats(times)}


def _byte_vocab(tok_json: dict) -> dict[bytes, list[int]]:
    """Byte-level BPE token strings to their bytes (GPT-2's byte↔unicode table)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    dec = {chr(c): b for b, c in zip(bs, cs, strict=True)}
    out: dict[bytes, list[int]] = {}
    for text, i in tok_json["model"]["vocab"].items():
        out.setdefault(bytes(dec[ch] for ch in text), []).append(i)
    for added in tok_json["added_tokens"]:
        out.setdefault(added["content"].encode(), []).append(added["id"])
    return out


def bench_outlines(tok: dict, eos: int, ids: list[int], vocab: int) -> dict:
    import outlines_core as oc
    from outlines_core.json_schema import build_regex_from_schema

    t0 = time.perf_counter()
    vmap = {b: [i for i in v if i != eos] for b, v in _byte_vocab(tok).items()}
    vmap = {b: v for b, v in vmap.items() if v}
    voc = oc.Vocabulary(eos, vmap)
    t1 = time.perf_counter()
    regex = build_regex_from_schema(json.dumps(SCHEMA))
    index = oc.Index(regex, voc)
    t2 = time.perf_counter()
    guide = oc.Guide(index)
    times = []
    for t in ids:
        s = time.perf_counter()
        mask = np.zeros(vocab, dtype=bool)
        mask[guide.get_tokens()] = True
        times.append(time.perf_counter() - s)
        assert mask[t], f"outlines refused token {t}"
        guide.advance(t)
    s = time.perf_counter()
    mask = np.zeros(vocab, dtype=bool)
    mask[guide.get_tokens()] = True
    times.append(time.perf_counter() - s)
    return {"tokenizer_s": round(t1 - t0, 4), "compile_s": round(t2 - t1, 4),
            "accepts_doc": bool(mask[eos]) or guide.is_finished(), **_stats(times)}


def bench_xgrammar(model: Path, ids: list[int], vocab: int) -> dict:
    import transformers
    import xgrammar as xgr

    t0 = time.perf_counter()
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(model / "tokenizer.json"))
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab)
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    t1 = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False,
                                         separators=(",", ":"))
    t2 = time.perf_counter()
    matcher = xgr.GrammarMatcher(compiled)
    bitmask = np.full((1, (vocab + 31) // 32), -1, dtype=np.int32)
    times = []
    for t in ids:
        s = time.perf_counter()
        matcher.fill_next_token_bitmask(bitmask)
        mask = np.unpackbits(bitmask.view(np.uint8), bitorder="little")[:vocab].astype(bool)
        times.append(time.perf_counter() - s)
        assert mask[t], f"xgrammar refused token {t} at {len(times)}"
        assert matcher.accept_token(t)
    return {"tokenizer_s": round(t1 - t0, 4), "compile_s": round(t2 - t1, 4),
            "accepts_doc": matcher.is_terminated() or matcher.accept_token(
                hf.convert_tokens_to_ids("<|im_end|>")), **_stats(times)}


def markdown(r: dict) -> str:
    rows = [[name, *(x.get(k) for k in ("tokenizer_s", "compile_s", "median_ms", "p95_ms",
                                        "mean_ms", "accepts_doc")), x.get("error")]
            for name, x in r["results"].items()]
    return "\n".join([
        "# Constrained-decoding libraries: mask time per token", "",
        f"Command: `{r['command']}`", "",
        f"Vocabulary {r['vocab']} ids; a {r['doc_tokens']}-token JSON document of the schema "
        "in the JSON, fed token by token, the full mask computed at each.", "",
        *report.table(["library", "tokenizer setup s", "grammar compile s", "mask median ms",
                       "mask p95 ms", "mask mean ms", "accepts the document", "error"], rows)]
                     ) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--xgrammar-path", type=Path)
    report.output_args(ap, "constrain-libs")
    args = ap.parse_args(argv)
    import tokenizers

    tok_json = (args.model / "tokenizer.json").read_text()
    tok = json.loads(tok_json)
    hf = tokenizers.Tokenizer.from_str(tok_json)
    vocab = hf.get_vocab_size(with_added_tokens=True)
    eos = hf.token_to_id("<|im_end|>")
    ids = hf.encode(json.dumps(DOC, separators=(",", ":")), add_special_tokens=False).ids
    results: dict[str, dict] = {}
    for name, fn in (("llguidance", lambda: bench_llguidance(tok_json, eos, ids, vocab)),
                     ("outlines-core", lambda: bench_outlines(tok, eos, ids, vocab))):
        try:
            results[name] = fn()
        except Exception as e:
            results[name] = {"error": f"{type(e).__name__}: {e}"}
        print(name, results[name], flush=True)
    if args.xgrammar_path:
        sys.path[:0] = [str(p) for p in sorted(args.xgrammar_path.iterdir()) if p.is_dir()]
        try:
            results["xgrammar"] = bench_xgrammar(args.model, ids, vocab)
        except Exception as e:
            results["xgrammar"] = {"error": f"{type(e).__name__}: {e}"}
        print("xgrammar", results["xgrammar"], flush=True)
    result = {"command": report.command(), "host": report.host_facts(), "vocab": vocab,
              "doc_tokens": len(ids), "schema": SCHEMA, "results": results}
    report.write(result, args.out_dir, args.name or report.default_name("constrain-libs"),
                 markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
