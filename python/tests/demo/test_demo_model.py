"""demo_model: random-weight models that mlx-lm loads, and the KV formula checked against them.

Real builds, real mlx-lm loads, real prefills: the cross-check measures the bytes
mlx-lm's caches hold and compares them with model_facts' arithmetic.
Set PLIMSOLL_SLOW=1 to also build the full Qwen3-0.6B shape (~2.4 GB on disk).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path

import pytest

mx = pytest.importorskip("mlx.core")
mlx_lm = pytest.importorskip("mlx_lm")

from mlx.utils import tree_flatten  # noqa: E402
from mlx_lm.models.cache import ArraysCache, KVCache, make_prompt_cache  # noqa: E402

from plimsoll.core.model_facts import inspect_model  # noqa: E402
from plimsoll.demo import tokenizer as tokenizer_build  # noqa: E402
from plimsoll.demo.model import MARKER, build_demo_model  # noqa: E402

PROMPT_TOKENS = 100
TOOLS = [{"type": "function", "function": {
    "name": "read_file", "description": "Read a file from the workspace.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                   "required": ["path"]}}}]


@pytest.fixture(scope="module", autouse=True)
def tokenizer_cache(tmp_path_factory):
    """Train the tokenizer once per module, in a private cache (not the user's)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PLIMSOLL_CACHE", str(tmp_path_factory.mktemp("cache")))
        yield


@pytest.fixture(scope="module")
def models(tmp_path_factory, tokenizer_cache) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {
        "tiny": build_demo_model(root / "tiny", "tiny"),
        "hybrid": build_demo_model(root / "hybrid", "hybrid"),
        "tiny-bf16": build_demo_model(root / "tiny-bf16", "tiny", dtype="bfloat16"),
        "hybrid-bf16": build_demo_model(root / "hybrid-bf16", "hybrid", dtype="bfloat16"),
    }


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def greedy(model_dir: Path, max_tokens: int = 8) -> str:
    model, tokenizer = mlx_lm.load(str(model_dir))
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "def main():"}],
                                           add_generation_prompt=True)
    return mlx_lm.generate(model, tokenizer, prompt, max_tokens=max_tokens)


# ------------------------------------------------------------------ layout and loading


def test_layout_is_mlx_lm_layout(models):
    d = models["tiny"]
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json", "generation_config.json", "README.md", MARKER):
        assert (d / name).is_file(), name
    config = json.loads((d / "config.json").read_text())
    assert (config["model_type"], config["torch_dtype"]) == ("qwen3", "float32")
    marker = json.loads((d / MARKER).read_text())
    assert (marker["preset"], marker["dtype"], marker["seed"]) == ("tiny", "float32", 0)
    assert marker["random_weights"] is True
    assert "RANDOM" in (d / "README.md").read_text()


@pytest.mark.parametrize("preset", ["tiny", "hybrid"])
def test_loads_and_generates(models, preset):
    text = greedy(models[preset])
    assert isinstance(text, str) and text


def test_weights_bytes_equal_loaded_parameters(models):
    for d in models.values():
        model, _ = mlx_lm.load(str(d))
        loaded = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
        assert inspect_model(d).weights_bytes == loaded


def test_hybrid_has_fewer_kv_layers(models):
    facts = inspect_model(models["hybrid"])
    assert (facts.model_type, facts.num_layers, facts.kv_layers) == ("qwen3_next", 8, 2)
    assert facts.per_sequence_fixed_bytes > 0


# ------------------------------------------------------------------ determinism and atomicity


def test_same_seed_same_model(models, tmp_path):
    again = build_demo_model(tmp_path / "again", "tiny", seed=0)
    assert sha256(again / "model.safetensors") == sha256(models["tiny"] / "model.safetensors")
    assert sha256(again / "tokenizer.json") == sha256(models["tiny"] / "tokenizer.json")
    assert greedy(again) == greedy(models["tiny"])
    other = build_demo_model(tmp_path / "other", "tiny", seed=1)
    assert sha256(other / "model.safetensors") != sha256(again / "model.safetensors")


def test_existing_build_is_returned_not_rebuilt(models):
    d = models["tiny"]
    before = (d / "model.safetensors").stat().st_mtime_ns
    lines: list[str] = []
    assert build_demo_model(d, "tiny", progress=lines.append) == d
    assert (d / "model.safetensors").stat().st_mtime_ns == before
    assert any("already" in line for line in lines)


def test_refuses_a_different_or_foreign_directory(models, tmp_path):
    with pytest.raises(FileExistsError, match="seed"):
        build_demo_model(models["tiny"], "tiny", seed=7)
    with pytest.raises(FileExistsError, match="preset"):
        build_demo_model(models["tiny"], "hybrid")
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not a complete demo model"):
        build_demo_model(tmp_path, "tiny")
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_empty_directory_is_filled(tmp_path):
    (tmp_path / "empty").mkdir()
    assert (build_demo_model(tmp_path / "empty", "tiny") / MARKER).is_file()


def test_crash_leaves_nothing(tmp_path):
    def crash(line: str) -> None:
        if line.startswith("initialising"):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        build_demo_model(tmp_path / "m", "tiny", progress=crash)
    assert list(tmp_path.iterdir()) == []


def test_bad_arguments_are_value_errors(tmp_path):
    with pytest.raises(ValueError, match="preset"):
        build_demo_model(tmp_path / "x", "huge")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="dtype"):
        build_demo_model(tmp_path / "x", "tiny", dtype="int8")  # type: ignore[arg-type]
    assert not (tmp_path / "x").exists()


# ------------------------------------------------------------------ tokenizer


def test_tokenizer_ids_and_cache():
    tok = tokenizer_build.train_tokenizer(4096)
    assert tok.get_vocab_size() == 4096
    ids = tokenizer_build.token_ids(tok)
    assert [ids[t] for t in tokenizer_build.SPECIAL_TOKENS] == [0, 1, 2]
    assert [ids[t] for t in tokenizer_build.TOOL_TOKENS] == [4092, 4093, 4094, 4095]
    cached = tokenizer_build._cache_path(4096)
    assert cached.is_file()
    cached.write_text("{corrupt")  # a broken cache entry is retrained, not fatal
    assert tokenizer_build.train_tokenizer(4096).to_str() == tok.to_str()
    assert tokenizer_build.Tokenizer.from_file(str(cached)).to_str() == tok.to_str()


# ------------------------------------------------------------------ chat template and tools


def test_chat_template_renders_tools(models):
    _, tokenizer = mlx_lm.load(str(models["tiny"]))
    messages = [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": "Show me setup.py"},
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
            "name": "read_file", "arguments": {"path": "setup.py"}}}]},
        {"role": "tool", "content": "from setuptools import setup"},
    ]
    ids = tokenizer.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True)
    text = tokenizer.decode(ids)
    assert text.startswith("<|im_start|>system\nYou are a coding agent.\n\n# Tools")
    assert json.dumps(TOOLS[0]) in text
    assert '<tool_call>\n{"name": "read_file", "arguments": {"path": "setup.py"}}\n</tool_call>' \
        in text
    assert "<tool_response>\nfrom setuptools import setup\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert tokenizer.has_tool_calling and tokenizer.tool_call_start == "<tool_call>"
    call = tokenizer.tool_parser('\n{"name": "read_file", "arguments": {"path": "a"}}\n')
    assert call["name"] == "read_file"
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in tokenizer.eos_token_ids


# ------------------------------------------------------------------ the KV cross-check


def prefill(model, cache, tokens: int, attention_only: bool) -> None:
    """Run ``tokens`` through the model, or through each layer's attention module alone.

    mlx's CPU backend runs MoE (GatherMM) in float32 only, so a bfloat16 qwen3_next
    cannot run whole on CPU; its attention modules (which own the caches) still can.
    """
    if not attention_only:
        mx.eval(model(mx.arange(5, 5 + tokens)[None], cache=cache))
        return
    mx.random.seed(0)
    h = mx.random.normal((1, tokens, model.args.hidden_size)).astype(mx.bfloat16)
    for layer, c in zip(model.layers, cache, strict=True):
        attn = layer.linear_attn if layer.is_linear else layer.self_attn
        mx.eval(attn(h, None if layer.is_linear else "causal", c))


def measure_prefill(model_dir: Path, tokens: int, attention_only: bool = False) -> dict[str, int]:
    """Prefill ``tokens`` with mlx-lm's own cache; the bytes the caches then hold."""
    model, _ = mlx_lm.load(str(model_dir))
    cache = make_prompt_cache(model)
    prefill(model, cache, tokens, attention_only)
    used = allocated = state = 0
    for c in cache:
        if isinstance(c, KVCache):
            assert c.offset == tokens
            used += c.keys[..., : c.offset, :].nbytes + c.values[..., : c.offset, :].nbytes
            allocated += c.keys.nbytes + c.values.nbytes
        elif isinstance(c, ArraysCache):
            state += sum(a.nbytes for a in c.cache if a is not None)
    return {"used": used, "allocated": allocated, "state": state}


@pytest.mark.parametrize("name", ["tiny", "hybrid", "tiny-bf16", "hybrid-bf16"])
def test_kv_formula_matches_mlx_lm_cache(models, name, record_property):
    facts = inspect_model(models[name])
    got = measure_prefill(models[name], PROMPT_TOKENS, attention_only=name == "hybrid-bf16")
    record_property("kv", {**got, "kv_bytes_per_token": facts.kv_bytes_per_token,
                           "per_sequence_fixed_bytes": facts.per_sequence_fixed_bytes})
    assert got["used"] == facts.kv_bytes_per_token * PROMPT_TOKENS
    # mlx-lm's KVCache grows in steps of 256 tokens: allocation is rounded up.
    step = KVCache.step
    assert got["allocated"] == facts.kv_bytes_per_token * math.ceil(PROMPT_TOKENS / step) * step
    assert got["state"] <= facts.per_sequence_fixed_bytes
    if facts.per_sequence_fixed_bytes:
        assert got["state"] == facts.per_sequence_fixed_bytes  # the bound is tight here


@pytest.mark.skipif(os.environ.get("PLIMSOLL_SLOW") != "1", reason="set PLIMSOLL_SLOW=1")
def test_qwen3_06b_shape(tmp_path):
    d = build_demo_model(tmp_path / "q", "qwen3-0.6b", dtype="bfloat16")
    facts = inspect_model(d)
    assert (facts.num_layers, facts.kv_layers, facts.num_key_value_heads, facts.head_dim) == (
        28, 28, 8, 128)
    assert facts.kv_bytes_per_token == 112 * 1024
    model, _ = mlx_lm.load(str(d))
    params = sum(v.size for _, v in tree_flatten(model.parameters()))
    assert params == 596_049_920  # Qwen3-0.6B's published count, tied embeddings
    assert facts.weights_bytes == 2 * params
    assert greedy(d, max_tokens=4)


# ------------------------------------------------------------------ answers that end

def test_eos_bias_ends_sampled_answers_and_leaves_plain_builds_alone(models, tmp_path):
    """The embedded default's demo (``eos_bias``) ends an answer sampled at temperature 1
    after some tokens of noise; the plain build runs to its limit (no end-of-turn)."""
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler

    def lengths(model_dir: Path, limit: int = 300) -> list[int]:
        model, tok = mlx_lm.load(str(model_dir))
        out = []
        for text in ("say hi", "def f(x): return x", "hello there"):
            prompt = mx.array(tok.apply_chat_template([{"role": "user", "content": text}],
                                                      add_generation_prompt=True))
            mx.random.seed(1)
            n = 0
            for token, _ in generate_step(prompt, model, sampler=make_sampler(1.0),
                                          max_tokens=limit):
                n += 1
                if token in tok.eos_token_ids:
                    break
            out.append(n)
        return out

    ending = build_demo_model(tmp_path / "eos", "tiny", eos_bias=3.5)
    assert json.loads((ending / MARKER).read_text())["eos_bias"] == 3.5
    assert "eos_bias" not in json.loads((models["tiny"] / MARKER).read_text())
    got = lengths(ending)
    assert all(1 < n < 300 for n in got), got
    assert max(lengths(models["tiny"])) == 300
    with pytest.raises(FileExistsError):  # a plain build is not taken for a biased one
        build_demo_model(models["tiny"], "tiny", eos_bias=3.5)
