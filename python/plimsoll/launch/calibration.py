"""Calibration records: their key, their file, and what admission reads from them.

``plimsoll calibrate`` (:mod:`plimsoll.reliability.calibrate`) measures a real run and saves
a :class:`Measurement` here; admission at launch (:mod:`.live_admission`) looks the record
up and takes ``transient_reserve = max(policy fraction, measured_reserve / budget)``.

Records live in ``cache_dir()/calibration/<key>.json``; the key is the weights hash
(SHA-256 of the safetensors *headers*: fast, and it changes with any tensor's name, shape,
dtype or offset), the engine version (mlx + mlx-lm) and the KV dtype.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from plimsoll.core.model_facts import ModelFacts
from plimsoll.core.paths import cache_dir, private_dir
from plimsoll.core.weights_key import engine_version, weights_hash


# --- the key ------------------------------------------------------------------------------
def calibration_key(model_dir: Path, kv_dtype: str) -> str:
    raw = f"{weights_hash(model_dir)}|{engine_version()}|{kv_dtype}"
    return hashlib.sha256(raw.encode()).hexdigest()[:32]


def calibration_path(key: str, root: Path | None = None) -> Path:
    return (root or cache_dir()) / "calibration" / f"{key}.json"


# --- the record ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Measurement:
    """One calibration run; every figure in bytes unless named otherwise."""

    concurrency: int
    context: int
    prompt_tokens: int
    max_tokens: int
    weights_bytes: int
    kv_bytes_peak: int
    mlx_peak_bytes: int
    rss_hwm_bytes: int
    cgroup_max_usage_bytes: int | None
    peak_bytes: int
    reserve_bytes: int
    formula_footprint_bytes: int
    requests_ok: int
    seconds: float
    at: str

    @staticmethod
    def derive(weights: int, kv_peak: int, mlx_peak: int, rss_hwm: int,
               cgroup_peak: int | None) -> tuple[int, int]:
        """(peak, reserve): the largest observed figure; all of it above the weights and the
        KV actually held is unknown, so reserve."""
        peak = max(mlx_peak, rss_hwm, cgroup_peak or 0)
        return peak, max(0, peak - weights - kv_peak)


def load_records(key: str, root: Path | None = None) -> list[dict]:
    path = calibration_path(key, root)
    if not path.is_file():
        return []
    return json.loads(path.read_text()).get("runs", [])


def save_measurement(key: str, facts: ModelFacts, model_dir: Path, m: Measurement,
                     root: Path | None = None) -> Path:
    path = calibration_path(key, root)
    private_dir(path.parent, "calibration records")
    runs = [r for r in load_records(key, root)
            if (r["concurrency"], r["context"]) != (m.concurrency, m.context)]
    doc = {"key": key, "model_dir": str(model_dir), "weights_hash": weights_hash(model_dir),
           "engine": engine_version(), "kv_dtype": facts.kv_format,
           "runs": sorted([*runs, asdict(m)], key=lambda r: (r["concurrency"], r["context"]))}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=2) + "\n")
    tmp.replace(path)
    return path


@dataclass(frozen=True)
class Calibration:
    """What admission needs from the records: the measured unknown, as reserve bytes."""

    reserve_bytes: int
    peak_bytes: int
    covers: bool  # a run at ≥ the wanted concurrency and context exists
    runs: int
    path: str


def lookup(model_dir: Path, kv_dtype: str, concurrency: int, context: int,
           root: Path | None = None) -> Calibration | None:
    """The measured reserve for this model/engine/dtype, or None if never calibrated.

    Runs at or above the wanted concurrency and context are preferred; if none covers it,
    the largest reserve recorded is used (and ``covers`` says it is an extrapolation).
    """
    try:
        key = calibration_key(model_dir, kv_dtype)
    except (OSError, ValueError):
        return None
    runs = load_records(key, root)
    if not runs:
        return None
    covering = [r for r in runs if r["concurrency"] >= concurrency and r["context"] >= context]
    pick = min(covering, key=lambda r: r["reserve_bytes"]) if covering else \
        max(runs, key=lambda r: r["reserve_bytes"])
    return Calibration(pick["reserve_bytes"], pick["peak_bytes"], bool(covering), len(runs),
                       str(calibration_path(key, root)))


def reserve_fraction(policy_fraction: float, calibration: Calibration | None,
                     budget_bytes: int) -> float:
    """The transient reserve admission uses: the larger of policy and measurement."""
    if calibration is None:
        return policy_fraction
    return min(1.0, max(policy_fraction, calibration.reserve_bytes / budget_bytes))
