"""The part of the call space a campaign draws from: everything, unless an implementation is
known to differ from the spec outside it for reasons documented in docs/semantics.md."""

from __future__ import annotations

from dataclasses import dataclass

MultimodalInputs = tuple[tuple[int, int, str], ...]
"""Multimodal inputs as (offset, length, content hash), sorted and disjoint."""

MAX_GROUPS = 4
"""The most KV cache groups the clients draw a configuration with (Gemma-3 and gpt-oss have
two, Llama-4 two; four leaves room for every mix of the three attention types)."""


@dataclass(frozen=True)
class Domain:
    """Restrictions on what a client sends; the defaults restrict nothing.

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
        return ", ".join(parts)


FULL_DOMAIN = Domain()
