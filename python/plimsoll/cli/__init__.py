"""The ``plimsoll`` command line: the click group and one module per command family.

Owns: :mod:`.main` (the group, its lazy subcommand table and ``plimsoll policy``),
:mod:`.common` (exit statuses, the bad-input error), :mod:`.report` (the text of admission
reports), :mod:`.check` (``--check`` for the long-running commands), and one module per
command family (:mod:`.admit`, :mod:`.worker`, :mod:`.serve`,
:mod:`.cluster`, :mod:`.watch`, :mod:`.doctor`, :mod:`.reliability`, :mod:`.demo`).

May import: everything (the top layer); mlx only through the packages that own it, lazily.
"""

from plimsoll.cli.main import main

__all__ = ["main"]
