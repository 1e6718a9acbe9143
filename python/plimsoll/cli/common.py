"""What every ``plimsoll`` subcommand shares: exit statuses and the bad-input error."""

from __future__ import annotations

from typing import Any

import click

EXIT_REFUSED = 3  # admission refused (admit, launch, cluster plan)
EXIT_RANK_FAILED = 4  # a cluster rank failed (cluster run)


class UsageFailure(click.ClickException):
    """Bad input: exit status 2 with a message that says what to change."""

    exit_code = 2


def invalid_figures(err: Any) -> UsageFailure:
    """A pydantic ``ValidationError`` from admission's inputs as one line per figure.

    Reached when flags or a policy pass their own checks but a derived figure does not
    (a budget of ``1e-18`` GiB is positive, yet zero bytes): say which figure and its value.
    """
    lines = [f"{'.'.join(str(p) for p in e['loc']) or 'input'}: {e['msg']} (got {e['input']!r})"
             for e in err.errors(include_url=False)]
    return UsageFailure("admission cannot use these figures: " + "; ".join(lines)
                        + ". Check the budget, ceiling and total RAM given (GiB/MiB, not bytes).")
