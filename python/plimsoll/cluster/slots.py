"""Per-sequence KV slots of a cluster rank's layers (imports mlx; the stage's cache).

A clustered rank runs one pipeline stage per sequence, so its full-attention KV is
one array per sequence per layer, sized once to the reservation (``prompt +
max_tokens``, whole blocks) and written in place: nothing grows, and writing past
the reservation raises :class:`CapacityError` instead. (The single-host worker's
engine is block-paged: :mod:`plimsoll.engine`.)
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import create_attention_mask


class CapacityError(RuntimeError):
    """A write would pass a sequence's reserved capacity (a caller bug: stop at max_tokens)."""


class SlotKV:
    """One sequence's K/V for one attention layer, sized once to the caller's reservation.

    Implements mlx-lm's cache protocol (``update_and_fetch``, ``offset``, ``make_mask``,
    ``state``, ``nbytes``). The arrays are created on the first write (when the head
    count, head size and dtype are known) at the full capacity.
    """

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.offset = 0

    def _alloc(self, keys: mx.array, values: mx.array) -> None:
        b, h, _, dk = keys.shape
        self.keys = mx.zeros((b, h, self.capacity, dk), keys.dtype)
        self.values = mx.zeros((b, h, self.capacity, values.shape[3]), values.dtype)

    def write(self, keys: mx.array, values: mx.array) -> None:
        n = keys.shape[2]
        if self.offset + n > self.capacity:
            raise CapacityError(f"writing {n} tokens at {self.offset} passes the reserved "
                                f"capacity of {self.capacity} tokens")
        if self.keys is None:
            self._alloc(keys, values)
        self.keys[..., self.offset:self.offset + n, :] = keys
        self.values[..., self.offset:self.offset + n, :] = values
        self.offset += n

    def fetch(self) -> tuple[mx.array, mx.array]:
        """Views of the used part (no copy)."""
        return self.keys[..., :self.offset, :], self.values[..., :self.offset, :]

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        self.write(keys, values)
        return self.fetch()

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None):
        return create_attention_mask(n, self.offset, return_array, window_size)

    @property
    def state(self):
        return self.keys, self.values, self.offset

    def size(self) -> int:
        return self.offset

    def empty(self) -> bool:
        return self.keys is None

    def is_trimmable(self) -> bool:
        return False

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes
