"""Bad input on disk: broken model directories and broken policy files.

Every broken file must end as the one error type its reader documents
(:class:`ModelInspectionError`, :class:`PolicyError`) with a message naming what to fix,
and every CLI command that reads one must exit non-zero with that message — no traceback,
no process or cgroup left behind. Hand-written cases cover each way a file breaks;
hypothesis mutates valid files to find the ways nobody wrote down.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from click.testing import CliRunner
from conftest import worker_env
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from plimsoll.cli.main import main
from plimsoll.core.model_facts import (
    ModelFacts,
    ModelInspectionError,
    facts_from_config,
    inspect_model,
)
from plimsoll.core.policy import Policy, PolicyError, load_policy, parse_policy
from plimsoll.core.safetensors_header import read_safetensors_header

FUZZ = settings(max_examples=150, deadline=None, derandomize=True,  # CI: the same examples
                suppress_health_check=[HealthCheck.function_scoped_fixture])
JSON_SCALARS = (st.none() | st.booleans() | st.integers(-(2**70), 2**70)
                | st.floats(allow_nan=False) | st.text(max_size=12))
JSON_VALUES = st.recursive(JSON_SCALARS, lambda kids: st.lists(kids, max_size=4)
                           | st.dictionaries(st.text(max_size=8), kids, max_size=4),
                           max_leaves=12)


def no_traceback(text: str) -> None:
    assert "Traceback" not in text, text


# --- broken model directories ---------------------------------------------------------------

def safetensors_bytes(header: bytes, length: int | None = None, data: bytes = b"") -> bytes:
    return struct.pack("<Q", len(header) if length is None else length) + header + data


def good_header(n: int = 16) -> bytes:
    return json.dumps({"w": {"dtype": "F32", "shape": [n // 4], "data_offsets": [0, n]}}).encode()


@pytest.fixture
def broken(tiny_model, tmp_path):
    """A copy of the tiny demo model (config, weights, tokenizer) to break one way."""
    d = tmp_path / "model"
    shutil.copytree(tiny_model, d)
    return d


def _config(d: Path) -> dict:
    return json.loads((d / "config.json").read_text())


def _drop_weights(d: Path) -> None:
    (d / "model.safetensors.index.json").unlink(missing_ok=True)
    (d / "model.safetensors").unlink()


BREAKS = {
    "missing config": (lambda d: (d / "config.json").unlink(), "has no config.json"),
    "config not JSON": (lambda d: (d / "config.json").write_text("{model_type: qwen3"),
                        "is not valid JSON"),
    "config not UTF-8": (lambda d: (d / "config.json").write_bytes(b'{"a": "\xff\xfe"}'),
                         "config.json"),
    "config a list": (lambda d: (d / "config.json").write_text("[1, 2]"), "JSON object"),
    "config nested deep": (lambda d: (d / "config.json").write_text("[" * 100_000),
                           "config.json"),
    "missing num_hidden_layers": (
        lambda d: (d / "config.json").write_text(json.dumps(
            {k: v for k, v in _config(d).items() if k != "num_hidden_layers"})),
        "num_hidden_layers"),
    "missing model_type": (
        lambda d: (d / "config.json").write_text(json.dumps(
            {k: v for k, v in _config(d).items() if k != "model_type"})), "model_type"),
    "string layer count": (
        lambda d: (d / "config.json").write_text(json.dumps(
            {**_config(d), "num_hidden_layers": "4"})), "num_hidden_layers"),
    "zero head_dim": (
        lambda d: (d / "config.json").write_text(json.dumps({**_config(d), "head_dim": 0})),
        "head_dim"),
    "negative head_dim": (
        lambda d: (d / "config.json").write_text(json.dumps({**_config(d), "head_dim": -32})),
        "head_dim"),
    "unknown torch_dtype": (
        lambda d: (d / "config.json").write_text(json.dumps(
            {**_config(d), "torch_dtype": "int4"})), "dtype"),
    "no weights": (_drop_weights, "no *.safetensors"),
    "truncated header": (lambda d: (d / "model.safetensors").write_bytes(
        safetensors_bytes(good_header())[:20]), "implausible"),
    "header longer than file": (lambda d: (d / "model.safetensors").write_bytes(
        safetensors_bytes(good_header(), length=1 << 40)), "implausible"),
    "file shorter than 8 bytes": (lambda d: (d / "model.safetensors").write_bytes(b"\x01\x02"),
                                  "too short"),
    "header not JSON": (lambda d: (d / "model.safetensors").write_bytes(
        safetensors_bytes(b"not json at all!")), "unreadable safetensors header"),
    "header not UTF-8": (lambda d: (d / "model.safetensors").write_bytes(
        safetensors_bytes(b'{"\xff": 1}')), "unreadable safetensors header"),
    "header a list": (lambda d: (d / "model.safetensors").write_bytes(
        safetensors_bytes(b"[1, 2, 3]")), "not a JSON object"),
    "data truncated": (lambda d: (d / "model.safetensors").write_bytes(
        safetensors_bytes(good_header(1024), data=b"\0" * 16)), "truncated"),
    "offsets not numbers": (lambda d: (d / "model.safetensors").write_bytes(safetensors_bytes(
        json.dumps({"w": {"dtype": "F32", "data_offsets": ["a", "b"]}}).encode())),
        "malformed header entry"),
    "entry without offsets": (lambda d: (d / "model.safetensors").write_bytes(safetensors_bytes(
        json.dumps({"w": {"dtype": "F32"}}).encode())), "malformed header entry"),
    "weights a directory": (lambda d: ((d / "model.safetensors").unlink(),
                                       (d / "model.safetensors").mkdir()), "model.safetensors"),
    "index names a missing shard": (lambda d: (d / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"w": "model-00001-of-00002.safetensors"}})),
        "shards named in the index are missing"),
    "index not JSON": (lambda d: (d / "model.safetensors.index.json").write_text("{"),
                       "weight_map"),
    "index shard names not strings": (lambda d: (d / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"w": 5, "v": ["x"]}})), "weight_map"),
}


@pytest.mark.parametrize("case", sorted(BREAKS))
def test_a_broken_model_directory_is_a_model_inspection_error_naming_it(broken, case):
    breaker, words = BREAKS[case]
    breaker(broken)
    with pytest.raises(ModelInspectionError) as err:
        inspect_model(broken)
    assert words in str(err.value), str(err.value)


@pytest.mark.pure
def test_not_a_directory_and_an_empty_directory(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ModelInspectionError, match="is not a directory"):
        inspect_model(tmp_path / "file")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelInspectionError, match=r"has no config\.json"):
        inspect_model(tmp_path / "empty")


def test_a_missing_tokenizer_is_named_before_a_worker_starts(broken):
    from plimsoll.core.model_facts import check_servable

    check_servable(broken)  # the intact copy passes
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (broken / name).unlink()
    with pytest.raises(ModelInspectionError, match="tokenizer"):
        check_servable(broken)


GOOD_CONFIG = {"model_type": "qwen3", "num_hidden_layers": 4, "num_attention_heads": 8,
               "num_key_value_heads": 2, "head_dim": 32, "hidden_size": 256,
               "max_position_embeddings": 4096, "torch_dtype": "float32"}
CONFIG_KEYS = [*GOOD_CONFIG, "layer_types", "sliding_window", "sliding_window_pattern",
               "full_attention_interval", "text_config", "kv_lora_rank", "dtype",
               "linear_num_value_heads", "linear_num_key_heads", "linear_key_head_dim",
               "linear_value_head_dim", "linear_conv_kernel_dim", "mamba_ssm_dtype",
               "use_sliding_window"]


@pytest.mark.pure
@FUZZ
@given(changes=st.dictionaries(st.sampled_from(CONFIG_KEYS), JSON_VALUES, max_size=4),
       drop=st.sets(st.sampled_from(list(GOOD_CONFIG)), max_size=2))
def test_any_mutated_config_gives_facts_or_a_model_inspection_error(changes, drop):
    """Never a TypeError, a pydantic ValidationError or an overflow from a config value."""
    config = {k: v for k, v in {**GOOD_CONFIG, **changes}.items() if k not in drop}
    try:
        facts = facts_from_config(config, weights_bytes=1024)
    except ModelInspectionError as err:
        assert "config.json" in str(err) or "dtype" in str(err), str(err)
        return
    assert isinstance(facts, ModelFacts) and facts.kv_bytes_per_token >= 0


@pytest.mark.pure
@FUZZ
@given(header=st.one_of(
    st.binary(max_size=64),
    JSON_VALUES.map(lambda v: json.dumps(v).encode()),
    st.dictionaries(st.text(max_size=6), st.fixed_dictionaries(
        {}, optional={"dtype": JSON_SCALARS, "data_offsets": JSON_VALUES,
                      "shape": JSON_VALUES})).map(lambda v: json.dumps(v).encode())),
    length_delta=st.integers(-8, 8), data=st.binary(max_size=32))
def test_any_safetensors_header_is_read_or_refused_by_name(tmp_path, header, length_delta,
                                                           data):
    from plimsoll.core.safetensors_header import safetensors_tensor_bytes

    path = tmp_path / "model.safetensors"
    path.write_bytes(safetensors_bytes(header, max(0, len(header) + length_delta), data))
    try:
        by_dtype = safetensors_tensor_bytes(path)
    except ModelInspectionError as err:
        assert str(path) in str(err)
        return
    assert all(isinstance(n, int) and n >= 0 for n in by_dtype.values())
    assert sum(by_dtype.values()) <= path.stat().st_size
    read_safetensors_header(path)


# --- the CLI on broken model directories ------------------------------------------------------

CLI_BREAKS = ["missing config", "config not JSON", "truncated header", "header not JSON",
              "data truncated", "weights a directory"]


@pytest.mark.parametrize("case", CLI_BREAKS)
def test_admit_on_a_broken_model_exits_2_with_the_reason(broken, case):
    breaker, words = BREAKS[case]
    breaker(broken)
    r = CliRunner().invoke(main, ["admit", str(broken), "--budget-gib", "4", "--ceiling-mib",
                                  "8192", "--total-ram-gib", "16"])
    assert r.exit_code == 2, r.output
    assert words in r.output, r.output
    assert not isinstance(r.exception, Exception) or isinstance(r.exception, SystemExit)


def cgroups_of(pid: int) -> list[str]:
    """plimsoll's memory cgroups made by process ``pid`` (named ``worker-PORT-PID-N``);
    other tests and agents on this box make their own, so only ours are counted."""
    root = Path("/sys/fs/cgroup/memory/plimsoll")
    if not root.is_dir():
        return []
    return [p.name for p in root.iterdir() if p.is_dir() and f"-{pid}-" in p.name]


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """``plimsoll ARGS`` as a real process; its whole session must be gone when it returns."""
    proc = subprocess.Popen([sys.executable, "-m", "plimsoll.cli", *args], env=worker_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    left = [p.pid for p in psutil.process_iter(["pid"]) if _session(p.pid) == proc.pid]
    assert not left, f"processes left behind by plimsoll {args[0]}: {left}"
    assert not cgroups_of(proc.pid), f"cgroups left behind: {cgroups_of(proc.pid)}"
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


def _session(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except OSError:
        return None


WORKER_FLAGS = ["--max-cache-blocks", "256", "--gpu-memory-utilization", "0.9",
                "--max-num-seqs", "1", "--context", "1024", "--max-tokens", "64",
                "--ceiling-bytes", str(8 << 30), "--total-ram-bytes", str(16 << 30),
                "--port", "1"]


@pytest.mark.parametrize("case", ["missing config", "truncated header", "missing tokenizer"])
def test_worker_and_admit_on_a_broken_model_exit_2_without_a_traceback(broken, case):
    """Real processes: the message names the problem; nothing is left running or created."""
    if case == "missing tokenizer":
        for name in ("tokenizer.json", "tokenizer_config.json"):
            (broken / name).unlink()
        words = "tokenizer"
    else:
        breaker, words = BREAKS[case]
        breaker(broken)
    r = run_cli("worker", "--model", str(broken), *WORKER_FLAGS)  # checks processes, cgroups
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert words in r.stderr, r.stderr
    no_traceback(r.stderr + r.stdout)
    if case != "missing tokenizer":  # admission needs no tokenizer
        r = run_cli("admit", str(broken), "--budget-gib", "4", "--ceiling-mib", "8192",
                    "--total-ram-gib", "16")
        assert r.returncode == 2 and words in r.stderr, (r.stdout, r.stderr)
        no_traceback(r.stderr + r.stdout)


# --- broken policy files ----------------------------------------------------------------------

VALID_POLICY = {
    "schemaVersion": 1, "host": "box", "totalRamGb": 64, "osFloorGb": 8,
    "modes": {"standalone": {"maxLocalLlmGb": 32}, "clustered": {"maxLocalLlmGb": 48}},
    "transientReserve": 0.05, "blockTokens": 16,
    "listen": {"host": "127.0.0.1", "port": 8080},
    "models": {"m": {"path": "/models/m", "context": 8192, "concurrency": 2,
                     "maxTokens": 1024}},
}

BAD_POLICIES = {
    "not JSON": ("{schemaVersion: 1", "not valid JSON"),
    "not UTF-8": (b'{"host": "\xff"}', "UTF-8"),
    "empty": ("", "not valid JSON"),
    "a list": ("[]", "JSON object"),
    "nested deep": ("[" * 100_000 + "]" * 100_000, "policy"),
    "huge integer": ('{"totalRamGb": ' + "9" * 5000 + "}", "policy"),
    "NaN": ({**VALID_POLICY, "totalRamGb": float("nan")}, "totalRamGb"),
    "Infinity budget": ({**VALID_POLICY, "totalRamGb": float("inf"),
                         "modes": {"standalone": {"maxLocalLlmGb": float("inf")},
                                   "clustered": {"maxLocalLlmGb": float("inf")}}},
                        "totalRamGb"),
    "wrong type": ({**VALID_POLICY, "totalRamGb": "64"}, "totalRamGb"),
    "unknown key": ({**VALID_POLICY, "maxLocalLLMGb": 3}, "maxLocalLLMGb"),
    "unknown model key": ({**VALID_POLICY, "models": {"m": {
        **VALID_POLICY["models"]["m"], "ctx": 5}}}, "ctx"),
    "negative budget": ({**VALID_POLICY, "modes": {"standalone": {"maxLocalLlmGb": -1},
                                                    "clustered": {"maxLocalLlmGb": 48}}},
                        "maxLocalLlmGb"),
    "budget eats the OS floor": ({**VALID_POLICY, "modes": {
        "standalone": {"maxLocalLlmGb": 60}, "clustered": {"maxLocalLlmGb": 60}}}, "OS floor"),
    "clustered below standalone": ({**VALID_POLICY, "modes": {
        "standalone": {"maxLocalLlmGb": 40}, "clustered": {"maxLocalLlmGb": 20}}}, "clustered"),
    "missing modes": ({k: v for k, v in VALID_POLICY.items() if k != "modes"}, "modes"),
    "budget that rounds to nothing": ({**VALID_POLICY, "modes": {
        "standalone": {"maxLocalLlmGb": 1e-18}, "clustered": {"maxLocalLlmGb": 48}}},
        "below 1 MiB"),
    "reserve out of range": ({**VALID_POLICY, "transientReserve": 2}, "transientReserve"),
    "port out of range": ({**VALID_POLICY, "listen": {"port": 70000}}, "port"),
    "maxTokens over context": ({**VALID_POLICY, "models": {"m": {
        "path": "/m", "context": 1024, "maxTokens": 4096}}}, "maxTokens"),
    "bad model name": ({**VALID_POLICY, "models": {"../etc": {
        "path": "/m", "context": 1024, "maxTokens": 64}}}, "models"),
    "schema version": ({**VALID_POLICY, "schemaVersion": 2}, "schemaVersion"),
}


def _write_policy(path: Path, content) -> Path:
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif isinstance(content, str):
        path.write_text(content)
    else:
        path.write_text(json.dumps(content))  # NaN/Infinity as Python writes them
    return path


@pytest.mark.pure
def test_the_valid_policy_used_below_is_valid(tmp_path):
    assert isinstance(load_policy(_write_policy(tmp_path / "p.json", VALID_POLICY)), Policy)


@pytest.mark.pure
@pytest.mark.parametrize("case", sorted(BAD_POLICIES))
def test_a_broken_policy_is_a_policy_error_and_policy_check_names_the_field(tmp_path, case):
    content, words = BAD_POLICIES[case]
    path = _write_policy(tmp_path / "policy.json", content)
    with pytest.raises(PolicyError) as err:
        load_policy(path)
    assert words in str(err.value), str(err.value)
    r = CliRunner().invoke(main, ["policy", "check", str(path)])
    assert r.exit_code == 2, r.output
    assert words in r.output
    assert isinstance(r.exception, SystemExit), r.exception


@pytest.mark.pure
def test_policy_check_on_a_missing_file_and_a_directory(tmp_path):
    for target in (tmp_path / "absent.json", tmp_path):
        r = CliRunner().invoke(main, ["policy", "check", str(target)])
        assert r.exit_code == 2 and str(target) in r.output, r.output


def test_policy_check_as_a_real_process_prints_no_traceback(tmp_path):
    path = _write_policy(tmp_path / "policy.json", BAD_POLICIES["budget eats the OS floor"][0])
    r = run_cli("policy", "check", str(path), timeout=60)
    assert r.returncode == 2 and "OS floor" in r.stderr, (r.stdout, r.stderr)
    no_traceback(r.stderr + r.stdout)


def _paths(obj, prefix=()):
    """Every (path, value) inside a JSON object, containers included."""
    yield prefix, obj
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, (*prefix, k))


POLICY_PATHS = [p for p, _v in _paths(VALID_POLICY) if p]


def _set(obj, path, value):
    if len(path) == 1:
        return {**obj, path[0]: value}
    return {**obj, path[0]: _set(obj[path[0]], path[1:], value)}


def _drop(obj, path):
    if len(path) == 1:
        return {k: v for k, v in obj.items() if k != path[0]}
    return {**obj, path[0]: _drop(obj[path[0]], path[1:])}


@pytest.mark.pure
@FUZZ
@given(edits=st.lists(st.tuples(st.sampled_from(POLICY_PATHS),
                                JSON_VALUES | st.floats() | st.just("__drop__")),
                      min_size=1, max_size=3),
       extra=st.dictionaries(st.text(min_size=1, max_size=8), JSON_SCALARS, max_size=1))
def test_any_mutated_policy_is_a_policy_or_a_policy_error_naming_a_field(edits, extra):
    """Never a TypeError, OverflowError or bare ValidationError, whatever the values."""
    data = VALID_POLICY
    for path, value in edits:
        try:
            data = _drop(data, path) if value == "__drop__" else _set(data, path, value)
        except (KeyError, TypeError, AttributeError):  # a parent was replaced: skip it
            continue
    data = {**data, **extra}
    try:
        pol = parse_policy(data, "fuzzed.json")
    except PolicyError as err:
        text = str(err)
        assert text.startswith("fuzzed.json"), text
        return
    # A policy that parses is usable: every budget is at least a MiB, every figure finite.
    for mode in ("standalone", "clustered"):
        assert pol.budget_bytes(mode) >= 1 << 20
    from plimsoll.cli.report import policy_summary

    assert "box" in policy_summary(pol, "fuzzed.json") or pol.host in policy_summary(
        pol, "fuzzed.json")


@pytest.mark.pure
@pytest.mark.parametrize("command", [["admit", "--budget-gib", "4"], ["launch", "x"],
                                     ["doctor"], ["watch-link", "--once"]])
def test_every_command_that_reads_a_policy_refuses_a_broken_one_by_name(tmp_path, command):
    path = _write_policy(tmp_path / "policy.json", BAD_POLICIES["maxTokens over context"][0])
    r = CliRunner().invoke(main, [*command, "--policy", str(path)])
    assert r.exit_code == 2, r.output
    assert "maxTokens" in r.output and str(path) in r.output, r.output
    assert isinstance(r.exception, SystemExit), r.exception


@pytest.mark.parametrize("flag", ["--budget-gib", "--total-ram-gib"])
def test_admit_with_figures_that_round_to_zero_bytes_is_a_usage_error(tiny_model, flag):
    figures = {"--budget-gib": "4", "--ceiling-mib": "8192", "--total-ram-gib": "16"}
    figures[flag] = "1e-18"
    r = CliRunner().invoke(main, ["admit", str(tiny_model), *sum(figures.items(), ())])
    assert r.exit_code == 2, r.output
    assert "got 0" in r.output and "bytes" in r.output, r.output
    assert isinstance(r.exception, SystemExit), r.exception


POSITIVE_FLOATS = st.floats(min_value=1e-30, max_value=1e300) | st.sampled_from([1e-18, 1e300])
POSITIVE_INTS = st.integers(1, 2**70) | st.integers(1, 100)


@settings(FUZZ, max_examples=60)
@given(flags=st.fixed_dictionaries({}, optional={
    "--budget-gib": POSITIVE_FLOATS, "--ceiling-mib": POSITIVE_INTS,
    "--total-ram-gib": POSITIVE_FLOATS, "--concurrency": POSITIVE_INTS,
    "--context": POSITIVE_INTS, "--max-tokens": POSITIVE_INTS, "--block-tokens": POSITIVE_INTS}))
def test_admit_with_any_positive_figures_decides_or_says_what_to_change(tiny_model, flags):
    """Admit (0), refuse (3) or a usage error (2) — never an overflow or a traceback."""
    args = [x for kv in flags.items() for x in (kv[0], str(kv[1]))]
    r = CliRunner().invoke(main, ["admit", str(tiny_model), "--json", *args])
    assert r.exit_code in (0, 2, 3), (args, r.output[-500:], r.exception)
    assert r.exception is None or isinstance(r.exception, SystemExit), (args, r.exception)


def test_serve_refuses_a_broken_policy_before_binding_anything(tmp_path):
    path = _write_policy(tmp_path / "policy.json", BAD_POLICIES["Infinity budget"][0])
    r = run_cli("serve", "--policy", str(path), "--port", "1", timeout=60)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "totalRamGb" in r.stderr, r.stderr
    no_traceback(r.stderr + r.stdout)
