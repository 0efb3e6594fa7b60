"""The simulated scheduler's moves, as plain replayable records.

A swarm run is a list of these operations. Each one names its request by an index into the
requests it may act on (waiting, running or alive, in arrival order, taken modulo their number)
and carries its sizes as wishes that execution clamps to what the state allows. So any
subsequence of a run still executes, which is what shrinking needs (`harness/shrink.py`): the
operations stay meaningful after earlier ones are deleted.
"""

from __future__ import annotations

from typing import NamedTuple


class Arrive(NamedTuple):
    """A request joins the waiting queue.

    `tokens` follow `share_len` tokens of earlier request `share` (-1: none), whose LoRA id,
    multimodal inputs and salt it takes when `share_keys`; else its own `lora`, `mm` (offset,
    length, content hash) and `salt`.
    """

    tokens: tuple[int, ...]
    share: int
    share_len: int
    share_keys: bool
    lora: int | None
    mm: tuple[tuple[int, int, str], ...]
    salt: str | None
    logprobs: bool


class Admit(NamedTuple):
    """Look waiting request `which` up and allocate its prefill: all of it (`chunk` 0) or at
    most `chunk` tokens, with `lookahead` slots."""

    which: int
    chunk: int
    lookahead: int


class Step(NamedTuple):
    """Running request `which`: the next prefill chunk (at most `chunk` tokens, 0: all), or a
    decode step with `drafts` speculative tokens of which `accepted` are kept; `lookahead`
    slots; `token` is sampled when every token is computed. None preempts it."""

    which: int
    chunk: int
    drafts: tuple[int, ...]
    accepted: int
    lookahead: int
    token: int


class Preempt(NamedTuple):
    """Running request `which` is freed and waits again (its hashes stay)."""

    which: int


class Finish(NamedTuple):
    """Live request `which` is freed and its hashes dropped."""

    which: int


class Reset(NamedTuple):
    """reset_prefix_cache()."""


class Stats(NamedTuple):
    """make_prefix_cache_stats()."""


class CommonPrefix(NamedTuple):
    """get_num_common_prefix_blocks of running request `which`."""

    which: int


class TakeEvents(NamedTuple):
    """take_events(): the scheduler drains both managers' KV cache event queues (runs with
    events on)."""


class Hostile(NamedTuple):
    """Hostile call `kind` (`harness/manager_hostile.py`) about live request `which`; `arg`
    picks among the call's variants."""

    kind: str
    which: int
    arg: int


ManagerOp = (
    Arrive | Admit | Step | Preempt | Finish | Reset | Stats | CommonPrefix | TakeEvents | Hostile
)
