"""What a failed comparison is: a `Divergence` and its signature.

A divergence says what kind of difference was found, in which operation, breaking which rule;
that triple (its signature) is what a shrinker holds fixed, so that a shorter run must fail the
same way.
"""

from __future__ import annotations

from pagedkv.vocab.errors import InvariantViolation

Signature = tuple[str, str, str]
"""What a failure is: (kind, operation, rule) — e.g. ("result", "allocate_slots", ""),
("invariant", "free", "ref_cnt >= 0"), ("state", "step", "pool.free_order")."""


class Divergence(AssertionError):
    """The object under test and the spec disagree (or the object under test broke).

    Attributes:
        kind: "result", "error class", "message", "atomicity", "state", "digest",
            "invariant" (the object under test's own check failed), "observation" (its
            snapshot or check raised), "request" (a Request differs from what the client sent)
            or "semantics" (its default semantics differ from the spec's).
        operation: the call it happened in or after ("allocate_slots"; "step" for a check
            between calls).
        rule: what exactly differs: an error class, an invariant's name, a field's name.
    """

    def __init__(self, message: str, kind: str, operation: str = "", rule: str = "") -> None:
        super().__init__(message)
        self.kind = kind
        self.operation = operation
        self.rule = rule

    @property
    def signature(self) -> Signature:
        return (self.kind, self.operation, self.rule)


def signature_of(error: BaseException) -> Signature:
    """A failure's signature: a divergence's own; for the spec breaking an invariant, ("spec
    invariant", "", its name); for anything else, ("harness error", "", its class)."""
    if isinstance(error, Divergence):
        return error.signature
    if isinstance(error, InvariantViolation):
        return ("spec invariant", "", error.invariant)
    return ("harness error", "", type(error).__name__)


def operation_of(label: str) -> str:
    """The operation a call's label names: "allocate_slots(req-1, 3)" -> "allocate_slots"."""
    return label.partition("(")[0].strip()
