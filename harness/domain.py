"""The part of the call space a campaign draws from: everything, unless an implementation is
known to differ from the spec outside it for reasons documented in docs/semantics.md."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

MultimodalInputs = tuple[tuple[int, int, str], ...]
"""Multimodal inputs as (offset, length, content hash), sorted and disjoint."""

MAX_GROUPS = 4
"""The most KV cache groups the clients draw a configuration with (Gemma-3 and gpt-oss have
two, Llama-4 two; four leaves room for every mix of the three attention types)."""


RETENTION_DRAW = (None, 0, 1, 2, 4)
"""The prefix-cache retention intervals a run with a sliding-window group draws from when the
domain leaves it free: dense (None), sparse (0), or one tail per segment of 1, 2 or 4 blocks
(a positive entry of `Domain.retention_intervals` is in tokens; these are in blocks)."""


@dataclass(frozen=True)
class Domain:
    """Restrictions on what a client sends; the defaults restrict nothing but retention (dense
    only, so that an implementation whose adapter predates it is not handed a sparse config):
    `FULL_DOMAIN` restricts nothing.

    Configurations outside the domain are never drawn (`harness/swarm/runs.py`,
    `harness/machines/`), and the client never sends a request outside it
    (`harness/client/manager.py`).

    Attributes:
        min_window: the narrowest sliding window (tokens).
        min_window_over_block: a window is at least `block_size` plus this many tokens (vLLM
            0.8.5 asserts when the window skips the parent of the next block to cache).
        eagle_with_sliding_window: whether a sliding-window manager may run with `use_eagle`.
        multimodal: whether requests carry multimodal inputs.
        cache_salts: whether requests carry cache salts (vLLM 0.8.5 has none).
        listed_blocks_freed: whether the pool client may free a block a request's block list
            still holds, so that its next `cache_full_blocks` chains to a block that another
            request may have reused (a manager never does: vLLM 0.33 chains to the request's
            own hashes then).
        max_groups: the most KV cache groups a configuration has (1: single-group managers
            only; more: configurations of several groups too, in the hybrid layer).
        eagle_with_hybrid: whether a configuration of several groups may run with `use_eagle`.
        one_length_per_mm_hash: whether a multimodal content hash always comes with one length
            (vLLM's identifiers name one input, so its length: vLLM 0.33 keys an input without
            it); the clients then name each drawn input by its hash and length.
        retention_intervals: the `prefix_cache_retention_interval`s a configuration with a
            sliding-window group draws from (None: any of `RETENTION_DRAW`): None, 0, or a
            number of tokens, rounded up to a positive multiple of the run's block size.
            Configurations without a sliding-window group stay dense.
        group_plan: how an engine groups one layer per drawn spec, as the specs of its groups
            in its order (None: as drawn); the hybrid configurations are drawn through it.
    """

    min_window: int = 1
    min_window_over_block: int = 0
    eagle_with_sliding_window: bool = True
    multimodal: bool = True
    cache_salts: bool = True
    listed_blocks_freed: bool = True
    max_groups: int = MAX_GROUPS
    eagle_with_hybrid: bool = True
    one_length_per_mm_hash: bool = False
    retention_intervals: tuple[int | None, ...] | None = (None,)
    group_plan: Callable[[list[Any]], list[Any]] | None = field(default=None, compare=False)

    @property
    def draws_sparse_retention(self) -> bool:
        """Whether a configuration with a sliding-window group may draw a retention interval
        other than dense."""
        intervals = self.retention_intervals
        return intervals is None or any(interval is not None for interval in intervals)

    def plan_groups(self, specs: list[Any]) -> list[Any]:
        """The specs of the groups an engine makes of one layer per spec in `specs`."""
        return specs if self.group_plan is None else self.group_plan(specs)

    def retention(self, rng: random.Random, block_size: int) -> int | None:
        """A retention interval the domain allows, for a run of `block_size` with a
        sliding-window group (the last draw of its seed)."""
        if self.retention_intervals is None:
            blocks = rng.choice(RETENTION_DRAW)
            return None if blocks is None else blocks * block_size
        drawn = rng.choice(self.retention_intervals)
        if not drawn:
            return drawn
        return max(-(-drawn // block_size), 1) * block_size

    def multimodal_inputs(self, drawn: MultimodalInputs) -> MultimodalInputs:
        """Drawn multimodal inputs as the domain allows them: with `one_length_per_mm_hash`,
        each named by its hash and its length."""
        if not self.one_length_per_mm_hash:
            return drawn
        return tuple((offset, length, f"{mm_hash}/{length}") for offset, length, mm_hash in drawn)

    def window(self, drawn: int, block_size: int) -> int:
        """The narrowest window the domain allows at or above `drawn`."""
        if self.min_window_over_block:
            drawn = max(drawn, block_size + self.min_window_over_block)
        return max(drawn, self.min_window)

    def describe(self) -> str:
        """The restrictions in words, or "" for the full domain."""
        parts = []
        if self.min_window > 1:
            parts.append(f"windows of {self.min_window}+ tokens")
        if self.min_window_over_block:
            parts.append(f"windows of block size + {self.min_window_over_block}+ tokens")
        if not self.eagle_with_sliding_window:
            parts.append("no eagle with a sliding window")
        if not self.multimodal:
            parts.append("no multimodal inputs")
        if not self.cache_salts:
            parts.append("no cache salts")
        if not self.listed_blocks_freed:
            parts.append("no block freed while a request lists it")
        if self.max_groups == 1:
            parts.append("one KV cache group")
        elif self.max_groups < MAX_GROUPS:
            parts.append(f"at most {self.max_groups} KV cache groups")
        if self.max_groups > 1 and not self.eagle_with_hybrid:
            parts.append("no eagle with several groups")
        if self.multimodal and self.one_length_per_mm_hash:
            parts.append("one length per multimodal hash")
        if self.retention_intervals is not None:
            named = ", ".join("dense" if i is None else str(i) for i in self.retention_intervals)
            parts.append(f"retention intervals {named}")
        if self.group_plan is not None:
            parts.append("groups as the engine's planning makes them")
        return ", ".join(parts)


FULL_DOMAIN = Domain(retention_intervals=None)
