"""The batch scheduler's prompt cache (`moepack serve --prompt-cache-gib`): snapshots of sequences' states kept on
the host, so that a prompt starting with a snapshot's token ids is prefilled only after them.

A chat client sends the whole conversation every turn; without a cache, turn N prefills turns 1..N-1 again (a pass
over every layer's experts). runtime/batching.py stores a snapshot where a prompt's prefill ends (its states, the
logits after it, its tokens per expert) and where a sequence ends (the states after every token it was fed: the
prompt and its answer but the last token, the logits that chose that token). A newcomer whose ids START WITH an
entry's ids (the longest such entry, of at least `min_tokens`) continues a copy of it, as a continued KV directory
does (generate --continue-from): only the rest is prefilled, and where nothing is left its first token comes from the
entry's logits. Exact prefixes only: a state cannot be cut back to an earlier position (DeepSeek-V4's compressed
KV), so an entry serves a prompt only whole.

Each entry holds its own float32 host copy (kv_directory.host_copy, through the KV format's tensors), and every hit
gets a fresh copy of it: a prefill or a decode continues states in place. Entries are kept least recently used first
within `budget_bytes` (each sized by its tensors' bytes); the Generator's memory checks count what the cache holds
(Generator._held), and the scheduler evicts entries, least recently used first (a newcomer's own, the one its
prompt continues, last), rather than refuse a generation that would fit without them.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import NamedTuple

import torch

from moepack.families import kv_directory as kvd
from moepack.format_spec.errors import MoepackError

from .io import available_memory_bytes, release_freed_memory
from .limits import MIN_CACHED_TOKENS
from .memory import GIB, HEADROOM_BYTES


@dataclass(eq=False)
class _Entry:
    ids: tuple[int, ...]
    states: list  # each layer's state after `ids`, float32 on the host: never handed out, only copies of it
    logits: torch.Tensor  # after the last of `ids` (float32, host)
    counts: list[list[int]] | None  # tokens per expert of each layer over the prompt (None: not known)
    nbytes: int


class Reuse(NamedTuple):
    """What a hit hands a newcomer: how many of its prompt's tokens it skips, a fresh copy of the entry's states
    (its own to continue), the logits after them and the tokens per expert over them (None: not known)."""
    tokens: int
    states: list
    logits: torch.Tensor
    counts: list[list[int]] | None


class PromptCache:
    """Snapshots of sequences' states keyed by the token ids they hold (the module's docstring). Used by one
    scheduler's worker thread; `nbytes` and the counters may be read from any thread."""

    def __init__(self, kv_format, config, budget_bytes: int, min_tokens: int = MIN_CACHED_TOKENS):
        if budget_bytes < 0:
            raise MoepackError(_NEGATIVE.format(budget_bytes / GIB))
        self.kv_format, self.config, self.budget, self.min_tokens = kv_format, config, budget_bytes, min_tokens
        self._entries: OrderedDict[tuple[int, ...], _Entry] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()
        self.nbytes = 0
        self.hits = 0  # prompts that continued an entry
        self.tokens_reused = 0  # prompt tokens those hits did not prefill
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._entries)

    def _longest(self, ids: tuple[int, ...]) -> _Entry | None:
        """The longest entry whose ids begin `ids` (None: none)."""
        best = None
        for key, entry in self._entries.items():
            if len(key) <= len(ids) and (best is None or len(key) > len(best.ids)) and ids[:len(key)] == key:
                best = entry
        return best

    def keep_for(self, ids: list[int]) -> None:
        """The entry a prompt of `ids` would continue (lookup's) made the most recently used, without a hit: the
        memory check of that very prompt, evicting least recently used first, then takes it last."""
        best = self._longest(tuple(ids))
        if best is not None:
            with self._lock:
                self._entries.move_to_end(best.ids)

    def lookup(self, ids: list[int]) -> Reuse | None:
        """The longest entry whose ids begin `ids`, as a copy of its own (None: none)."""
        best = self._longest(tuple(ids))
        if best is None:
            return None
        with self._lock:
            self._entries.move_to_end(best.ids)
            self.hits += 1
            self.tokens_reused += len(best.ids)
        states = kvd.copied_states(self.kv_format, self.config, best.states)
        counts = None if best.counts is None else [list(c) for c in best.counts]
        return Reuse(len(best.ids), states, best.logits.clone(), counts)

    def store(self, ids: list[int], states: list, logits: torch.Tensor, counts: list[list[int]] | None) -> bool:
        """A snapshot of `states` (after `ids`; left as they are) kept, unless too short, already there (then only
        refreshed), larger than the budget, or more than the host has free beside the headroom. True if kept."""
        key = tuple(ids)
        if self.budget == 0 or len(key) < self.min_tokens:
            return False
        if key in self._entries:
            with self._lock:
                self._entries.move_to_end(key)
            return False
        need = self.kv_format.kv_bytes(self.config, len(key), "F32")  # (the copy's size, before making it)
        free = available_memory_bytes()
        if need > self.budget or free and need + HEADROOM_BYTES > free:
            return False
        copy, nbytes = kvd.host_copy(self.kv_format, self.config, states)
        nbytes += logits.numel() * 4
        if nbytes > self.budget:  # (a format's working state beside its KV)
            return False
        with self._lock:
            while self._entries and self.nbytes + nbytes > self.budget:
                self._drop_oldest()
            self._entries[key] = _Entry(key, copy, logits.detach().to("cpu", torch.float32, copy=True),
                                        None if counts is None else [list(c) for c in counts], nbytes)
            self.nbytes += nbytes
        return True

    def evict_oldest(self) -> bool:
        """The least recently used entry dropped (memory wanted for a generation), its memory given back to the
        system; True if there was one."""
        with self._lock:
            if not self._entries:
                return False
            self._drop_oldest()
        release_freed_memory()
        return True

    def clear(self) -> bool:
        """Every entry dropped (memory wanted for a generation), their memory given back to the system; True if
        there were any."""
        with self._lock:
            had = bool(self._entries)
            while self._entries:
                self._drop_oldest()
        if had:
            release_freed_memory()  # (where malloc keeps what is freed: the checks read the system's figure)
        return had

    def _drop_oldest(self) -> None:
        _, entry = self._entries.popitem(last=False)
        self.nbytes -= entry.nbytes
        self.evicted += 1


_NEGATIVE = "--prompt-cache-gib must be >= 0 (0: no prompt cache), got {:g}"


def prompt_cache_bytes(gib: float) -> int:
    """`--prompt-cache-gib` in bytes (refused below 0, NaN too)."""
    if not gib >= 0:
        raise MoepackError(_NEGATIVE.format(gib))
    return int(gib * GIB)
