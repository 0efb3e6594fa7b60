"""Every exception pagedkv raises on purpose.

A failed call leaves the pool and the manager exactly as they were: each public method checks all
its preconditions, argument types included, before it changes anything. Spec and impl raise the
same class for the same misuse; the differential harness compares classes for any
implementation, and for pagedkv's own the messages too, word for word.

    PagedKVError
    ├── InvalidArgumentError      an argument outside its domain (negative count, bad ranges, ...)
    │   └── ArgumentTypeError     an argument of the wrong type (a float, bool or None for an int)
    ├── NoFreeBlocksError         more blocks asked for than the free queue holds
    ├── BlockStateError           a block-level rule broken (names the block and the rule)
    │   └── FreeQueueError        a free-queue rule broken (a foreign or absent block, ...)
    ├── RequestError              a request-level rule broken (names the request and the rule)
    │   ├── MaxModelLenExceededError
    │   └── FrozenRequestFieldError   a change to a request's identity (id, prompt, keys, salt)
    ├── OffloadChunkError         a CPU offload tier rule broken (names the key and the rule)
    ├── ConcurrentUseError        a call overlapped another call on the same object
    ├── KVCacheConfigError        a KV cache spec or config that cannot work (memory, mismatch)
    └── InvariantViolation        check_invariants() found a broken invariant (a bug, not misuse)

Each of them is also the built-in exception a Python caller would expect (ValueError,
TypeError, AttributeError, RuntimeError, AssertionError), so existing handlers keep working.
"""

from __future__ import annotations


class PagedKVError(Exception):
    """Base class of every pagedkv exception."""


class InvalidArgumentError(PagedKVError, ValueError):
    """An argument is outside its domain; nothing was changed.

    Raised by an argument check (`pagedkv.vocab.arguments`), it also says where and why:

    Attributes:
        call: the call that refused the argument, e.g. "KVCacheManager.allocate_slots".
        argument: the argument, e.g. "num_tokens" or "request.num_computed_tokens".
        rule: what the argument must be, e.g. "an int >= 1".
    """

    def __init__(self, message: str, *, call: str = "", argument: str = "", rule: str = "") -> None:
        self.call = call
        self.argument = argument
        self.rule = rule
        super().__init__(message)


class ArgumentTypeError(InvalidArgumentError, TypeError):
    """An argument has the wrong type (a bool, float, NaN, None or str where an int is due, ...);
    nothing was changed."""


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


class FrozenRequestFieldError(RequestError, AttributeError):
    """An assignment to a field of a request's identity (its id, prompt, multimodal inputs, LoRA
    id or cache salt), which is fixed at construction; nothing was changed."""


class OffloadChunkError(PagedKVError):
    """A CPU offload tier call is not allowed in a chunk's current state; nothing was changed.

    Attributes:
        key: the offload key (block hash + group index) the rule is about.
        rule: a short name of the broken rule (stable; tests and tools may match on it).
    """

    def __init__(self, key: bytes, rule: str, detail: str = "") -> None:
        self.key = key
        self.rule = rule
        message = f"offload key {key.hex()}: {rule}"
        super().__init__(f"{message} ({detail})" if detail else message)


class ConcurrentUseError(PagedKVError, RuntimeError):
    """A call started while another call on the same manager or pool was running (another thread,
    or a callback re-entering it); it was refused before changing anything, and the running call
    goes on undisturbed. Share a manager between threads only under a lock of your own.

    Attributes:
        call: the refused call, e.g. "KVCacheManager.allocate_slots".
    """

    def __init__(self, call: str) -> None:
        self.call = call
        super().__init__(
            f"{call}: refused, another call on the same object is running (pagedkv managers and "
            f"pools are not thread-safe: serialize calls with a lock of your own)"
        )


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
