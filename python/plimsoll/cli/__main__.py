"""``python -m plimsoll.cli``: the same command line as the ``plimsoll`` script."""

import sys

from plimsoll.cli.main import main

sys.exit(main())
