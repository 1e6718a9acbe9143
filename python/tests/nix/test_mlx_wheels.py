"""The MLX wheels pinned in pkgs/mlx-wheels.json are what the package index serves.

The Nix package installs them on aarch64-darwin (Metal MLX) by URL and sha256; a pin that
rots would fail only on a Mac, at `darwin-rebuild switch`. Here every pinned wheel is
downloaded from its URL and checked: its sha256, its name and version, its platform tag
(macOS arm64, the Python tag it is keyed by) and its Requires-Dist (what the Nix side gives
it as dependencies). Skipped, saying so, when the index cannot be reached.
"""

from __future__ import annotations

import hashlib
import json
import zipfile
from pathlib import Path

import httpx
import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

REPO = Path(__file__).resolve().parents[3]
PINS = json.loads((REPO / "pkgs/mlx-wheels.json").read_text())
WHEELS = [(name, key, w) for name, pin in PINS.items() if not name.startswith("_")
          for key, w in pin["wheels"].items()]


@pytest.fixture(scope="module")
def client():
    first = WHEELS[0][2]["url"]
    c = httpx.Client(timeout=httpx.Timeout(30, read=120), follow_redirects=True)
    try:
        c.head(first).raise_for_status()
    except httpx.HTTPError as err:
        c.close()
        pytest.skip(f"offline: the pinned wheels' index cannot be reached ({type(err).__name__})")
    yield c
    c.close()


@pytest.mark.pure
def test_the_pins_cover_what_the_package_needs():
    assert {"mlx", "mlx-metal", "mlx-lm"} <= set(PINS)
    assert {"cp311", "cp312", "cp313", "cp314"} <= set(PINS["mlx"]["wheels"])  # python3 of nixpkgs
    # one mlx release: the extension and its Metal backend move together
    assert PINS["mlx"]["version"] == PINS["mlx-metal"]["version"]
    assert f"mlx-metal=={PINS['mlx-metal']['version']}" in PINS["mlx"]["requires"][0]


@pytest.mark.parametrize("name, key, wheel", WHEELS, ids=[f"{n}-{k}" for n, k, _ in WHEELS])
def test_pinned_wheel_matches_the_index(client, tmp_path, name, key, wheel):
    assert wheel["url"].endswith("/" + wheel["file"])
    dist, version, _build, tags = parse_wheel_filename(wheel["file"])
    assert (dist, str(version)) == (canonicalize_name(name), PINS[name]["version"])
    if name != "mlx-lm":
        assert all(t.platform.startswith("macosx_") and t.platform.endswith("_arm64") for t in tags)
    assert {t.interpreter for t in tags} == {key}

    path, digest = tmp_path / wheel["file"], hashlib.sha256()
    with client.stream("GET", wheel["url"]) as r, path.open("wb") as f:
        r.raise_for_status()
        for chunk in r.iter_bytes(1 << 20):
            digest.update(chunk)
            f.write(chunk)
    assert digest.hexdigest() == wheel["sha256"], f"{wheel['file']}: the pin's sha256 is stale"

    with zipfile.ZipFile(path) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode().splitlines()
    field = {k: v for k, _, v in (ln.partition(": ") for ln in lines if ": " in ln)}
    assert (field["Name"].lower(), field["Version"]) == (name, PINS[name]["version"])
    runtime = sorted(str(r) for r in map(Requirement, (
        ln.removeprefix("Requires-Dist: ") for ln in lines if ln.startswith("Requires-Dist: ")))
        if not (r.marker and "extra" in str(r.marker)))
    assert runtime == sorted(str(Requirement(r)) for r in PINS[name]["requires"])
