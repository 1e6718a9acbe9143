"""model_facts: the architecture figures of DESIGN.md, from real configs and real headers."""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError
from safetensors.numpy import save_file

from plimsoll.core.model_facts import (
    ModelFacts,
    ModelInspectionError,
    facts_from_config,
    inspect_model,
)
from plimsoll.core.safetensors_header import safetensors_tensor_bytes

pytestmark = pytest.mark.pure

CONFIGS = Path(__file__).parents[1] / "fixtures" / "configs"
KIB = 1024


def load(name: str) -> dict:
    return json.loads((CONFIGS / f"{name}.json").read_text())


# ------------------------------------------------------------------ the known figures


@pytest.mark.parametrize(
    ("name", "layers", "kv_layers", "kv_heads", "head_dim", "kib", "native"),
    [
        ("Qwen3-30B-A3B", 48, 48, 4, 128, 96, 40960),
        ("Qwen3-Next-80B-A3B", 48, 12, 2, 256, 24, 262144),
        ("Llama-3.1-8B", 32, 32, 8, 128, 128, 131072),
        ("Qwen3-0.6B", 28, 28, 8, 128, 112, 40960),
    ],
)
def test_design_table(name, layers, kv_layers, kv_heads, head_dim, kib, native):
    facts = facts_from_config(load(name), weights_bytes=0)
    assert facts.num_layers == layers
    assert facts.kv_layers == kv_layers
    assert facts.num_key_value_heads == kv_heads
    assert facts.head_dim == head_dim  # Llama's is derived: 4096 // 32
    assert facts.kv_dtype == "bfloat16" and facts.kv_dtype_bytes == 2
    assert facts.kv_bytes_per_token == kib * KIB
    assert facts.native_max_context == native
    assert facts.sliding_layers == 0 and facts.sliding_window is None
    assert facts.notes == []


def test_dense_models_hold_nothing_per_sequence():
    for name in ("Qwen3-30B-A3B", "Llama-3.1-8B", "Qwen3-0.6B"):
        assert facts_from_config(load(name), 0).per_sequence_fixed_bytes == 0


def test_qwen3_next_linear_state_per_sequence():
    facts = facts_from_config(load("Qwen3-Next-80B-A3B"), 0)
    # 36 gated-delta layers: recurrent 32 heads × 128 × 128 × float32,
    # conv (4 − 1) × (2·16·128 + 32·128) × bfloat16.
    per_layer = 32 * 128 * 128 * 4 + 3 * (2 * 16 * 128 + 32 * 128) * 2
    assert facts.per_sequence_fixed_bytes == 36 * per_layer == 77_266_944


def test_explicit_kv_dtype_wins():
    facts = facts_from_config(load("Qwen3-0.6B"), 0, kv_dtype="float32")
    assert (facts.kv_dtype, facts.kv_bytes_per_token) == ("float32", 224 * KIB)
    assert facts_from_config(load("Qwen3-0.6B"), 0, kv_dtype="torch.float16").kv_dtype == "float16"


# ------------------------------------------------------------------ config shapes


def test_text_config_nesting():
    text = load("Qwen3-0.6B")
    dtype = text.pop("torch_dtype")
    wrapped = {"model_type": "qwen3_vl", "torch_dtype": dtype, "text_config": text,
               "vision_config": {"hidden_size": 1152, "depth": 27}}
    facts = facts_from_config(wrapped, 0)
    assert facts.model_type == "qwen3_vl"
    assert facts.kv_bytes_per_token == 112 * KIB
    assert facts.native_max_context == 40960


def test_transformers5_dtype_key():
    cfg = load("Qwen3-0.6B")
    cfg["dtype"] = cfg.pop("torch_dtype")
    assert facts_from_config(cfg, 0).kv_dtype == "bfloat16"


def test_layer_types_with_sliding_window():
    # gpt-oss shape: 24 layers alternating sliding (window 128) and full attention.
    cfg = {"model_type": "gpt_oss", "num_hidden_layers": 24, "num_attention_heads": 64,
           "num_key_value_heads": 8, "head_dim": 64, "sliding_window": 128,
           "torch_dtype": "bfloat16", "max_position_embeddings": 131072,
           "layer_types": ["sliding_attention", "full_attention"] * 12}
    facts = facts_from_config(cfg, 0)
    assert (facts.kv_layers, facts.sliding_layers, facts.sliding_window) == (12, 12, 128)
    assert facts.kv_bytes_per_token == 2 * 12 * 8 * 64 * 2
    assert facts.per_sequence_fixed_bytes == 2 * 12 * 8 * 64 * 2 * 128


def test_gemma3_sliding_window_pattern():
    # gemma-3-1b: every 6th layer global, the others capped at a 512-token window.
    cfg = {"model_type": "gemma3_text", "num_hidden_layers": 26, "num_attention_heads": 4,
           "num_key_value_heads": 1, "head_dim": 256, "sliding_window": 512,
           "sliding_window_pattern": 6, "torch_dtype": "bfloat16"}
    facts = facts_from_config(cfg, 0)
    assert (facts.kv_layers, facts.sliding_layers) == (4, 22)  # layers 5, 11, 17, 23
    assert facts.per_sequence_fixed_bytes == 2 * 22 * 1 * 256 * 2 * 512


def test_string_pattern_exaone4_style():
    cfg = {"model_type": "exaone4", "num_hidden_layers": 8, "num_attention_heads": 8,
           "num_key_value_heads": 2, "head_dim": 64, "sliding_window": 4096,
           "sliding_window_pattern": "LLLG", "torch_dtype": "bfloat16"}
    facts = facts_from_config(cfg, 0)
    assert (facts.kv_layers, facts.sliding_layers) == (2, 6)


def test_qwen_sliding_window_disabled_means_full():
    cfg = load("Qwen3-0.6B") | {"sliding_window": 32768, "use_sliding_window": False}
    facts = facts_from_config(cfg, 0)
    assert (facts.kv_layers, facts.sliding_layers, facts.notes) == (28, 0, [])


def test_unplaced_sliding_window_counts_as_full_and_says_so():
    # Mistral-7B-v0.1 declares a window but nothing says which layers use it.
    cfg = {"model_type": "mistral", "num_hidden_layers": 32, "num_attention_heads": 32,
           "num_key_value_heads": 8, "hidden_size": 4096, "sliding_window": 4096,
           "torch_dtype": "bfloat16", "max_position_embeddings": 32768}
    facts = facts_from_config(cfg, 0)
    assert (facts.kv_layers, facts.sliding_layers) == (32, 0)
    assert any("sliding_window=4096" in n for n in facts.notes)


def test_layer_types_linear_attention_in_text_config():
    # Qwen3.5-style multimodal wrapper: hybrid layout listed explicitly.
    text = {"num_hidden_layers": 8, "num_attention_heads": 16, "num_key_value_heads": 2,
            "head_dim": 256, "layer_types": ["linear_attention"] * 3 + ["full_attention"],
            "linear_num_value_heads": 32, "linear_num_key_heads": 16,
            "linear_key_head_dim": 128, "linear_value_head_dim": 128,
            "linear_conv_kernel_dim": 4, "dtype": "bfloat16"}
    text["layer_types"] *= 2
    facts = facts_from_config({"model_type": "qwen3_5", "text_config": text}, 0)
    assert (facts.kv_layers, facts.sliding_layers) == (2, 0)
    assert facts.kv_bytes_per_token == 2 * 2 * 2 * 256 * 2
    assert facts.per_sequence_fixed_bytes == 6 * (32 * 128 * 128 * 4 + 3 * 8192 * 2)


def test_unknown_linear_state_is_a_note_not_a_guess():
    cfg = {"model_type": "x", "num_hidden_layers": 4, "num_attention_heads": 4,
           "hidden_size": 256, "torch_dtype": "float16",
           "layer_types": ["mamba", "mamba", "mamba", "attention"]}
    facts = facts_from_config(cfg, 0)
    assert (facts.kv_layers, facts.per_sequence_fixed_bytes) == (1, 0)
    assert any("NOT included" in n for n in facts.notes)


def test_unknown_layer_type_counts_as_full():
    cfg = load("Qwen3-0.6B") | {"layer_types": ["full_attention"] * 27 + ["mystery"]}
    facts = facts_from_config(cfg, 0)
    assert facts.kv_layers == 28
    assert any("mystery" in n for n in facts.notes)


def test_quantized_model_keeps_activation_dtype():
    cfg = load("Qwen3-30B-A3B") | {"quantization": {"group_size": 64, "bits": 4},
                                    "quantization_config": {"group_size": 64, "bits": 4}}
    facts = facts_from_config(cfg, weights_bytes=17_000_000_000)
    assert (facts.kv_dtype, facts.kv_dtype_bytes) == ("bfloat16", 2)
    assert facts.kv_bytes_per_token == 96 * KIB
    assert facts.weights_bytes == 17_000_000_000


def test_missing_dtype_assumes_float32_and_says_so():
    cfg = load("Llama-3.1-8B")
    del cfg["torch_dtype"]
    facts = facts_from_config(cfg, 0)
    assert (facts.kv_dtype, facts.kv_bytes_per_token) == ("float32", 256 * KIB)
    assert any("float32" in n for n in facts.notes)


def test_mla_counts_the_latent_once():
    """DeepSeek-V3's real dimensions: mlx-lm caches kv_lora_rank + qk_rope_head_dim a token
    a layer (the latent and the rope key), 25 × less than 2 × heads × hidden/heads."""
    cfg = {"model_type": "deepseek_v3", "num_hidden_layers": 61, "num_attention_heads": 128,
           "num_key_value_heads": 128, "hidden_size": 7168, "kv_lora_rank": 512,
           "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
           "torch_dtype": "bfloat16"}
    facts = facts_from_config(cfg, 0)
    assert facts.kv_bytes_per_token == 61 * (512 + 64) * 2
    assert facts.cache_kinds == ("latent",)
    per_head = 2 * 61 * 128 * (7168 // 128) * 2
    assert per_head / facts.kv_bytes_per_token == pytest.approx(24.9, abs=0.1)
    assert any("expanded" in n for n in facts.notes)


def test_mla_of_an_unknown_cache_is_refused_not_guessed():
    """A latent model type plimsoll has no rule for (mlx-lm's bailing_hybrid, kimi_k3, …)
    might cache the latent or the expanded heads: refused up front, not counted as K/V."""
    cfg = {"model_type": "bailing_hybrid", "num_hidden_layers": 4, "num_attention_heads": 4,
           "hidden_size": 64, "kv_lora_rank": 64, "qk_rope_head_dim": 16,
           "torch_dtype": "bfloat16"}
    with pytest.raises(ModelInspectionError, match=r"kv_lora_rank .*not served yet"):
        facts_from_config(cfg, 0)
    cfg.update(model_type="deepseek_v2", qk_nope_head_dim=16, v_head_dim=32)
    facts = facts_from_config(cfg, 0)  # latent projections, expanded per-head cache
    assert facts.cache_kinds == ("kv",)
    assert facts.kv_bytes_per_token == 4 * 4 * (16 + 16 + 32) * 2


# ------------------------------------------------------------------ refusals


@pytest.mark.parametrize(
    ("mutate", "needle"),
    [
        (lambda c: c.pop("num_hidden_layers"), "num_hidden_layers"),
        (lambda c: c.update(num_attention_heads="16"), "num_attention_heads"),
        (lambda c: c.update(num_key_value_heads=[8, 8]), "num_key_value_heads"),
        (lambda c: c.update(torch_dtype="int4"), "int4"),
        (lambda c: c.update(layer_types=["full_attention"] * 3), "layer_types"),
        (lambda c: c.pop("model_type"), "model_type"),
        (lambda c: (c.pop("head_dim"), c.pop("hidden_size")), "hidden_size"),
    ],
)
def test_bad_configs_name_the_field(mutate, needle):
    cfg = load("Qwen3-0.6B")
    mutate(cfg)
    with pytest.raises(ModelInspectionError, match=needle):
        facts_from_config(cfg, 0)


def test_inspection_error_is_a_value_error():
    assert issubclass(ModelInspectionError, ValueError)


def test_facts_hold_the_arithmetic():
    good = facts_from_config(load("Qwen3-0.6B"), 0).model_dump()
    with pytest.raises(ValidationError, match="kv_bytes_per_token"):
        ModelFacts(**(good | {"kv_bytes_per_token": 1000}))
    with pytest.raises(ValidationError):
        ModelFacts(**(good | {"surprise": 1}))
    facts = ModelFacts(**good)
    with pytest.raises(ValidationError):
        facts.kv_layers = 1


# ------------------------------------------------------------------ files


def write_model(d: Path, config: dict, tensors: dict[str, np.ndarray], name="model.safetensors"):
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(d / name))


def test_weights_bytes_from_real_safetensors(tmp_path):
    tensors = {"a": np.zeros((64, 32), np.float32), "b": np.zeros((7,), np.float16)}
    write_model(tmp_path, load("Qwen3-0.6B"), tensors)
    assert inspect_model(tmp_path).weights_bytes == 64 * 32 * 4 + 7 * 2


def test_sharded_weights_follow_the_index(tmp_path):
    write_model(tmp_path, load("Qwen3-0.6B"), {"a": np.zeros(100, np.float32)},
                name="model-00001-of-00002.safetensors")
    save_file({"b": np.zeros(50, np.float32)}, str(tmp_path / "model-00002-of-00002.safetensors"))
    save_file({"dup": np.zeros(1000, np.float32)}, str(tmp_path / "consolidated.safetensors"))
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors",
                            "b": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    assert inspect_model(tmp_path).weights_bytes == 600
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelInspectionError, match="missing"):
        inspect_model(tmp_path)


def test_stray_safetensors_are_ignored_with_a_note(tmp_path):
    write_model(tmp_path, load("Qwen3-0.6B"), {"a": np.zeros(10, np.float32)})
    save_file({"dup": np.zeros(1000, np.float32)}, str(tmp_path / "consolidated.safetensors"))
    facts = inspect_model(tmp_path)
    assert facts.weights_bytes == 40
    assert any("consolidated.safetensors" in n for n in facts.notes)


def test_dtype_falls_back_to_the_weights(tmp_path):
    cfg = load("Qwen3-0.6B")
    del cfg["torch_dtype"]
    write_model(tmp_path, cfg, {"w": np.zeros(10, np.uint32), "s": np.zeros(4, np.float16)})
    facts = inspect_model(tmp_path)
    assert facts.kv_dtype == "float16"
    assert any("dominant float dtype" in n for n in facts.notes)


def test_huge_sparse_file_reads_only_the_header(tmp_path):
    size = 40 * 1024**3  # 40 GiB of tensor data, never written: a sparse file
    header = json.dumps({"__metadata__": {"format": "mlx"},
                         "w": {"dtype": "BF16", "shape": [size // 2], "data_offsets": [0, size]}})
    header = header.encode() + b" " * (-len(header) % 8)
    path = tmp_path / "model.safetensors"
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        f.truncate(8 + len(header) + size)
    (tmp_path / "config.json").write_text(json.dumps(load("Qwen3-30B-A3B")))
    io = Path("/proc/self/io")
    read_before = _bytes_read(io)
    start = time.perf_counter()
    facts = inspect_model(tmp_path)
    elapsed = time.perf_counter() - start
    assert facts.weights_bytes == size
    if read_before is not None:  # Linux: the bytes this process read, not a timing
        assert _bytes_read(io) - read_before < 4 << 20
    else:  # reading 40 GiB takes many seconds even sparse
        assert elapsed < 2.0, f"inspect_model took {elapsed * 1000:.1f} ms"


def _bytes_read(io: Path) -> int | None:
    """``rchar`` of /proc/self/io: bytes this process read (None where there is none)."""
    if not io.exists():
        return None
    fields = dict(line.split(": ") for line in io.read_text().splitlines())
    return int(fields["rchar"])


def test_truncated_file_is_refused(tmp_path):
    write_model(tmp_path, load("Qwen3-0.6B"), {"a": np.zeros(1000, np.float32)})
    path = tmp_path / "model.safetensors"
    with path.open("r+b") as f:
        f.truncate(path.stat().st_size - 100)
    with pytest.raises(ModelInspectionError, match="truncated"):
        inspect_model(tmp_path)


def test_garbage_header_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(load("Qwen3-0.6B")))
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", 2**40) + b"{}")
    with pytest.raises(ModelInspectionError, match="implausible"):
        safetensors_tensor_bytes(tmp_path / "model.safetensors")
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", 4) + b"nope")
    with pytest.raises(ModelInspectionError, match="unreadable"):
        inspect_model(tmp_path)


def test_directory_errors_say_what_to_change(tmp_path):
    with pytest.raises(ModelInspectionError, match="not a directory"):
        inspect_model(tmp_path / "absent")
    with pytest.raises(ModelInspectionError, match=r"no config\.json"):
        inspect_model(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelInspectionError, match="not valid JSON"):
        inspect_model(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(load("Qwen3-0.6B")))
    with pytest.raises(ModelInspectionError, match=r"no \*\.safetensors"):
        inspect_model(str(tmp_path))


# ------------------------------------------------------------------ every cache kind, real dims


def test_gpt_oss_windows_are_capped_at_min_window_context():
    cfg = {"model_type": "gpt_oss", "num_hidden_layers": 36, "num_attention_heads": 64,
           "num_key_value_heads": 8, "head_dim": 64, "hidden_size": 2880, "sliding_window": 128,
           "layer_types": ["sliding_attention", "full_attention"] * 18, "torch_dtype": "bfloat16"}
    facts = facts_from_config(cfg, 0)
    per_layer = 2 * 8 * 64 * 2
    assert facts.kv_bytes_per_token == 18 * per_layer
    assert facts.per_sequence_fixed_bytes == 18 * per_layer * 128
    assert facts.fixed_bytes(100) == 18 * per_layer * 100  # a context below the window
    assert facts.sequence_bytes(1000) == 18 * per_layer * (1000 + 128)


def test_nemotron_h_pattern_counts_only_star_layers_as_kv():
    cfg = {"model_type": "nemotron_h", "hybrid_override_pattern": "M-M-M*-M-M*-", "hidden_size": 64,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
           "mamba_num_heads": 8, "mamba_head_dim": 16, "ssm_state_size": 32, "n_groups": 2,
           "conv_kernel": 4, "torch_dtype": "bfloat16"}
    facts = facts_from_config(cfg, 0)
    assert facts.num_layers == 12 and facts.kv_layers == 2
    assert facts.kv_bytes_per_token == 2 * 2 * 2 * 16 * 2
    conv_dim = 8 * 16 + 2 * 2 * 32
    assert facts.state_bytes_per_seq == 5 * ((4 - 1) * conv_dim + 8 * 16 * 32) * 2


def test_jamba_attention_period_and_offset():
    cfg = {"model_type": "jamba", "num_hidden_layers": 8, "attn_layer_period": 8,
           "attn_layer_offset": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
           "hidden_size": 64, "mamba_expand": 2, "mamba_d_state": 16, "mamba_d_conv": 4,
           "torch_dtype": "float32"}
    facts = facts_from_config(cfg, 0)
    (kv,) = [c for c in facts.caches if c.kind == "kv"]
    assert kv.layers == (4,) and facts.state_bytes_per_seq == 7 * (3 * 128 + 128 * 16) * 4


def test_pure_state_space_needs_no_attention_heads():
    cfg = {"model_type": "mamba2", "num_hidden_layers": 2, "num_heads": 4, "head_dim": 16,
           "hidden_size": 32, "state_size": 16, "n_groups": 1, "conv_kernel": 4,
           "torch_dtype": "float32"}
    facts = facts_from_config(cfg, 0)
    assert facts.cache_kinds == ("state",) and facts.kv_bytes_per_token == 0
    assert facts.num_key_value_heads == 0


def test_quantized_kv_needs_groups_of_64():
    cfg = load("Qwen3-0.6B")  # head_dim 128: 2 groups a vector
    q4 = facts_from_config(cfg, 0, kv_dtype="q4")
    assert q4.kv_bytes_per_token == 28 * 2 * 8 * (128 // 2 + 2 * 2 * 2)
    with pytest.raises(ModelInspectionError, match="groups of 64"):
        facts_from_config({**cfg, "head_dim": 48}, 0, kv_dtype="q8")
