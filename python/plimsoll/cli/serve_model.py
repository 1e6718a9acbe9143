"""The policy ``plimsoll serve`` runs: ``--policy``, ``--model`` and the sizing options.

Kept apart from :mod:`.serve` (which owns the command and its other options):

- no ``--policy``, no ``--model``: the embedded demo model and a policy from this machine's
  live figures (:func:`plimsoll.launch.defaults.default_policy`);
- ``--model DIR|ORG/NAME``: that model instead of the demo (resolved locally,
  :mod:`plimsoll.launch.model_source`), sized the same way;
- ``--policy`` with ``--model``: the model is added to the policy's models (a model of the
  same name is replaced) and becomes its default model;
- ``--context`` / ``--concurrency`` / ``--max-tokens`` override the sizing of the model
  being added (the demo's when there is no ``--model`` and no ``--policy``), and
  ``--prompt-lookup`` / ``--draft-model`` its speculation (the entry's ``promptLookup`` /
  ``draftModel``).
"""

from __future__ import annotations

from pathlib import Path

from plimsoll.cli.common import UsageFailure


def served_policy(policy_file: Path | None, model_spec: str | None, context: int | None,
                  concurrency: int | None, max_tokens: int | None,
                  prompt_lookup: int | None = None, draft_model: str | None = None,
                  no_mtp: bool = False):
    """The policy to serve, or a usage error that says what to change."""
    from plimsoll.core.model_facts import ModelInspectionError
    from plimsoll.core.paths import cache_dir
    from plimsoll.core.policy import PolicyError, load_policy, parse_policy
    from plimsoll.launch.defaults import DEFAULT_MODEL_NAME, default_policy
    from plimsoll.launch.model_source import ModelNotFound, model_name, resolve_model_dir
    from plimsoll.launch.serve_sizing import model_entry
    from plimsoll.probes import read_snapshot

    sizing = (context, concurrency, max_tokens, prompt_lookup, draft_model, no_mtp or None)
    if policy_file is not None and model_spec is None and any(v is not None for v in sizing):
        raise UsageFailure("--context, --concurrency, --max-tokens, --prompt-lookup, "
                           "--draft-model and --no-mtp set the model of --model (or the "
                           "demo); with --policy, set them in its models")
    speculation = {"promptLookup": prompt_lookup} if prompt_lookup else {}
    try:
        if draft_model is not None:  # resolved once, as --model is
            draft_model = str(resolve_model_dir(draft_model, "--draft-model"))
        if model_spec is not None:
            model_dir = resolve_model_dir(model_spec)
            name = model_name(model_spec, model_dir)
        elif policy_file is None:
            model_dir, name = _demo_dir(), DEFAULT_MODEL_NAME
        snap = read_snapshot()
        if policy_file is None:
            entry = model_entry(model_dir, context=context, concurrency=concurrency,
                                max_tokens=max_tokens, snapshot=snap,
                                draft_model=draft_model, mtp=not no_mtp) | speculation
            # the embedded demo gets a bounded disk tier under the user cache: its
            # prefixes survive idle unloads and restarts
            disk = cache_dir() / "kv-blocks" if model_spec is None else None
            return default_policy(snap, model_dir, name=name, entry=entry,
                                  disk_cache_dir=disk)
        pol = load_policy(policy_file)
        if model_spec is None:
            return pol
        entry = model_entry(model_dir, context=context, concurrency=concurrency,
                            max_tokens=max_tokens, snapshot=snap,
                            draft_model=draft_model, mtp=not no_mtp) | speculation
        data = pol.model_dump(mode="json", by_alias=True, exclude_defaults=True)
        data.setdefault("models", {})[name] = entry
        data["defaultModel"] = name
        return parse_policy(data, f"{policy_file} with --model {model_spec}")
    except (ModelNotFound, ModelInspectionError, PolicyError) as err:
        raise UsageFailure(str(err)) from None


def _demo_dir() -> Path:
    """The demo model (built once, with progress)."""
    from plimsoll.core.progress import progress
    from plimsoll.launch.defaults import ensure_demo_model

    with progress("Preparing the demo model") as report:
        return ensure_demo_model(report=report)
