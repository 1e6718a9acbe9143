"""``--model DIR|ORG/NAME`` to a local model directory; nothing is ever downloaded.

A path that exists is used as it is. ``ORG/NAME`` (a Hugging Face repository id) is looked
up in the local Hugging Face cache with ``huggingface_hub`` in offline mode
(``local_files_only``): ``HF_HUB_CACHE``, else ``HF_HOME/hub``, else
``~/.cache/huggingface/hub``, the snapshot its ``main`` ref names. A model not there is a
clear error that says where it looked and what to do.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


class ModelNotFound(ValueError):
    """The model is neither a directory nor in the local cache; the message says what to do."""


def hub_cache_dir() -> Path:
    """Where the local Hugging Face cache is, by the library's rule, read now (not at its
    import): ``HF_HUB_CACHE``, ``HF_HOME/hub``, ``$XDG_CACHE_HOME/huggingface/hub``."""
    if cache := os.environ.get("HF_HUB_CACHE"):
        return Path(cache).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface")
    return Path(home).expanduser() / "hub"


def resolve_model_dir(spec: str, flag: str = "--model") -> Path:
    """The local directory for ``spec`` (a directory, or ``ORG/NAME`` in the local cache);
    ``flag`` names the setting in the error."""
    path = Path(spec).expanduser()
    if path.is_dir():
        return path
    if not REPO_ID.match(spec):
        raise ModelNotFound(f"{flag} {spec!r}: no such directory; pass a local model "
                            "directory or a Hugging Face repository id ORG/NAME that is in "
                            "the local cache")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    cache = hub_cache_dir()
    try:
        found = Path(snapshot_download(spec, local_files_only=True, cache_dir=cache))
    except (LocalEntryNotFoundError, FileNotFoundError, OSError, ValueError):
        found = None
    if found is None or not (found / "config.json").is_file():
        raise ModelNotFound(
            f"{flag} {spec!r}: not in the local Hugging Face cache ({cache}; set "
            "HF_HUB_CACHE or HF_HOME to look elsewhere). plimsoll never downloads: fetch it "
            f"first (e.g. `hf download {spec}`), or pass its local directory")
    return found


def model_name(spec: str, model_dir: Path) -> str:
    """The name clients use: ``NAME`` of ``ORG/NAME``, else the directory's name, made a
    valid policy model name."""
    base = spec.rsplit("/", 1)[-1] if REPO_ID.match(spec) and not Path(spec).is_dir() \
        else model_dir.name
    name = re.sub(r"[^A-Za-z0-9._-]", "-", base).lstrip("._-")[:64]
    return name or "model"
