"""What every ``plimsoll`` subcommand shares: exit statuses and the bad-input error."""

from __future__ import annotations

import click

EXIT_REFUSED = 3


class UsageFailure(click.ClickException):
    """Bad input: exit status 2 with a message that says what to change."""

    exit_code = 2
