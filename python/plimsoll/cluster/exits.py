"""How a rank ends: exit codes, the failure that carries one, and the JSON event lines.

Shared by the rank process (:mod:`.rank`), rank 0's ops on both stages (:mod:`.protocol`,
:mod:`.engine_stage`: :func:`lockstep`), rank 0's HTTP server (:mod:`.serve`) and the
supervisor outside (:mod:`.runner`), which reads the codes back and raises the
:class:`ClusterError` family; no mlx, so the supervisor, the CLI and the proxy import it
without the engine.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from plimsoll.cluster.plan import ClusterDecision

EXIT_OK, EXIT_INIT, EXIT_ROLLBACK, EXIT_PEER, EXIT_OTHER, EXIT_RAN_OUT = 0, 2, 3, 4, 5, 6
EXIT_NAMES = {EXIT_OK: "shut down", EXIT_INIT: "could not join the group",
              EXIT_ROLLBACK: "rolled back", EXIT_PEER: "lost a peer", EXIT_OTHER: "failed",
              EXIT_RAN_OUT: "ran out of its admitted memory"}


class RanOut(RuntimeError):
    """This rank's memory went past its admitted allocation limit (mlx's CPU limit is soft)."""


class RingFailure(RuntimeError):
    """The ring cannot go on (a peer lost, this rank ran out, an op failed half-way): the
    rank must exit with ``code`` so every peer is torn down. ``reason`` says why."""

    def __init__(self, code: int, reason: str):
        super().__init__(reason)
        self.code, self.reason = code, reason


def as_failure(rank: int, err: BaseException) -> RingFailure:
    """Any error inside a ring op leaves the ranks out of lockstep: classify it for the exit."""
    if isinstance(err, RingFailure):
        return err
    if isinstance(err, RanOut):
        return RingFailure(EXIT_RAN_OUT, f"{err}; tearing down")
    if isinstance(err, RuntimeError) and "[ring]" in str(err):
        return RingFailure(EXIT_PEER, f"rank {rank} lost a peer: {err}; tearing down")
    return RingFailure(EXIT_OTHER, f"rank {rank}: {type(err).__name__}: {err}; tearing down")


@contextlib.contextmanager
def lockstep(leader) -> Iterator[None]:
    """One op of rank 0's ``leader`` (its ``ring``, ``broken`` and ``last_op``) on every rank.

    An error inside leaves the ranks out of step: it is raised as a :class:`RingFailure`
    (:func:`as_failure`) and kept in ``leader.broken``, so every later op fails at once with
    the same reason. ``leader.last_op`` is when the op ended (the pings' clock).
    """
    if leader.broken is not None:
        raise leader.broken
    try:
        yield
    except BaseException as err:
        leader.broken = as_failure(leader.ring.rank, err)
        raise leader.broken from err
    finally:
        leader.last_op = time.monotonic()


def emit(event: str, **fields) -> None:
    sys.stdout.write(json.dumps({"event": event, **fields}) + "\n")
    sys.stdout.flush()


class ClusterError(RuntimeError):
    """A clustered load or request failed; ``reasons`` has every rank's explanation."""

    def __init__(self, message: str, reasons: dict[int, list[str]]):
        self.reasons = reasons
        detail = "\n".join(f"  rank {r}: {line}" for r in sorted(reasons) for line in reasons[r])
        super().__init__(message + ("\n" + detail if detail else ""))


class ClusterRefused(ClusterError):
    """Two-phase admission rolled back: no rank loaded anything."""

    def __init__(self, decision: ClusterDecision):
        self.decision = decision
        super().__init__(f"clustered load refused by rank(s) {decision.refusing_ranks}; "
                         "every rank rolled back", decision.reasons)


class ClusterRankFailed(ClusterError):
    """A rank died, lost its peer or stopped answering; every rank has been torn down."""
