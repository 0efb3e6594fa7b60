"""The simulated scheduler's moves, as plain replayable records.

Every driver of the manager client (the swarm, the hypothesis machines, the exhaustive search)
makes these operations and has `ManagerClient.execute` run them. Each one names its request by
an index into the requests it may act on (waiting, running or alive, in arrival order, taken
modulo their number) and carries its sizes as wishes that execution clamps to what the state
allows. So any subsequence of a run still executes, which is what shrinking needs
(`harness/swarm/shrink.py`): the operations stay meaningful after earlier ones are deleted.
"""

from __future__ import annotations

from typing import NamedTuple


class Arrive(NamedTuple):
    """A request joins the waiting queue.

    `tokens` follow `share_len` tokens of earlier request `share` (-1: none), whose LoRA id,
    multimodal inputs and salt it takes when `share_keys`; else its own `lora`, `mm` (offset,
    length, content hash) and `salt`. `request_id` names it (None: the client numbers it,
    "req-1", "req-2", ...; the exhaustive search reuses a slot's name so its states stay few).
    """

    tokens: tuple[int, ...]
    share: int
    share_len: int
    share_keys: bool
    lora: int | None
    mm: tuple[tuple[int, int, str], ...]
    salt: str | None
    logprobs: bool
    request_id: str | None = None


class Admit(NamedTuple):
    """Look waiting request `which` up and allocate its prefill: all of it (`chunk` 0) or at
    most `chunk` tokens, with `lookahead` slots; `token` is sampled if that computes every
    token. In a run with a KV connector, at most `external` tokens past the hit are external
    (a connector loads them), loaded asynchronously when `load_async` (the prefill then waits
    for the load: the request's next step lands it); with a CPU offload tier behind the
    connector, `external` > 0 asks the tier, whose hit is the external tokens. `fail_at` >= 0:
    a sync load that fails from its `fail_at`-th block on, reported with the step's output
    (vLLM 0.33's "fail" policy: its blocks from there are evicted and the request finishes
    with an error)."""

    which: int
    chunk: int
    lookahead: int
    token: int = 0
    external: int = 0
    load_async: bool = False
    fail_at: int = -1
    unaligned: bool = False
    """Misuse (a run with a Mamba group in mode "align"): the chunk is not cut as vLLM's
    scheduler cuts it (`mamba_chunk`), so that a step crossing a Mamba block from inside it is
    sent, and refused alike."""


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
    fail_at: int = -1
    """A request whose async load lands at this step: -1 it lands whole; k >= 0 it fails from
    its k-th loaded block on (vLLM 0.33's "recompute" policy)."""
    release_twice: bool = False
    """Misuse (a run with deferred frees): the first batch the step releases is released again,
    and both managers must refuse it alike, changing nothing."""
    store: int = 0
    """A run with a CPU offload tier: what the store jobs in flight do at this step (taken
    modulo 3): 0 they complete, 1 the oldest fails and the others complete, 2 they stay
    pending."""
    unaligned: bool = False
    """Misuse, as `Admit.unaligned`."""


class NewStep(NamedTuple):
    """A new scheduler step starts: `new_step_starts()` on both managers (a run with a Mamba
    group in mode "align"; vLLM 0.33's scheduler calls it first in every step). The calls
    between two of these share a step: a lookup hitting a state keyed since the last one is
    refused for now."""


class Preempt(NamedTuple):
    """Running request `which` is freed and waits again (its hashes stay); `deferred` (a run
    with deferred frees): a step still in flight may read its blocks, so they are popped and
    released at the next step (vLLM 0.33's `pop_blocks_for_free`)."""

    which: int
    deferred: bool = False


class Finish(NamedTuple):
    """Live request `which` is freed and its hashes dropped; with `delay_free` (a run with a
    KV connector) a connector still sends its KV, so the free waits until the send finishes
    (at the next step); `deferred` as `Preempt`'s."""

    which: int
    delay_free: bool = False
    deferred: bool = False


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


class Evict(NamedTuple):
    """evict_blocks(), as a KV connector calls it for blocks whose load failed. `kind` picks
    what (taken modulo 4): 0, one cached block of running request `which` (with `arg` odd, one
    other requests share, if it holds one; `arg // 2` modulo the candidates picks which); 1,
    its cached blocks in every group from such a block's position on (a load that failed
    part-way); 2, a cached block in the free queue (the `arg`-th, modulo their number); 3, a
    block without a hash (the `arg`-th block id, the null block among them)."""

    which: int
    kind: int
    arg: int


class Hostile(NamedTuple):
    """Hostile call `kind` (`harness/client/hostile.py`) about live request `which`; `arg`
    picks among the call's variants."""

    kind: str
    which: int
    arg: int


ManagerOp = (
    Arrive
    | Admit
    | Step
    | NewStep
    | Preempt
    | Finish
    | Reset
    | Stats
    | CommonPrefix
    | TakeEvents
    | Evict
    | Hostile
)
