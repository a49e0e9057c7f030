"""Splitting an ordered list of tensors into files of bounded size (checkpoint shards, GGUF splits)."""

from __future__ import annotations

from typing import Callable, Sequence, TypeVar

T = TypeVar("T")


def greedy_shards(items: Sequence[T], size: Callable[[T], int], limit: int) -> list[list[T]]:
    """Items in order, a new shard whenever the next would take the current one past `limit` bytes; an item over
    the limit gets a shard of its own. Never an empty shard (one empty list for no items)."""
    shards: list[list[T]] = [[]]
    used = 0
    for item in items:
        n = size(item)
        if shards[-1] and used + n > limit:
            shards.append([])
            used = 0
        shards[-1].append(item)
        used += n
    return shards
