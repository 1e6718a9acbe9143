"""plimsoll: a serving stack for MLX models that never loads the host past its memory line."""

__version__ = "0.1.0"
