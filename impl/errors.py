"""Every exception pagedkv raises on purpose.

A failed call leaves the pool and the manager exactly as they were: each public method checks all
its preconditions before it changes anything. Spec and impl raise the same class for the same
misuse, so the differential harness compares error classes, not messages.

    PagedKVError
    ├── InvalidArgumentError      an argument outside its domain (negative count, bad ranges, ...)
    ├── NoFreeBlocksError         more blocks asked for than the free queue holds
    ├── BlockStateError           a block-level rule broken (names the block and the rule)
    │   └── FreeQueueError        a free-queue link rule broken (remove of an absent block, ...)
    ├── RequestError              a request-level rule broken (names the request and the rule)
    │   └── MaxModelLenExceededError
    ├── KVCacheConfigError        a KV cache spec or config that cannot work (memory, mismatch)
    └── InvariantViolation        check_invariants() found a broken invariant (a bug, not misuse)
"""

from __future__ import annotations


class PagedKVError(Exception):
    """Base class of every pagedkv exception."""


class InvalidArgumentError(PagedKVError, ValueError):
    """An argument is outside its domain; nothing was changed."""


class NoFreeBlocksError(PagedKVError, ValueError):
    """More blocks were asked for than are free; nothing was changed."""

    def __init__(self, num_requested: int, num_free: int, message: str = "") -> None:
        self.num_requested = num_requested
        self.num_free = num_free
        super().__init__(
            message or f"cannot get {num_requested} free blocks: only {num_free} are free"
        )


class BlockStateError(PagedKVError):
    """An operation is not allowed in the block's current state; nothing was changed.

    Attributes:
        block_id: the block the rule is about.
        rule: a short name of the broken rule (stable; tests and tools may match on it).
    """

    def __init__(self, block_id: int, rule: str, detail: str = "") -> None:
        self.block_id = block_id
        self.rule = rule
        message = f"block {block_id}: {rule}"
        super().__init__(f"{message} ({detail})" if detail else message)


class FreeQueueError(BlockStateError):
    """A free-queue operation would corrupt the linked list; nothing was changed."""


class RequestError(PagedKVError):
    """A request-level rule is broken; nothing was changed.

    Attributes:
        request_id: the request the rule is about.
        rule: a short name of the broken rule.
    """

    def __init__(self, request_id: str, rule: str, detail: str = "") -> None:
        self.request_id = request_id
        self.rule = rule
        message = f"request {request_id!r}: {rule}"
        super().__init__(f"{message} ({detail})" if detail else message)


class MaxModelLenExceededError(RequestError):
    """An allocation would take a request past max_model_len (vLLM 0.8.5 allocates fewer blocks)."""


class KVCacheConfigError(PagedKVError, ValueError):
    """A KV cache spec or configuration cannot work (not enough memory, mismatched workers, ...)."""


class InvariantViolation(PagedKVError, AssertionError):
    """`check_invariants()` found a broken invariant: a bug in pagedkv or in the code under test.

    Attributes:
        invariant: the name of the invariant, as written in the spec.
        detail: the state that breaks it.
    """

    def __init__(self, invariant: str, detail: str) -> None:
        self.invariant = invariant
        self.detail = detail
        super().__init__(f"invariant {invariant!r} violated: {detail}")
