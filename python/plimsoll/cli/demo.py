"""``plimsoll demo-model``: build a random-weight model in the real mlx-lm layout, offline."""

from __future__ import annotations

from pathlib import Path

import click

from plimsoll.cli.common import UsageFailure


@click.command("demo-model")
@click.argument("directory", type=click.Path(file_okay=False, path_type=Path))
@click.option("--preset", type=click.Choice(["tiny", "hybrid", "qwen3-0.6b"]), default="tiny",
              show_default=True,
              help="tiny: a few M params (GQA); hybrid: linear + full attention (qwen3_next); "
                   "qwen3-0.6b: the real Qwen3-0.6B shape, for benchmarks.")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16"]), default="float32",
              show_default=True,
              help="Weight dtype. On a CPU float32 with OpenBLAS is far faster than bfloat16.")
@click.option("--seed", type=int, default=0, show_default=True, help="Random seed for weights.")
def demo_model_command(directory: Path, preset: str, dtype: str, seed: int) -> None:
    """Build a demo model in DIRECTORY (random weights, a locally trained tokenizer).

    mlx_lm.load accepts the result like any downloaded model. Nothing is downloaded.
    The build is atomic: an interrupted build leaves DIRECTORY absent.
    """
    from plimsoll.core.progress import progress
    from plimsoll.demo.model import build_demo_model

    try:
        with progress(f"demo model {preset}") as report:
            out = build_demo_model(directory, preset=preset, dtype=dtype, seed=seed,
                                   progress=report)
    except (ValueError, FileExistsError) as err:
        raise UsageFailure(str(err)) from None
    click.echo(str(out))
