"""The worker's contract (core.worker_config): one declaration, two spellings that agree.

Launch writes a worker's flags from a ``WorkerConfig``; ``plimsoll worker`` parses them with
options generated from the same declaration. The property: config → argv → the real click
command's parsing → config is the identity, for any valid config (pure: nothing is served).
"""

from __future__ import annotations

from pathlib import Path
from types import UnionType
from typing import Literal, Union, get_args, get_origin

import click
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from plimsoll.cli.common import UsageFailure
from plimsoll.cli.worker import config_from_options, worker_command
from plimsoll.core.sizing import DEFAULT_OUTPUT_TOKENS
from plimsoll.core.worker_config import SETTINGS, Setting, WorkerConfig, worker_flags
from plimsoll.launch.spawn import worker_argv

MODEL_DIR = Path(__file__).resolve().parent  # any existing directory will do

#: Every flag ``plimsoll worker`` has taken; launch, the proxy and users' scripts spell them.
FLAGS = {
    "--model", "--model-name", "--max-cache-blocks", "--gpu-memory-utilization",
    "--cache-memory-mb", "--max-num-seqs", "--max-batch", "--prefill-chunk", "--kv-dtype",
    "--kv-bits", "--transient-bytes", "--block-bytes", "--context", "--block-tokens",
    "--max-tokens", "--default-max-tokens", "--max-queue", "--max-wait", "--ceiling-bytes",
    "--total-ram-bytes", "--trip-offset", "--mlx-cache-mb", "--wired-limit-bytes",
    "--disk-cache-dir", "--disk-cache-gb", "--host", "--port", "--max-tokens-over-limit",
    "--drain-timeout", "--quiet", "--prompt-lookup", "--num-draft-tokens",
    "--draft-model", "--compile-decode", "--mtp",
}
NAME = st.text("abcdefghijklmnopqrstuvwxyz0123456789-._", min_size=1, max_size=20).filter(
    lambda s: not s.startswith("-"))


def _bounds(s: Setting) -> dict[str, float]:
    out: dict[str, float] = {}
    for m in s.info.metadata:
        out |= {k: v for k in ("gt", "ge", "lt", "le") if (v := getattr(m, k, None)) is not None}
    return out


def _strategy(s: Setting) -> st.SearchStrategy:
    """Any valid value of one setting, from its annotation and bounds."""
    kind, optional = s.info.annotation, False
    if get_origin(kind) in (Union, UnionType):
        kind, optional = next(a for a in get_args(kind) if a is not type(None)), True
    b = _bounds(s)
    if get_origin(kind) is Literal:
        values = st.sampled_from(get_args(kind))
    elif kind is bool:
        values = st.booleans()
    elif kind is int:
        values = st.integers(b["ge"] if "ge" in b else b.get("gt", -(10**12) - 1) + 1,
                             b["le"] if "le" in b else b.get("lt", 10**12 + 1) - 1)
    elif kind is float:
        values = st.floats(b.get("ge", b.get("gt", -1e9)), b.get("le", b.get("lt", 1e9)),
                           exclude_min="gt" in b, exclude_max="lt" in b,
                           allow_nan=False, allow_infinity=False)
    elif kind is Path:
        values = st.just(MODEL_DIR) if s.spelling.existing else NAME.map(
            lambda n: Path("/tmp/plimsoll-test") / n)
    elif kind is str:
        values = NAME
    else:  # a new kind of setting: teach this strategy (and the option generator) about it
        raise AssertionError(f"no strategy for {s.name}: {kind!r}")
    return st.one_of(st.none(), values) if optional else values


@st.composite
def configs(draw) -> WorkerConfig:
    """A valid config: every setting drawn on its own, the output figures within the context
    (``plimsoll worker`` refuses ``--max-tokens`` at or over ``--context``)."""
    values = {s.name: draw(_strategy(s)) for s in SETTINGS}
    values["context"] = draw(st.integers(2, 10**7))
    values["max_tokens"] = draw(st.integers(1, values["context"] - 1))
    values["default_max_tokens"] = draw(st.integers(1, values["max_tokens"]))
    return WorkerConfig(**values)


def parse(argv: list[str]) -> WorkerConfig:
    """``plimsoll worker``'s own parsing of ``argv`` (the real click command), no serving."""
    ctx = worker_command.make_context("worker", list(argv))
    return config_from_options(ctx.params, read_snapshot=_no_probe)


def _no_probe():
    raise AssertionError("every figure was given: the live probe must not be read")


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=configs())
def test_config_to_argv_to_config_is_the_identity(cfg: WorkerConfig) -> None:
    argv = worker_argv(cfg)
    assert argv[-len(worker_flags(cfg)):] == worker_flags(cfg)
    assert parse(worker_flags(cfg)) == cfg


def test_every_flag_is_kept_and_every_setting_has_a_flag_and_help() -> None:
    options = {o for p in worker_command.params for o in p.opts if isinstance(p, click.Option)}
    assert options - {"--help"} == FLAGS
    assert all(s.info.description for s in SETTINGS), [s.name for s in SETTINGS
                                                        if not s.info.description]


def test_what_the_command_line_leaves_out_is_filled() -> None:
    snap = type("Snap", (), {"ceiling_bytes": 7 << 30, "total_ram_bytes": 8 << 30})
    ctx = worker_command.make_context("worker", [
        "--model", str(MODEL_DIR), "--max-cache-blocks", "64", "--gpu-memory-utilization",
        "0.5", "--max-num-seqs", "2", "--context", "8192", "--kv-bits", "4"])
    cfg = config_from_options(ctx.params, read_snapshot=lambda: snap)
    assert (cfg.model_name, cfg.max_tokens, cfg.default_max_tokens) == \
        (MODEL_DIR.name, 2048, DEFAULT_OUTPUT_TOKENS)
    assert (cfg.ceiling_bytes, cfg.total_ram_bytes, cfg.kv_dtype) == (7 << 30, 8 << 30, "q4")
    assert (cfg.max_wait_s, cfg.drain_s, cfg.port, cfg.cache_memory_mb) == (30.0, 30.0, 8081, 0)


@pytest.mark.parametrize(("extra", "message"), [
    (["--kv-bits", "8", "--kv-dtype", "q4"], "--kv-bits 8 and --kv-dtype q4 disagree"),
    (["--max-tokens", "512"], "--max-tokens 512 must be below --context 512"),
])
def test_contradictions_are_usage_errors(extra: list[str], message: str) -> None:
    ctx = worker_command.make_context("worker", [
        "--model", str(MODEL_DIR), "--max-cache-blocks", "64", "--gpu-memory-utilization",
        "0.5", "--max-num-seqs", "1", "--context", "512", "--ceiling-bytes", "1024",
        "--total-ram-bytes", "2048", *extra])
    with pytest.raises(UsageFailure, match=message):
        config_from_options(ctx.params, read_snapshot=_no_probe)
