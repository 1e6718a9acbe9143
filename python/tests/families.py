"""Tiny random-weight models of every family issue 15 names, in the real mlx-lm layout.

Test support, not production: each family is a ``config.json`` with that family's real field
names (the fields its Hugging Face / mlx-lm config carries) at tiny dimensions, built with
mlx-lm 0.32's own model class (``mlx_lm.utils._get_classes``), weights scaled so greedy output
varies, saved with ``save_model`` / ``save_config`` beside the demo tokenizer
(:mod:`plimsoll.demo.tokenizer`). ``mlx_lm.load(dir)`` loads every one of them.

:func:`build_family` builds one into a directory; :data:`FAMILIES` lists them (name → spec).
A family whose model file mlx-lm does not have is listed with ``module`` so a test can skip it
with the reason.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass, field
from pathlib import Path

VOCAB = 512  # the demo tokenizer trained at 512 tokens; every model's vocab_size
_COMMON = {"vocab_size": VOCAB, "torch_dtype": "float32", "max_position_embeddings": 4096,
           "tie_word_embeddings": False, "rms_norm_eps": 1e-6}
_ATTN = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 16, "intermediate_size": 128}
_MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "norm_topk_prob": True}
_MLA = {"kv_lora_rank": 64, "q_lora_rank": 32, "qk_rope_head_dim": 64, "qk_nope_head_dim": 16,
        "v_head_dim": 16}
_DSV3 = {**_MLA, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 4,
         "intermediate_size": 128, "moe_intermediate_size": 32, "n_routed_experts": 4,
         "n_shared_experts": 1, "num_experts_per_tok": 2, "routed_scaling_factor": 1.0,
         "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": True,
         "n_group": 1, "topk_group": 1, "moe_layer_freq": 1, "first_k_dense_replace": 1,
         "rope_theta": 10000.0, "rope_scaling": None, "attention_bias": False}
_GDN = {"linear_num_value_heads": 4, "linear_num_key_heads": 2, "linear_key_head_dim": 16,
        "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4}


@dataclass(frozen=True)
class Family:
    config: dict
    module: str  # mlx_lm.models.<module> that serves it
    quantize_bits: int | None = None  # weights quantized (mlx-lm's quantize_model)
    extra_tensors: dict[str, tuple[int, ...]] = field(default_factory=dict)  # e.g. MTP layers
    mtp_layer: bool = False  # extra_tensors also hold a random decoder layer (the MTP's own)
    scale: float = 3.0  # matrices × scale: random init at 1× gives near-uniform logits, greedy
    #                     output then repeats one token (measured: 2-5 distinct of 24 at 1×)


def _cfg(model_type: str, arch: str, **fields) -> dict:
    layers = {} if "num_layers" in fields else {"num_hidden_layers": 4}  # longcat: num_layers
    return {"model_type": model_type, "architectures": [arch], **_COMMON, **layers, **fields}


FAMILIES: dict[str, Family] = {
    "llama": Family(_cfg("llama", "LlamaForCausalLM", **{**_ATTN, "head_dim": 64},
                         rope_theta=10000.0, hidden_act="silu"), "llama"),
    "qwen3": Family(_cfg("qwen3", "Qwen3ForCausalLM", **{**_ATTN, "head_dim": 64},
                         rope_theta=1e6, attention_bias=False, sliding_window=None,
                         use_sliding_window=False), "qwen3"),
    "qwen3_4bit": Family(_cfg("qwen3", "Qwen3ForCausalLM", hidden_size=128,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                              intermediate_size=256, rope_theta=1e6, attention_bias=False),
                         "qwen3", quantize_bits=4),
    "qwen3_moe": Family(_cfg("qwen3_moe", "Qwen3MoeForCausalLM", **_ATTN, **_MOE,
                             decoder_sparse_step=1, mlp_only_layers=[], rope_theta=1e6),
                        "qwen3_moe"),
    "qwen3_next": Family(_cfg("qwen3_next", "Qwen3NextForCausalLM", **_ATTN, **_MOE, **_GDN,
                              num_hidden_layers=4, full_attention_interval=4,
                              decoder_sparse_step=1, mlp_only_layers=[],
                              shared_expert_intermediate_size=32, rope_theta=1e7,
                              partial_rotary_factor=0.25), "qwen3_next"),
    "qwen3_5": Family({"model_type": "qwen3_5",
                       "architectures": ["Qwen3_5ForConditionalGeneration"],
                       "tie_word_embeddings": False,
                       "text_config": {"model_type": "qwen3_5_text", **_COMMON, **_ATTN, **_GDN,
                                       "num_hidden_layers": 4, "full_attention_interval": 2,
                                       "rope_parameters": {"rope_theta": 1e7,
                                                           "partial_rotary_factor": 0.25,
                                                           "rope_type": "default"}}},
                      "qwen3_5"),
    "mistral": Family(_cfg("mistral", "MistralForCausalLM", **_ATTN, rope_theta=1e6,
                           sliding_window=None), "llama"),
    "glm4_moe": Family(_cfg("glm4_moe", "Glm4MoeForCausalLM", **_ATTN, n_routed_experts=4,
                            n_shared_experts=1, num_experts_per_tok=2,
                            moe_intermediate_size=32, norm_topk_prob=True, n_group=1,
                            topk_group=1, routed_scaling_factor=1.0, first_k_dense_replace=1,
                            rope_theta=1e6, rope_scaling=None, use_qk_norm=True,
                            attention_bias=True, partial_rotary_factor=0.5,
                            num_nextn_predict_layers=0), "glm4_moe"),
    "phi3": Family(_cfg("phi3", "Phi3ForCausalLM", hidden_size=64, num_attention_heads=4,
                        num_key_value_heads=2, intermediate_size=128, rope_theta=10000.0),
                   "phi3"),
    "olmo2": Family(_cfg("olmo2", "Olmo2ForCausalLM", hidden_size=64, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=128, rope_theta=10000.0,
                         attention_bias=False), "olmo2"),
    "gpt_oss": Family(_cfg("gpt_oss", "GptOssForCausalLM", **_ATTN, num_local_experts=4,
                           num_experts_per_tok=2, sliding_window=64, rope_theta=150000,
                           layer_types=["sliding_attention", "full_attention"] * 2),
                      "gpt_oss"),
    "gemma3_text": Family(_cfg("gemma3_text", "Gemma3ForCausalLM", **_ATTN,
                               query_pre_attn_scalar=16, sliding_window=64,
                               sliding_window_pattern=2, rope_theta=1e6,
                               rope_local_base_freq=10000.0), "gemma3_text"),
    "ministral3": Family(_cfg("ministral3", "Ministral3ForCausalLM", **_ATTN,
                              sliding_window=64,
                              layer_types=["sliding_attention", "full_attention"] * 2,
                              rope_parameters={"rope_theta": 1e6, "rope_type": "default",
                                               "llama_4_scaling_beta": 0.1,
                                               "original_max_position_embeddings": 4096}),
                         "ministral3"),
    "deepseek_v3": Family(_cfg("deepseek_v3", "DeepseekV3ForCausalLM", **_DSV3), "deepseek_v3"),
    "glm4_moe_lite": Family(_cfg("glm4_moe_lite", "Glm4MoeLiteForCausalLM", **_DSV3,
                                 num_nextn_predict_layers=0), "glm4_moe_lite"),
    "lfm2": Family(_cfg("lfm2", "Lfm2ForCausalLM", hidden_size=64, num_attention_heads=4,
                        num_key_value_heads=2, norm_eps=1e-5, conv_bias=False, conv_L_cache=3,
                        block_dim=64, block_ff_dim=128, block_multiple_of=32,
                        block_ffn_dim_multiplier=1.0, block_auto_adjust_ff_dim=False,
                        rope_theta=1e6, layer_types=["conv", "full_attention", "conv", "conv"]),
                   "lfm2"),
    "olmo_hybrid": Family(_cfg("olmo_hybrid", "OlmoHybridForCausalLM", **_ATTN, **_GDN,
                               linear_allow_neg_eigval=True, attention_bias=False,
                               layer_types=["linear_attention", "linear_attention",
                                            "linear_attention", "full_attention"]),
                          "olmo_hybrid"),
    "nemotron_h": Family(_cfg("nemotron_h", "NemotronHForCausalLM", hidden_size=64,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                              intermediate_size=128, attention_bias=False, mamba_num_heads=4,
                              mamba_head_dim=16, mamba_proj_bias=False, ssm_state_size=16,
                              conv_kernel=4, n_groups=2, mlp_bias=False,
                              layer_norm_epsilon=1e-5, use_bias=False, use_conv_bias=True,
                              hybrid_override_pattern="M-M*-M", num_hidden_layers=6),
                         "nemotron_h"),
    "jamba": Family(_cfg("jamba", "JambaForCausalLM", hidden_size=64, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=128, attn_layer_offset=2,
                         attn_layer_period=4, expert_layer_offset=1, expert_layer_period=2,
                         mamba_d_conv=4, mamba_d_state=8, mamba_expand=2, mamba_dt_rank=8,
                         num_experts=4, num_experts_per_tok=2, num_hidden_layers=4),
                    "jamba"),
    "granitemoehybrid": Family(_cfg("granitemoehybrid", "GraniteMoeHybridForCausalLM",
                                    hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                    intermediate_size=128, attention_bias=False,
                                    embedding_multiplier=12.0, attention_multiplier=0.0625,
                                    logits_scaling=1.0, residual_multiplier=0.25,
                                    layer_types=["mamba", "mamba", "attention", "mamba"],
                                    num_hidden_layers=4, mamba_n_heads=4, mamba_d_head=16,
                                    mamba_proj_bias=False, mamba_d_state=16, mamba_d_conv=4,
                                    mamba_n_groups=1, mamba_conv_bias=True, mamba_expand=1,
                                    shared_intermediate_size=128, rope_theta=10000.0),
                               "granitemoehybrid"),
    "deepseek_v32": Family(_cfg("deepseek_v32", "DeepseekV32ForCausalLM", **_DSV3,
                                index_head_dim=64, index_n_heads=2, index_topk=64),
                           "deepseek_v32"),
    "glm_moe_dsa": Family(_cfg("glm_moe_dsa", "GlmMoeDsaForCausalLM",
                               **{k: v for k, v in _DSV3.items() if k != "rope_theta"},
                               index_head_dim=64, index_n_heads=2, index_topk=64,
                               rope_parameters={"rope_theta": 10000.0, "rope_type": "default"}),
                          "glm_moe_dsa"),
    "falcon_h1": Family(_cfg("falcon_h1", "FalconH1ForCausalLM", hidden_size=64,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                             intermediate_size=128, mamba_d_conv=4, mamba_d_head=16,
                             mamba_d_ssm=64, mamba_d_state=16, mamba_expand=1,
                             mamba_n_groups=1, mamba_n_heads=4, mamba_chunk_size=16),
                        "falcon_h1"),
    "longcat_flash": Family(_cfg("longcat_flash", "LongcatFlashForCausalLM", **_MLA,
                                 attention_method="MLA", zero_expert_type="identity",
                                 hidden_size=64, ffn_hidden_size=128, moe_topk=2,
                                 expert_ffn_hidden_size=32, n_routed_experts=4,
                                 zero_expert_num=2, num_layers=2, num_attention_heads=4,
                                 routed_scaling_factor=1.0, rope_theta=10000.0,
                                 mla_scale_q_lora=True, mla_scale_kv_lora=True,
                                 attention_bias=False), "longcat_flash"),
    "llama4": Family({"model_type": "llama4", "architectures": ["Llama4ForConditionalGeneration"],
                      "tie_word_embeddings": False,
                      "text_config": {"model_type": "llama4_text", **_COMMON, **_ATTN,
                                      "attention_bias": False, "attention_chunk_size": 64,
                                      "interleave_moe_layer_step": 2, "intermediate_size_mlp": 128,
                                      "num_experts_per_tok": 1, "num_local_experts": 2,
                                      "rope_scaling": None, "rope_theta": 500000.0,
                                      "use_qk_norm": True, "num_hidden_layers": 4}},
                     "llama4"),
    "mamba2": Family(_cfg("mamba2", "Mamba2ForCausalLM", num_heads=4, head_dim=16, hidden_size=32,
                          intermediate_size=64, state_size=16, num_hidden_layers=2,
                          layer_norm_epsilon=1e-5, conv_kernel=4, n_groups=1, use_bias=False,
                          use_conv_bias=True, time_step_limit=[0.0, 1e9],
                          time_step_rank="auto"), "mamba2"),
    "kimi_linear": Family(_cfg("kimi_linear", "KimiLinearForCausalLM", **_ATTN, **_MLA,
                               rope_theta=10000.0, model_max_length=4096, num_experts=4,
                               moe_intermediate_size=32, num_experts_per_token=2,
                               linear_attn_config={"kda_layers": [1, 2, 3], "num_heads": 4,
                                                   "head_dim": 16,
                                                   "short_conv_kernel_size": 4}),
                          "kimi_linear"),
}
FAMILIES["kimi_k25"] = Family({"model_type": "kimi_k25",
                               "architectures": ["KimiK25ForConditionalGeneration"],
                               "tie_word_embeddings": False,
                               "text_config": {"model_type": "kimi_k2", **_COMMON,
                                               "num_hidden_layers": 4, **_DSV3}}, "kimi_k25")
FAMILIES["mistral4"] = Family(_cfg("mistral4", "Mistral4ForCausalLM", **{
    k: v for k, v in _DSV3.items() if k not in ("rope_theta", "rope_scaling")},
    rope_interleave=True,
    rope_parameters={"rope_theta": 10000.0, "rope_type": "default", "llama_4_scaling_beta": 0.1,
                     "original_max_position_embeddings": 4096}), "mistral4")
FAMILIES["deepseek_v2"] = Family(_cfg("deepseek_v2", "DeepseekV2ForCausalLM", **{
    **{k: v for k, v in _DSV3.items() if k not in ("scoring_func", "norm_topk_prob")},
    "topk_method": "greedy", "rope_scaling": {
        "type": "yarn", "factor": 1.0, "original_max_position_embeddings": 4096,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0}}), "deepseek_v2")
FAMILIES["minicpm3"] = Family(_cfg("minicpm3", "MiniCPM3ForCausalLM", hidden_size=64,
                                   num_attention_heads=4, num_key_value_heads=4,
                                   intermediate_size=128, q_lora_rank=32, kv_lora_rank=64,
                                   qk_nope_head_dim=16, qk_rope_head_dim=16, dim_model_base=64,
                                   scale_depth=1.4, scale_emb=12, rope_theta=10000.0,
                                   rope_scaling={"type": "longrope", "short_factor": [1.0] * 8,
                                                 "long_factor": [1.0] * 8,
                                                 "original_max_position_embeddings": 4096}),
                              "minicpm3")
FAMILIES["youtu_llm"] = Family(_cfg("youtu_llm", "YoutuForCausalLM", hidden_size=64,
                                    num_attention_heads=4, num_key_value_heads=4,
                                    intermediate_size=128, kv_lora_rank=64, q_lora_rank=32,
                                    qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16,
                                    rope_theta=10000.0, rope_traditional=True,
                                    attention_bias=False, mlp_bias=False), "youtu_llm")
FAMILIES["deepseek_v3_wide"] = Family(_cfg("deepseek_v3", "DeepseekV3ForCausalLM", **{
    **_DSV3, "num_attention_heads": 32, "num_key_value_heads": 32, "qk_nope_head_dim": 64,
    "v_head_dim": 64, "qk_rope_head_dim": 16}), "deepseek_v3")  # MLA's prefill expansion
FAMILIES["glm4_moe_mtp"] = Family({**FAMILIES["glm4_moe"].config, "num_nextn_predict_layers": 1},
                                  "glm4_moe", extra_tensors={
                                      f"model.layers.{{n}}.{name}": shape for name, shape in (
                                          ("eh_proj.weight", (64, 128)),
                                          ("enorm.weight", (64,)), ("hnorm.weight", (64,)),
                                          ("shared_head.norm.weight", (64,)))}, mtp_layer=True)

#: Families built on request only (not in the zoo every family test runs): DeepSeek-V3 with
#: an MTP layer needs its real 61 layers, since mlx-lm's deepseek_v3 sanitize drops exactly
#: ``model.layers.61.*`` (an MTP layer at another index would fail its strict load).
ON_REQUEST = {"deepseek_v3_mtp": Family(
    {**FAMILIES["deepseek_v3"].config, "num_hidden_layers": 61, "num_nextn_predict_layers": 1},
    "deepseek_v3", extra_tensors={
        f"model.layers.{{n}}.{name}": shape for name, shape in (
            ("eh_proj.weight", (64, 128)), ("enorm.weight", (64,)), ("hnorm.weight", (64,)),
            ("shared_head.norm.weight", (64,)))}, mtp_layer=True)}


def has_module(fam: Family) -> bool:
    return importlib.util.find_spec(f"mlx_lm.models.{fam.module}") is not None


def _scale_weights(model, scale: float) -> None:
    """Random init gives near-uniform logits: scale matrices so greedy output varies."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten

    params = [(k, v * scale if v.ndim >= 2 and mx.issubdtype(v.dtype, mx.floating) else v)
              for k, v in tree_flatten(model.parameters())]
    model.update(tree_unflatten(params))


def build_model(fam: Family, seed: int = 0):
    """mlx-lm's own model for ``fam`` with seeded random weights (in memory)."""
    import mlx.core as mx
    from mlx_lm.utils import _get_classes

    config = json.loads(json.dumps(fam.config))  # ModelArgs may mutate nested dicts
    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    model.set_dtype(mx.float32)
    if fam.scale != 1.0:
        _scale_weights(model, fam.scale)
    if fam.quantize_bits:
        import mlx.nn as nn

        nn.quantize(model, group_size=64, bits=fam.quantize_bits)
    mx.eval(model.parameters())
    return model


def build_family(name: str, out: Path, tokenizer, seed: int = 0) -> Path:
    """Write family ``name`` into ``out`` (config, safetensors, tokenizer files); returns out."""
    import mlx.core as mx
    from mlx_lm.utils import save_config, save_model

    from plimsoll.demo import tokenizer as tokenizer_build

    fam = FAMILIES[name] if name in FAMILIES else ON_REQUEST[name]
    out.mkdir(parents=True, exist_ok=True)
    model = build_model(fam, seed)
    save_model(out, model)
    config = dict(fam.config)
    if fam.quantize_bits:
        config["quantization"] = {"group_size": 64, "bits": fam.quantize_bits}
    if fam.extra_tensors:  # tensors mlx-lm's sanitize drops (MTP layers): a real checkpoint's
        n = config["num_hidden_layers"]
        mx.random.seed(seed + 1)
        extra = {k.format(n=n): (mx.ones(shape) if len(shape) == 1
                                 else mx.random.normal(shape) * shape[1] ** -0.5 * fam.scale)
                 for k, shape in fam.extra_tensors.items()}
        if fam.mtp_layer:  # the decoder layer, of the model's own class, at index n
            from mlx.utils import tree_flatten

            layer = type(model.layers[-1])(model.args, n)
            layer.set_dtype(mx.float32)
            if fam.scale != 1.0:
                _scale_weights(layer, fam.scale)
            extra.update({f"model.layers.{n}.{k}": v
                          for k, v in tree_flatten(layer.parameters())})
        mx.save_safetensors(str(out / "model-mtp.safetensors"), extra, metadata={"format": "mlx"})
        index = json.loads((out / "model.safetensors.index.json").read_text()) \
            if (out / "model.safetensors.index.json").exists() else None
        if index is None:
            from safetensors import safe_open

            with safe_open(str(out / "model.safetensors"), "np") as f:
                keys = list(f.keys())
            index = {"metadata": {}, "weight_map": {k: "model.safetensors" for k in keys}}
        index["weight_map"].update({k: "model-mtp.safetensors" for k in extra})
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    ids = tokenizer_build.token_ids(tokenizer)
    config.update(bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
                  pad_token_id=ids["<|endoftext|>"])
    save_config(config, out / "config.json")
    tokenizer_build.write_tokenizer_files(out, tokenizer, 4096)
    gen = {"bos_token_id": ids["<|endoftext|>"], "eos_token_id": [ids["<|im_end|>"]]}
    (out / "generation_config.json").write_text(json.dumps(gen))
    return out
