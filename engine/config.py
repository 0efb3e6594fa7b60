"""The engine's limits: pool shape, per-step token budget, batch size, runtime checks."""

from __future__ import annotations

from dataclasses import dataclass

from pagedkv.vocab.errors import InvalidArgumentError


def _check_int(name: str, value: object, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise InvalidArgumentError(f"{name} must be an int >= {minimum}, got {value!r}")


@dataclass(frozen=True)
class EngineConfig:
    """How the engine schedules and how big its KV pool is. Validated on construction.

    Attributes:
        num_blocks: KV blocks in the pool, the null block 0 included (>= 2).
        block_size: tokens per block, a power of two (the kernels address pages by shift).
        max_num_batched_tokens: the token budget of one step, prefill chunks and decodes
            together (vLLM's `max_num_batched_tokens`).
        max_num_seqs: requests running at once.
        max_model_len: the longest request, prompt and output tokens together.
        enable_prefix_caching: look waiting requests up in the prefix cache.
        runtime_checks: run the manager's and the scheduler's invariant checks after every
            N-th call (0: never); see `KVCacheManager(debug_invariants=N)`.
        prefix_cache_retention_interval: which full blocks a sliding-window group caches
            (`KVCacheConfig`'s; None: every one, 0: vLLM 0.33's engine default, only those a
            later hit can use); the KV cache config refuses what vLLM 0.33 refuses.
        reserve_full_sequence: admit a waiting request only if its whole prompt will fit
            (`allocate_slots(..., full_sequence_must_fit=True)`, a window or chunk group
            counting its admission cap under `max_num_batched_tokens` in flight): vLLM 0.33's
            `scheduler_reserve_full_isl`, on by default as there. Off, a chunked prefill is
            admitted as soon as its first chunk fits, and may be preempted half-way.
    """

    num_blocks: int
    block_size: int = 16
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 16
    max_model_len: int = 2048
    enable_prefix_caching: bool = True
    runtime_checks: int = 0
    prefix_cache_retention_interval: int | None = None
    reserve_full_sequence: bool = True

    def __post_init__(self) -> None:
        _check_int("num_blocks", self.num_blocks, 2)
        _check_int("block_size", self.block_size, 1)
        if self.block_size & (self.block_size - 1):
            raise InvalidArgumentError(
                f"block_size must be a power of two (the kernels shift by it), got "
                f"{self.block_size}"
            )
        _check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        _check_int("max_num_seqs", self.max_num_seqs, 1)
        _check_int("max_model_len", self.max_model_len, 1)
        _check_int("runtime_checks", self.runtime_checks, 0)
        if self.prefix_cache_retention_interval is not None:
            _check_int("prefix_cache_retention_interval", self.prefix_cache_retention_interval, 0)
        if not isinstance(self.reserve_full_sequence, bool):
            raise InvalidArgumentError(
                f"reserve_full_sequence must be a bool, got {self.reserve_full_sequence!r}"
            )

    @property
    def num_usable_blocks(self) -> int:
        """Blocks a request can hold: all but the null block."""
        return self.num_blocks - 1

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that `num_tokens` tokens occupy. Complexity: O(1)."""
        return -(-num_tokens // self.block_size)
