"""The API process's tokenizer: the engine's own mlx-lm ``TokenizerWrapper``, without mlx.

The chat templates, the streaming detokenizers, the tool-call markers and the EOS ids the
protocol code reads all live on mlx-lm's ``TokenizerWrapper`` (``mlx_lm.tokenizer_utils``,
which itself imports only ``transformers``). Importing it the usual way runs the
``mlx_lm`` package's ``__init__``, which imports mlx (and mlx's model code) into a process
that runs no model. So the API process registers the ``mlx_lm`` package *without* running
its ``__init__`` (:func:`tokenizer_modules`: its submodules import as usual from the package
directory), and the engine process hands over the wrapper it loaded, pickled (the wrapper
made by ``mlx_lm.load``, so templates, detokenizer kind, EOS ids and tool parser are the
engine's exactly). mlx_lm is otherwise imported only at the engine edge; this module is the
named exception in ``.importlinter`` for the one part of it that imports no mlx.

Measured on the tiny demo (4,096 ids): the pickle is 147 kB; after the start, ``mlx`` is not
in the API process's ``sys.modules`` (``python/tests/worker/test_engine_process.py``).
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import pickle
import sys
import types
from pathlib import Path
from typing import Any

log = logging.getLogger("plimsoll.worker")

PACKAGE = "mlx_lm"


def tokenizer_modules() -> Any:
    """``mlx_lm.tokenizer_utils``, imported without the package's ``__init__`` where the
    package is not loaded yet (where it is, as it is)."""
    if PACKAGE not in sys.modules:
        spec = importlib.util.find_spec(PACKAGE)
        if spec is None or not spec.submodule_search_locations:
            raise ImportError(f"{PACKAGE} is not installed")
        package = types.ModuleType(PACKAGE)
        package.__path__ = list(spec.submodule_search_locations)
        package.__spec__ = spec
        package.__file__ = spec.origin
        sys.modules[PACKAGE] = package
    import mlx_lm.tokenizer_utils  # the package registered above: transformers, no mlx

    return mlx_lm.tokenizer_utils


def from_engine(pickled: bytes | None, model_dir: Path, eos_token_ids: list[int]) -> Any:
    """The engine's tokenizer in this process: unpickled, or, where the engine could not
    pickle it (a tokenizer with state pickle does not carry), loaded here from ``model_dir``
    with the engine's EOS ids."""
    utils = tokenizer_modules()
    if pickled is not None:
        return pickle.loads(pickled)  # from our own engine process, over a private socket
    log.warning("the engine's tokenizer could not be pickled; loading it from %s here",
                model_dir)
    return utils.load(Path(model_dir), eos_token_ids=eos_token_ids)


def to_api(tokenizer: Any) -> tuple[bytes | None, str]:
    """In the engine process: the tokenizer pickled, or None and why not."""
    try:
        return pickle.dumps(tokenizer, protocol=pickle.HIGHEST_PROTOCOL), ""
    except Exception as err:  # any object in a tokenizer may refuse: say which
        return None, f"{type(err).__name__}: {err}"
