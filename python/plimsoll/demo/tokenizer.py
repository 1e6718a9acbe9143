"""A byte-level BPE tokenizer trained offline, with a Qwen-style chat template.

Demo models need a real tokenizer (mlx-lm's loader, detokenizer and tool parser
all read it) but the machines that build them have no Hugging Face hub. So the
tokenizer is trained here with the ``tokenizers`` library on text every Python
install carries: its own standard-library sources, a bounded amount, in sorted
order, so the same Python builds the same tokenizer.

Invariants:

- ids 0, 1, 2 are ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>`` (special);
  the tool markers ``<tool_call>`` ... ``</tool_response>`` are the last ids and
  are *not* special, so they survive decoding and mlx-lm's ``json_tools`` parser
  (picked because the template holds ``<tool_call>`` and ``tool_call.name``) sees them;
- the vocabulary never exceeds the size asked for (a model may pad past it);
- trained vocabularies are cached per size under the cache directory
  (:func:`plimsoll.core.paths.cache_dir`); a cache that cannot be written is skipped.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import sysconfig
import tempfile
from pathlib import Path

import tokenizers
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from plimsoll.core.paths import cache_dir, private_dir

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
EOS_TOKEN, PAD_TOKEN = "<|im_end|>", "<|endoftext|>"
CORPUS_BYTES = 4_000_000
_FORMAT = 1  # bump when training changes, so stale cache entries are not reused

# Qwen2.5-style: tools listed in the system turn, calls as <tool_call>{json}</tool_call>,
# tool results folded into a user turn inside <tool_response> tags.
CHAT_TEMPLATE = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages and messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n' }}
{{- 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}
{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and ' }}
{{- 'arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n' }}
{{- '{\"name\": <function-name>, \"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages and messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'system' and loop.first %}
{%- elif message.role == 'assistant' and message.tool_calls %}
{{- '<|im_start|>assistant' }}
{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
{%- for tool_call in message.tool_calls %}
{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
{{- '\\n<tool_call>\\n{\"name\": \"' + tool_call.name + '\", \"arguments\": ' }}
{%- if tool_call.arguments is string %}{{- tool_call.arguments }}
{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}
{%- endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}
{%- endif %}
{%- else %}
{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""


def stdlib_corpus(budget: int = CORPUS_BYTES) -> list[str]:
    """Python standard-library sources in sorted path order, about ``budget`` bytes in all."""
    root = Path(sysconfig.get_paths()["stdlib"])
    texts, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if {"site-packages", "dist-packages"} & set(path.parts):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        texts.append(text)
        total += len(text.encode("utf-8"))
        if total >= budget:
            break
    if not texts:
        raise RuntimeError(f"no Python sources under {root} to train a tokenizer on")
    return texts


def _cache_path(vocab_size: int) -> Path:
    stdlib = sysconfig.get_paths()["stdlib"]
    key = f"{_FORMAT}|{sys.version}|{stdlib}|{CORPUS_BYTES}|{tokenizers.__version__}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    return cache_dir() / "tokenizers" / f"bpe-{vocab_size}-{digest}.json"


def train_tokenizer(vocab_size: int) -> Tokenizer:
    """Train (or load from cache) a byte-level BPE with exactly the tokens described above."""
    if vocab_size < 512:
        raise ValueError(f"vocab_size {vocab_size} is too small for a byte-level BPE (>= 512)")
    cached = _cache_path(vocab_size)
    if cached.is_file():
        try:  # read only from a directory that is this user's alone
            private_dir(cached.parent, "trained tokenizers")
            return Tokenizer.from_file(str(cached))
        except Exception:  # a corrupt entry (or an unsafe directory): retrained instead
            pass
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(TOOL_TOKENS), special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(stdlib_corpus(), trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    _save_atomically(tok, cached)
    return tok


def _save_atomically(tok: Tokenizer, path: Path) -> None:
    """Write the cache entry via a temp file; any failure leaves no entry (a cache is an
    optimisation: an unwritable one costs a retrain, nothing more)."""
    tmp = None
    try:
        private_dir(path.parent, "trained tokenizers")
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        os.close(fd)
        tok.save(tmp)
        os.replace(tmp, path)
    except Exception:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)


def token_ids(tok: Tokenizer) -> dict[str, int]:
    """Ids of the special and tool tokens (the model config names eos/bos by id)."""
    return {t: tok.token_to_id(t) for t in SPECIAL_TOKENS + TOOL_TOKENS}


def write_tokenizer_files(out_dir: Path, tok: Tokenizer, model_max_length: int) -> None:
    """tokenizer.json, tokenizer_config.json (with the chat template) and special_tokens_map."""
    out_dir = Path(out_dir)
    tok.save(str(out_dir / "tokenizer.json"))
    decoder = {str(tok.token_to_id(t)): {
        "content": t, "lstrip": False, "normalized": False, "rstrip": False,
        "single_word": False, "special": t in SPECIAL_TOKENS} for t in SPECIAL_TOKENS + TOOL_TOKENS}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": decoder,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None, "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN,
        "unk_token": None, "clean_up_tokenization_spaces": False,
        "errors": "replace", "split_special_tokens": False,
        "model_max_length": model_max_length, "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    special = {"eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN,
               "additional_special_tokens": ["<|im_start|>", "<|im_end|>"]}
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special, indent=2))
