"""``python -m plimsoll.guard enter CGROUP_DIR -- ARGV…``: join the cgroup, then exec ARGV."""

import sys

from plimsoll.guard.process import main

main(sys.argv[1:])
