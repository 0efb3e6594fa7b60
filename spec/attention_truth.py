"""The attention-truth invariant: every position a request reads holds that request's own KV.

The spec's other invariants compare the managers' bookkeeping with itself; this one compares
their decisions with what the model computes. It reads the ghost content of the blocks
(`pagedkv.spec.ghost_kv`) and each attention type's statement of which earlier positions a token
attends to (`first_read`: all of them for full attention, the last W - 1 for a sliding window of
W, those of its own chunk for chunked local attention), and demands, in every KV cache group:

- **a hit is true**: a hit of N tokens holds, at every position the token at N reads, that
  request's own KV (never the null block, never another prefix's or tenant's KV, never KV of a
  block reused since);
- **a step reads true KV**: when `allocate_slots` schedules tokens from position s on, every
  position before s that they read is held by the request's block table with its own KV;
- **a running request's table stays true**: at every check, every position the request's next
  token reads (`num_computed_tokens` on) holds its own KV;
- **a block is reused only after every transfer using it finished**: a KV connector's async load
  writes the request's blocks until it lands (`cache_blocks`), fails (`external_load_failed`)
  or is reported finished (`external_load_finished`); a send reads them from the caller's
  report (`external_send_started`) until `external_send_finished`; a block the request freed
  meanwhile is never handed out again before that (vLLM #32255: an abort freed blocks a load
  still filled).

- **a Mamba state is read only once written** (a group whose blocks hold recurrent states,
  `holds_state`: Mamba in mode "align"): a step computing tokens up to e writes the state
  after e into its running column, replacing what the block held (`GhostKV.write_state`);
  the state after s tokens is read, by a hit of s or a step starting at s, from column
  `(s - 1) // B`, which must hold exactly it; and a state written in this scheduler step
  (since the last `new_step`) is read by no other request before the step ends: its forward
  pass has not run.

- **KV computed before a reset is never read after it**: a successful `reset_prefix_cache`
  stands for new weights (`GhostKV.new_epoch`); a read of KV of an older epoch (a CPU offload
  tier that kept serving its chunks: vLLM #57727) is this violation, whatever its hash says.

A connector's load writes what its source holds: a CPU offload tier's chunk holds the content
its store copied from a GPU block (`tier_stored`), and a load from it writes that content into
the request's blocks (`load_from_tier`, then `loaded`), so a wrong load is caught here, not
taken on the connector's word. Without a named source a load writes the request's own KV.

A decision no other check can judge (how long a window's run must be, where a chunk starts,
when a skipped block is freed, which key a block is cached under) breaks it as soon as a request
would read a wrong value.

**Known bugs.** Under a vLLM release's semantics the spec reproduces that release, bugs
included; a `KnownBug` names the states such a bug leads to. An untruth a known bug of the
semantics explains is counted under the bug's name instead of raised (unless
`fatal_known_bugs`); the request that read it is *tainted* until it is freed: what it computes
meanwhile is poisoned KV (written where it belongs, but not the KV of those tokens), and a later
read of poisoned KV is the same bug's consequence. Any other untruth raises `InvariantViolation`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from pagedkv.spec.ghost_kv import NULL_BLOCK_ID, GhostKV, SlotKV
from pagedkv.vocab.errors import InvariantViolation
from pagedkv.vocab.request import Request

ATTENTION_TRUTH = "every position a request reads holds its own KV"
"""The invariant's name, as `InvariantViolation.invariant` reports it."""

BLOCK_RELEASED = "a block is reused only after every transfer using it finished"
"""The name of the rule `handed_out` enforces for loads still in flight."""

STALE_KV = "KV computed before a reset is never read after it"
"""The name of the rule a read of KV of an older weights epoch breaks (module docstring)."""

ChunkContent = tuple[int, tuple[int | None, ...]]
"""What a CPU tier's chunk holds: the group, and each slot's history number (None: nothing)."""


class ReadPolicy(Protocol):
    """What the invariant needs of an attention type (its per-type manager,
    `pagedkv.spec.single_type`)."""

    @property
    def kind(self) -> str:
        """The attention type, in words."""

    def first_read(self, position: int) -> int:
        """The first position the token at `position` attends to."""


@dataclass(frozen=True)
class Untruth:
    """A position a request reads whose block does not hold the request's KV for it.

    Attributes:
        request_id: the reader.
        group: the KV cache group whose blocks it reads.
        position: the token position read.
        block_id: the block its table has there (None: its table has no block there).
        found: what that slot holds (None: nothing).
        expected: what it should hold: the request's own KV of that position.
        where: "hit" (a lookup's result), "step" (an allocation's reads) or "table" (a
            running request's reads at a check).
        poisoned_by: the known bug that poisoned the KV found, if it was poisoned.
    """

    request_id: str
    group: int
    position: int
    block_id: int | None
    found: SlotKV | None
    expected: SlotKV
    where: str
    poisoned_by: str | None


@dataclass(frozen=True)
class KnownBug:
    """A release's bug that breaks attention truth, reproduced under that release's semantics.

    Attributes:
        release: the release it belongs to ("vLLM 0.8.5").
        name: what goes wrong, in words.
        explains: whether an untruth is this bug's doing (the ghost content lets it look at
            what was found and expected).
    """

    release: str
    name: str
    explains: Callable[[Untruth, GhostKV], bool]

    @property
    def title(self) -> str:
        return f"{self.release} bug: {self.name}"


@dataclass
class DraftStep:
    """A request's last step with draft tokens, until its accepted count is known: its main
    tokens end at `main`, it had `num_drafts` drafts, and per state group the table it ran
    with and its running column."""

    main: int
    num_drafts: int
    tables: dict[int, tuple[tuple[int, ...], int]]


class AttentionTruth:
    """The ghost content of a manager's pool and the attention-truth checks (module docstring).

    Attributes:
        ghost: what every slot holds.
        policies: per KV cache group, its attention policy (what a token reads).
        block_sizes: each group's block size.
        known_bugs: the bugs the manager's semantics reproduces.
        fatal_known_bugs: raise on a known bug's state too (to replay one).
        tainted: request id -> the known bug whose wrong KV it read (until it is freed).
        loading: request id -> the blocks a connector's async load still writes (from the
            allocation that adopted the external tokens until the load lands, fails or is
            reported finished).
        sending: request id -> the blocks a connector still reads to send the request's KV
            elsewhere (from the caller's report until it reports the send finished).
        stray: block id -> the transfers (request id, "load" or "send") still using it
            although the request freed it: handing it out is a violation.
        scheduled: request id -> the end of the tokens its allocations scheduled since it last
            held no block (what its computed count may honestly reach).
        checks: what the checks covered and the known bugs' states, by event (the campaign's
            coverage takes them).
        tier: CPU offload tier key -> the content its store copied (module docstring).
        tier_loads: request id -> (group, block position) -> the content its next
            allocation's external tokens load there (`load_from_tier`).
        state_groups: the groups whose blocks hold recurrent states (module docstring).
        written_this_step: state block id -> the request whose step of this scheduler step
            writes it (until `new_step`).
    """

    def __init__(
        self,
        policies: Sequence[ReadPolicy],
        block_size: int | Sequence[int],
        known_bugs: Sequence[KnownBug] = (),
        *,
        fatal_known_bugs: bool = False,
    ) -> None:
        self.ghost = GhostKV()
        self.policies = tuple(policies)
        # One size for every group, or each group's (groups of several sizes).
        self.block_sizes = (
            (block_size,) * len(self.policies) if isinstance(block_size, int) else tuple(block_size)
        )
        self.known_bugs = tuple(known_bugs)
        self.fatal_known_bugs = fatal_known_bugs
        self.tainted: dict[str, str] = {}
        self.loading: dict[str, tuple[int, ...]] = {}
        self.sending: dict[str, tuple[int, ...]] = {}
        self.stray: dict[int, tuple[tuple[str, str], ...]] = {}
        self.scheduled: dict[str, int] = {}
        self.checks: Counter[str] = Counter()
        self.tier: dict[bytes, ChunkContent] = {}
        self.tier_loads: dict[str, dict[tuple[int, int], ChunkContent]] = {}
        self.state_groups = frozenset(
            group
            for group, policy in enumerate(self.policies)
            if getattr(policy, "holds_state", False)
        )
        self.written_this_step: dict[int, str] = {}
        self.draft_steps: dict[str, DraftStep] = {}
        self.state_reads: dict[tuple[str, int], tuple[int, int]] = {}

    # -- the manager's events ----------------------------------------------------------------

    def handed_out(self, block_ids: Sequence[int]) -> None:
        """Blocks taken from the free queue: whatever they held is gone. None of them may be
        one a transfer still uses (`stray`): a load would overwrite its new owner's KV, a send
        would read the new owner's."""
        for block_id in block_ids:
            users = self.stray.get(block_id)
            if users:
                request_id, kind = users[0]
                use = {"load": "async load still writes", "send": "send still reads"}[kind]
                bug = " (vLLM #32255)" if kind == "load" else ""
                raise InvariantViolation(
                    BLOCK_RELEASED,
                    f"block {block_id} handed out again while request {request_id!r}'s {use} "
                    f"it: the request was freed before the connector reported the {kind} "
                    f"finished{bug}",
                )
            self.written_this_step.pop(block_id, None)
        self.ghost.clear(block_ids)

    def new_step(self) -> None:
        """A new scheduler step: the states the last one wrote are there to read."""
        self.written_this_step.clear()

    def computed(
        self, request: Request, tables: Sequence[Sequence[int]], start: int, num_tokens: int
    ) -> None:
        """Tokens [start, start + num_tokens) of `request` (drafts after its own tokens) are
        computed into its blocks in every group (poisoned if it is tainted)."""
        poisoned_by = self.tainted.get(request.request_id)
        for group, table in enumerate(tables):
            block_size = self.block_sizes[group]
            if group in self.state_groups:
                if num_tokens > 0:
                    self._write_states(group, table, request, start + num_tokens, poisoned_by)
                continue
            self.ghost.write(group, table, block_size, request, start, num_tokens, poisoned_by)
        self.scheduled[request.request_id] = start + num_tokens

    def _write_states(
        self, group: int, table: Sequence[int], request: Request, end: int, poisoned_by: str | None
    ) -> None:
        """The states a step ending at `end` writes in state group `group` (vLLM 0.33's worker,
        `preprocess_mamba`): with d drafts, main tokens up to m = end - d and running column
        R = cdiv(end, B) - 1, column R + j gets the state after m + j tokens (j = 0..d); when m
        is a boundary, the state there is copied into its column m / B - 1 as well, whatever
        is accepted (`postprocess_mamba`, fewer drafts than B). With drafts, the copy for a
        boundary the accepted drafts pass waits for their count (`drafts_settled`)."""
        request_id = request.request_id
        block_size = self.block_sizes[group]
        num_drafts = len(request.spec_token_ids)
        main = end - num_drafts
        running = -(-end // block_size) - 1
        self.state_reads.pop((request_id, group), None)
        for offset in range(num_drafts + 1):
            column = running + offset
            written = self.ghost.write_state(
                group, table, block_size, request, main + offset, poisoned_by, column
            )
            if written is not None:
                self.written_this_step[written] = request_id
                self.checks["attention truth: Mamba states written"] += 1
        if not num_drafts:
            self.draft_steps.pop(request_id, None)
            return
        self.checks["attention truth: Mamba draft states written"] += num_drafts
        if main % block_size == 0 and main > 0:
            self._copy_state(group, table, running, main // block_size - 1, request_id)
        steps = self.draft_steps.setdefault(request_id, DraftStep(main, num_drafts, {}))
        steps.main, steps.num_drafts = main, num_drafts
        steps.tables[group] = (tuple(table), running)

    def _copy_state(
        self, group: int, table: Sequence[int], source: int, target: int, request_id: str
    ) -> None:
        """The worker copies column `source`'s state into column `target` of the step's
        table (nothing into or out of a null or missing column)."""
        if not (0 <= target < len(table) and source < len(table)):
            return
        block_from, block_to = table[source], table[target]
        if NULL_BLOCK_ID in (block_from, block_to) or block_from == block_to:
            return
        content = self.ghost.content(block_from)
        if content is None:
            self.ghost.clear([block_to])
        else:
            self.ghost.put(block_to, group, content[1])
        self.written_this_step[block_to] = request_id
        self.checks["attention truth: Mamba boundary states copied"] += 1

    def drafts_settled(self, request: Request) -> None:
        """The request's computed count tells how many drafts of its last step were accepted
        (below the step's main tokens: not yet; past its drafts: none to settle). vLLM 0.33's
        `postprocess_mamba`: with n computed tokens, a boundary b = n // B * B the accepted
        drafts reached past m gets the state there (column R + b - m) copied into column
        b / B - 1; the next step reads the state after n tokens from column R if that copy
        went there, else from R + n - m.
        Both are by the step's table: the worker's row is append-only, so a block the manager
        moved since (`take_new_blocks`) is read where it was."""
        steps = self.draft_steps.get(request.request_id)
        computed = request.num_computed_tokens
        if steps is None or computed < steps.main:
            return  # not yet advanced past the step's main tokens
        del self.draft_steps[request.request_id]
        accepted = computed - steps.main
        if accepted > steps.num_drafts:
            return
        for group, (table, running) in steps.tables.items():
            block_size = self.block_sizes[group]
            boundary = computed // block_size * block_size
            target = boundary // block_size - 1
            if boundary > steps.main:
                self._copy_state(
                    group, table, running + boundary - steps.main, target, request.request_id
                )
                self.checks["attention truth: boundaries crossed by accepted drafts"] += 1
            read = running if boundary >= steps.main and target == running else running + accepted
            if read < len(table):
                self.state_reads[(request.request_id, group)] = (computed, table[read])

    def worker_view(
        self, request: Request, tables: Sequence[Sequence[int]], num_computed_tokens: int
    ) -> Sequence[Sequence[int]]:
        """The tables as the worker reads a state group's state after `num_computed_tokens`
        tokens: where its last step's drafts left it (`drafts_settled`), else as they are."""
        if not self.state_reads:
            return tables
        view = list(tables)
        for group in self.state_groups:
            found = self.state_reads.get((request.request_id, group))
            if found is None or found[0] != num_computed_tokens or num_computed_tokens <= 0:
                continue
            column = (num_computed_tokens - 1) // self.block_sizes[group]
            table = list(view[group])
            table.extend([NULL_BLOCK_ID] * (column + 1 - len(table)))
            table[column] = found[1]
            view[group] = table
        return view

    def loaded(
        self, request: Request, tables: Sequence[Sequence[int]], start: int, num_tokens: int
    ) -> None:
        """A connector loads tokens [start, start + num_tokens) of `request` into its blocks:
        the request's own KV (the connector's word), except in the blocks `load_from_tier`
        named a tier chunk for, which get that chunk's content."""
        self.computed(request, tables, start, num_tokens)
        sources = self.tier_loads.pop(request.request_id, {})
        for (group, position), (chunk_group, slots) in sources.items():
            table = tables[group]
            if position < len(table) and table[position] != NULL_BLOCK_ID:
                self.ghost.put(table[position], chunk_group, slots)
                self.checks["attention truth: blocks loaded from a CPU tier"] += 1

    def tier_stored(self, key: bytes, block_id: int) -> None:
        """A CPU tier's store of chunk `key` copies what GPU block `block_id` holds now."""
        content = self.ghost.content(block_id)
        if content is not None:
            self.tier[key] = content
        else:
            self.tier.pop(key, None)

    def tier_dropped(self, keys: Iterable[bytes]) -> None:
        """The tier no longer holds these chunks (evicted, a store failed)."""
        for key in keys:
            self.tier.pop(key, None)

    def load_from_tier(self, request_id: str, sources: dict[tuple[int, int], bytes]) -> None:
        """The next allocation of the request adopting external tokens loads, into its block
        at (group, position), the tier chunk named there (what it holds now)."""
        self.tier_loads[request_id] = {
            place: self.tier[key] for place, key in sources.items() if key in self.tier
        }

    def new_epoch(self) -> None:
        """A successful reset: new weights (module docstring). Loads not yet allocated are
        dropped; what a tier still holds stays as it was computed, in the older epoch."""
        self.ghost.new_epoch()
        self.tier_loads.clear()

    def _adopt_claims(self, request: Request, tables: Sequence[Sequence[int]]) -> None:
        """Tokens the caller counts as computed (`num_computed_tokens`) that no step of this
        manager scheduled were computed elsewhere, where the request's tables put them: the
        caller's claim, not the manager's decision (a scheduler that advances the count by
        the tokens it ran never makes one)."""
        scheduled = self.scheduled.get(request.request_id, 0)
        claimed = min(request.num_computed_tokens, request.num_tokens)
        if claimed > scheduled:
            self.checks["attention truth: tokens computed outside the manager's steps"] += (
                claimed - scheduled
            )
            self.computed(request, tables, scheduled, claimed - scheduled)

    def load_started(
        self, request_id: str, tables: Sequence[Sequence[int]], start: int, num_tokens: int
    ) -> None:
        """A connector's async load writes positions [start, start + num_tokens) of the
        request's blocks until it lands (`load_ended`)."""
        blocks: list[int] = []
        for group, table in enumerate(tables):
            block_size = self.block_sizes[group]
            end = -(-(start + num_tokens) // block_size)
            blocks.extend(block for block in table[start // block_size : end] if block != 0)
        self.loading[request_id] = tuple(blocks)

    def load_ended(self, request_id: str) -> None:
        """The request's async load landed, failed or was reported finished: nothing writes
        its blocks behind the manager's back any more."""
        if self.loading.pop(request_id, None) is not None:
            self.checks["attention truth: async loads ended"] += 1
        self._release(request_id, "load")

    def send_started(self, request_id: str, tables: Sequence[Sequence[int]]) -> None:
        """A connector reads every block of the request's tables to send its KV elsewhere
        until `send_ended`."""
        self.sending[request_id] = tuple(
            block for table in tables for block in table if block != NULL_BLOCK_ID
        )
        self.checks["attention truth: sends started"] += 1

    def send_ended(self, request_id: str) -> None:
        """The request's send finished: its blocks may be reused once freed."""
        self.sending.pop(request_id, None)
        self._release(request_id, "send")

    def _release(self, request_id: str, kind: str) -> None:
        for block_id, users in list(self.stray.items()):
            left = tuple(user for user in users if user != (request_id, kind))
            if left:
                self.stray[block_id] = left
            else:
                del self.stray[block_id]

    def load_failed(
        self, request: Request, tables: Sequence[Sequence[int]], num_valid_tokens: int
    ) -> None:
        """A connector's load into `request`'s blocks failed from `num_valid_tokens` on (a
        block boundary of every group): its blocks from there hold garbage until recomputed,
        and the request counts as scheduled up to there only."""
        for group, table in enumerate(tables):
            first = num_valid_tokens // self.block_sizes[group]
            self.ghost.clear([block_id for block_id in table[first:] if block_id != 0])
        self.scheduled[request.request_id] = min(
            self.scheduled.get(request.request_id, 0), num_valid_tokens
        )
        self.load_ended(request.request_id)
        self.checks["attention truth: failed loads"] += 1

    def freed(self, request_id: str) -> None:
        """The request's blocks were freed: it recomputes from its tokens when readmitted. A
        load or send still in flight keeps using them (`stray`) until reported finished."""
        self.tainted.pop(request_id, None)
        self.scheduled.pop(request_id, None)
        self.draft_steps.pop(request_id, None)
        for group in self.state_groups:
            self.state_reads.pop((request_id, group), None)
        self.tier_loads.pop(request_id, None)
        for kind, transfers in (("load", self.loading), ("send", self.sending)):
            blocks = transfers.pop(request_id, ())
            if blocks:
                self.checks[f"attention truth: requests freed with a {kind} in flight"] += 1
            for block_id in blocks:
                self.stray[block_id] = (*self.stray.get(block_id, ()), (request_id, kind))

    def forget(self, request_id: str) -> None:
        """The manager no longer tracks the request."""
        self.freed(request_id)
        self.ghost.forget(request_id)

    # -- the checks --------------------------------------------------------------------------

    def check_hit(
        self, request: Request, hits: Sequence[Sequence[int]], num_tokens: int, *, eagle: bool
    ) -> None:
        """A hit of `num_tokens` tokens (one block list per group; `eagle`: its last block was
        dropped) holds the KV every position the token at `num_tokens` reads."""
        if not num_tokens:
            return
        checks = self.checks
        checks["attention truth: hits checked"] += 1
        if eagle:
            checks["attention truth: EAGLE hits checked"] += 1
        for policy, group_hits in zip(self.policies, hits, strict=True):
            if group_hits and group_hits[0] == NULL_BLOCK_ID:
                checks[f"attention truth: hits past null blocks checked, {policy.kind}"] += 1
        self._check(request, hits, num_tokens, "hit")

    def check_step(
        self, request: Request, tables: Sequence[Sequence[int]], num_computed_tokens: int
    ) -> None:
        """Tokens scheduled from `num_computed_tokens` on read true KV from the request's
        tables."""
        self.checks["attention truth: steps checked"] += 1
        self._adopt_claims(request, tables)
        tables = self.worker_view(request, tables, num_computed_tokens)
        self._check(request, tables, num_computed_tokens, "step")
        self._check_state_written(request, tables, num_computed_tokens)

    def _check_state_written(
        self, request: Request, tables: Sequence[Sequence[int]], num_computed_tokens: int
    ) -> None:
        """A step starting at s > 0 reads, in each state group, a state no other request's
        step of this scheduler step writes (module docstring)."""
        if num_computed_tokens <= 0:
            return
        for group in sorted(self.state_groups):
            table = tables[group]
            index = (num_computed_tokens - 1) // self.block_sizes[group]
            block_id = table[index] if index < len(table) else NULL_BLOCK_ID
            writer = self.written_this_step.get(block_id)
            self.checks["attention truth: Mamba state reads checked"] += 1
            if writer is not None and writer != request.request_id:
                raise InvariantViolation(
                    ATTENTION_TRUTH,
                    f"an allocation for request {request.request_id!r}: group {group} reads "
                    f"the state after {num_computed_tokens} tokens in block {block_id}, which "
                    f"request {writer!r}'s step of this scheduler step writes: its forward pass "
                    "has not run yet (a same-step hit of a just-keyed Mamba state)",
                )

    def check_table(self, request: Request, tables: Sequence[Sequence[int]]) -> None:
        """A running request's next token reads true KV from its tables."""
        self._adopt_claims(request, tables)
        self.drafts_settled(request)
        tables = self.worker_view(request, tables, request.num_computed_tokens)
        self._check(request, tables, request.num_computed_tokens, "table")

    def _check(
        self, request: Request, tables: Sequence[Sequence[int]], num_tokens: int, where: str
    ) -> None:
        untruth = self.first_untruth(request, tables, num_tokens, where)
        if untruth is None:
            return
        found = untruth.found
        if found is not None and self.ghost.histories.epoch_of(found[1]) < self.ghost.epoch:
            raise InvariantViolation(STALE_KV, self.report(untruth))
        bug = self.tainted.get(request.request_id) or untruth.poisoned_by
        if bug is None:
            bug = next(
                (known.title for known in self.known_bugs if known.explains(untruth, self.ghost)),
                None,
            )
        if bug is None or self.fatal_known_bugs:
            raise InvariantViolation(bug or ATTENTION_TRUTH, self.report(untruth))
        self.checks[f"states of a known bug: {bug}"] += 1
        self.tainted[request.request_id] = bug

    def first_untruth(
        self, request: Request, tables: Sequence[Sequence[int]], num_tokens: int, where: str
    ) -> Untruth | None:
        """The first position (group by group, left to right) that the token at `num_tokens`
        reads and that does not hold the request's own KV; None if there is none."""
        expected = self.ghost.histories_of(request)
        num_tokens = min(num_tokens, len(expected))  # a request computes only its own tokens
        for group, table in enumerate(tables):
            block_size = self.block_sizes[group]
            first = self.policies[group].first_read(num_tokens)
            self.checks["attention truth: positions read checked"] += num_tokens - first
            position = self.ghost.first_difference(
                group, table, block_size, range(first, num_tokens), expected
            )
            if position is None:
                continue
            index = position // block_size
            block_id = table[index] if index < len(table) else None
            found = (
                None
                if block_id is None or block_id == NULL_BLOCK_ID
                else self.ghost.holds(block_id, position % block_size)
            )
            return Untruth(
                request.request_id,
                group,
                position,
                block_id,
                found,
                (group, expected[position]),
                where,
                None if found is None else self.ghost.histories.poisoned_by(found[1]),
            )
        return None

    def report(self, untruth: Untruth) -> str:
        """An untruth in words: who reads what, where, and what it finds instead."""
        what = {
            "hit": "a prefix-cache hit of",
            "step": "an allocation for",
            "table": "the block table of",
        }[untruth.where]
        block = untruth.block_id
        if block is None:
            holder = "no block (the table ends before it)"
        elif block == NULL_BLOCK_ID:
            holder = "the null block"
        else:
            holder = f"block {block}, which holds {self.ghost.describe(untruth.found)}"
        return (
            f"{what} request {untruth.request_id!r}: group {untruth.group} reads position "
            f"{untruth.position}, held by {holder}; the request's own is "
            f"{self.ghost.describe(untruth.expected)}"
        )

    def canonical(self, block_ids: Iterable[int]) -> tuple[object, ...]:
        """The ghost state that decides what later reads find, independent of history's
        numbering: the content of `block_ids` (those a later read can reach: held or cached),
        the tainted requests and the loads in flight."""
        return (
            self.ghost.canonical(block_ids),
            tuple(sorted(self.tainted.items())),
            tuple(sorted(self.loading.items())),
            tuple(sorted(self.sending.items())),
            tuple(sorted(self.stray.items())),
        )

    def take_checks(self) -> Counter[str]:
        """What the checks covered since the last call."""
        checks, self.checks = self.checks, Counter()
        return checks
