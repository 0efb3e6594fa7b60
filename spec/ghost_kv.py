"""Ghost KV content: what each slot of each block holds, kept by the spec only.

The managers decide which block serves which tokens; nothing they keep says what a block
*holds*. This module keeps it, as ghost state (the implementation has none), so that their
decisions can be held to what attention reads (`pagedkv.spec.attention_truth`).

**What a token's KV is.** The KV of the token at position p of a request is fixed by everything
the model saw up to and including p: the request's LoRA adapter and tenant (its cache salt: a
tenant never reads another's KV, whatever the values), its tokens 0..p and, for a token inside a
multimodal placeholder, which input (its content hash) and which of the input's tokens it is.
Two tokens have the same KV exactly when all of that agrees. `KVHistories` gives each such
history a number by hash-consing (a history is its parent history's number, the token and its
multimodal place), so "the same KV" is an equality of ints: exact, no hash value involved.

**What a slot holds.** The KV of one token for one KV cache group (the group's layers), or
nothing. It is written when the token is computed into the block (`GhostKV.write`: the tokens an
`allocate_slots` call scheduled, drafts included, are computed by the step it allocated for),
kept while the block is free (the prefix cache reuses it), and gone when the block is handed
out again (`GhostKV.clear`): a block's old KV is never read by its next owner.

**Weights epochs.** A successful `reset_prefix_cache` stands for new weights (RLHF): every KV
computed before it is wrong afterwards, however well its hash matches. Every history starts at
a root that names the epoch it was computed in (`GhostKV.epoch`, bumped by `new_epoch`), so KV
of an older epoch is never the KV a request expects, and `epoch_of` tells it apart.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

from pagedkv.vocab.request import Request

MultimodalPlace = tuple[str, int]
"""A token inside a multimodal input: the input's content hash, and the token's index in it."""

NULL_BLOCK_ID = 0  # the null block holds no one's KV (pagedkv.spec.block_pool's)

SlotKV = tuple[int, int]
"""What a slot holds: (KV cache group, the history number of the token whose KV it is)."""


class Root(NamedTuple):
    """Where every history of one adapter and tenant starts, in one weights epoch."""

    lora_id: int | None
    cache_salt: str | None
    epoch: int = 0


class Step(NamedTuple):
    """One token after a history: the token id and its multimodal place (None outside one)."""

    parent: int
    token: int
    place: MultimodalPlace | None


class Poisoned(NamedTuple):
    """KV computed by a request that read wrong KV (under a known bug): not the KV of
    `history`, though written where it belongs."""

    history: int
    bug: str


class KVHistories:
    """Numbers every history of tokens (module docstring): equal numbers, equal KV.

    Attributes:
        entries: number -> what it numbers: a root, a step after a history, or a poisoned
            history. Each kind has its own table from entry to number (the inverse).
    """

    def __init__(self) -> None:
        self.entries: list[Root | Step | Poisoned] = []
        self._roots: dict[Root, int] = {}
        self._steps: dict[tuple[int, int, MultimodalPlace | None], int] = {}  # Steps
        self._poisoned: dict[Poisoned, int] = {}

    def root(self, lora_id: int | None, cache_salt: str | None, epoch: int = 0) -> int:
        """The number of the empty history of an adapter and a tenant in weights `epoch`."""
        return self._number(self._roots, Root(lora_id, cache_salt, epoch))

    def step(self, parent: int, token: int, place: MultimodalPlace | None) -> int:
        """The number of history `parent` followed by `token` (at multimodal `place`)."""
        number = self._steps.get((parent, token, place))
        if number is None:
            number = self._number(self._steps, Step(parent, token, place))
        return number

    def poisoned(self, history: int, bug: str) -> int:
        """The number of KV written for `history` by a request that read wrong KV."""
        return self._number(self._poisoned, Poisoned(history, bug))

    def _number(self, table: dict[Any, int], entry: Root | Step | Poisoned) -> int:
        number = table.get(entry)
        if number is None:
            number = table[entry] = len(self.entries)
            self.entries.append(entry)
        return number

    def unfold(self, number: int) -> tuple[Root, list[tuple[int, MultimodalPlace | None]]]:
        """A history spelled out: its root and every (token, place) from position 0 on."""
        entry = self.entries[number]
        if isinstance(entry, Poisoned):
            return self.unfold(entry.history)
        steps: list[tuple[int, MultimodalPlace | None]] = []
        while isinstance(entry, Step):
            steps.append((entry.token, entry.place))
            entry = self.entries[entry.parent]
        assert isinstance(entry, Root), "every history starts at a root"
        return entry, steps[::-1]

    def epoch_of(self, number: int) -> int:
        """The weights epoch the KV `number` names was computed in."""
        return self.unfold(number)[0].epoch

    def poisoned_by(self, number: int) -> str | None:
        """The known bug that poisoned this KV, or None for true KV."""
        entry = self.entries[number]
        return entry.bug if isinstance(entry, Poisoned) else None


def multimodal_place(request: Request, position: int) -> MultimodalPlace | None:
    """Which input, and which of its tokens, the token at `position` is (None if no input's
    placeholder covers it)."""
    for placeholder, mm_hash in zip(request.mm_positions, request.mm_hashes, strict=True):
        if placeholder.offset <= position < placeholder.end:
            return (mm_hash, position - placeholder.offset)
    return None


class GhostKV:
    """The ghost content of a pool's blocks (module docstring).

    Attributes:
        histories: the numbering of histories every slot refers to.
        slots: block id -> the history number of the token whose KV each slot holds (None:
            nothing written since the block was last handed out); a block never written has
            no entry.
        group_of: block id -> the KV cache group whose KV its slots hold (a block serves one
            group between two hand-outs).
        expected: request id -> (the Request, the history number of each of its tokens so
            far): what its KV is, extended as its tokens grow.
        epoch: the current weights epoch (module docstring): what a request expects is
            computed in it.
    """

    def __init__(self) -> None:
        self.epoch = 0
        self.histories = KVHistories()
        self.slots: dict[int, list[int | None]] = {}
        self.group_of: dict[int, int] = {}
        self.expected: dict[str, tuple[Request, list[int]]] = {}

    def histories_of(self, request: Request) -> list[int]:
        """The history number of every token of `request`, position by position."""
        cached = self.expected.get(request.request_id)
        if cached is None or cached[0] is not request:
            cached = (request, [])
            self.expected[request.request_id] = cached
        numbers = cached[1]
        tokens = request.all_token_ids
        if len(numbers) < len(tokens):
            histories = self.histories
            parent = (
                numbers[-1]
                if numbers
                else histories.root(request.lora_id, request.cache_salt, self.epoch)
            )
            for position in range(len(numbers), len(tokens)):
                place = multimodal_place(request, position) if request.mm_positions else None
                parent = histories.step(parent, tokens[position], place)
                numbers.append(parent)
        return numbers

    def forget(self, request_id: str) -> None:
        """Drop what is remembered of a request the manager no longer tracks."""
        self.expected.pop(request_id, None)

    def new_epoch(self) -> None:
        """New weights: every request's KV is computed afresh, in the next epoch."""
        self.epoch += 1
        self.expected.clear()

    def content(self, block_id: int) -> tuple[int, tuple[int | None, ...]] | None:
        """What block `block_id` holds: its group and each slot's history number (None: it
        holds nothing)."""
        slots = self.slots.get(block_id)
        return None if slots is None else (self.group_of[block_id], tuple(slots))

    def put(self, block_id: int, group: int, slots: Sequence[int | None]) -> None:
        """Block `block_id` now holds `slots` of group `group` (a copy written into it: a
        connector's load)."""
        self.group_of[block_id] = group
        self.slots[block_id] = list(slots)

    def clear(self, block_ids: Sequence[int]) -> None:
        """Blocks handed out again: their old KV is gone."""
        for block_id in block_ids:
            self.slots.pop(block_id, None)
            self.group_of.pop(block_id, None)

    def write(
        self,
        group: int,
        table: Sequence[int],
        block_size: int,
        request: Request,
        start: int,
        num_tokens: int,
        poisoned_by: str | None = None,
    ) -> None:
        """The KV of tokens [start, start + num_tokens) of `request` in group `group`, written
        into the blocks of `table` (block p holds positions [p * B, (p + 1) * B)); tokens past
        the request's own are its draft tokens (`spec_token_ids`). A position with no block in
        `table`, or the null block, is written nowhere. With `poisoned_by`, the KV is poisoned
        by that bug. A block that held another group's KV holds only this group's after."""
        numbers = self.histories_of(request)
        num_own = len(numbers)
        drafts = request.spec_token_ids
        for position in range(start, start + num_tokens):
            if position < num_own:
                number = numbers[position]
            else:  # a draft token: its history is not the request's (yet)
                parent = numbers[position - 1]
                number = self.histories.step(parent, drafts[position - num_own], None)
                numbers = [*numbers, number]  # a local copy
            if poisoned_by is not None:
                number = self.histories.poisoned(number, poisoned_by)
            index = position // block_size
            if index >= len(table) or table[index] == NULL_BLOCK_ID:
                continue  # no block there: the KV is written nowhere
            block_id = table[index]
            if self.group_of.get(block_id, group) != group:
                self.clear((block_id,))
            self.group_of[block_id] = group
            slots = self.slots.setdefault(block_id, [None] * block_size)
            slots[position % block_size] = number

    def write_state(
        self,
        group: int,
        table: Sequence[int],
        block_size: int,
        request: Request,
        end: int,
        poisoned_by: str | None = None,
        column: int | None = None,
    ) -> int | None:
        """A recurrent state: the state after tokens [0, end) of `request` in group `group`,
        written into the block at `column` of `table`, by default `(end - 1) // block_size`
        (nowhere if there is no block there), replacing whatever that block held. A state is
        spelled as the history of its last token, in that token's slot and no other, so that a
        read of position p (the state after p + 1 tokens) finds it only in the block holding exactly
        that state. Returns the block written, or None."""
        if end <= 0:
            return None
        numbers = self.histories_of(request)
        if end - 1 < len(numbers):
            number = numbers[end - 1]
        else:  # a draft token's state
            number = numbers[-1]
            for token in request.spec_token_ids[: end - len(numbers)]:
                number = self.histories.step(number, token, None)
        if poisoned_by is not None:
            number = self.histories.poisoned(number, poisoned_by)
        index = (end - 1) // block_size if column is None else column
        if index >= len(table) or table[index] == NULL_BLOCK_ID:
            return None
        slots: list[int | None] = [None] * block_size
        slots[(end - 1) % block_size] = number
        self.put(table[index], group, slots)
        return table[index]

    def holds(self, block_id: int, slot: int) -> SlotKV | None:
        """What slot `slot` of block `block_id` holds (None: nothing)."""
        slots = self.slots.get(block_id)
        if slots is None or slot >= len(slots):
            return None
        number = slots[slot]
        return None if number is None else (self.group_of[block_id], number)

    def first_difference(
        self,
        group: int,
        table: Sequence[int],
        block_size: int,
        positions: range,
        expected: Sequence[int],
    ) -> int | None:
        """The first of `positions` whose slot in `table` (group `group`) does not hold
        `expected[position]`: no block there, the null block, another group's KV, nothing, or
        another history's KV. None if every one holds it. Compares block by block."""
        position = positions.start
        while position < positions.stop:
            index, slot = divmod(position, block_size)
            end = min((index + 1) * block_size, positions.stop)
            block_id = table[index] if index < len(table) else NULL_BLOCK_ID
            slots = self.slots.get(block_id)
            if block_id == NULL_BLOCK_ID or slots is None or self.group_of[block_id] != group:
                return position
            held = slots[slot : slot + end - position]
            if held != list(expected[position:end]):
                return position + next(
                    i for i, number in enumerate(held) if number != expected[position + i]
                )
            position = end
        return None

    def canonical(self, block_ids: Iterable[int]) -> tuple[object, ...]:
        """What the given blocks hold, spelled out (the numbers depend on the order histories
        were met in; this does not): per block, each slot's group, root, tokens and places,
        and the bug that poisoned it. For a search that merges equal states."""
        spelled: list[object] = []
        for block_id in sorted(block_ids):
            for number in self.slots.get(block_id, ()):
                if number is None:
                    spelled.append((block_id, None))
                    continue
                group = self.group_of[block_id]
                root, steps = self.histories.unfold(number)
                root = root._replace(epoch=root.epoch - self.epoch)  # epochs before now
                poisoned_by = self.histories.poisoned_by(number)
                spelled.append((block_id, group, root, tuple(steps), poisoned_by))
        return tuple(spelled)

    def describe(self, content: SlotKV | None) -> str:
        """A slot's content in words (for an invariant's report)."""
        if content is None:
            return "nothing (no KV written since the block was handed out)"
        group, number = content
        root, steps = self.histories.unfold(number)
        tokens = [token for token, _ in steps]
        places = [(position, place) for position, (_, place) in enumerate(steps) if place]
        before = tokens[:-1]
        words = f"group {group}'s KV of token {tokens[-1]} at position {len(before)}"
        if len(before) <= 8:
            words += f" after tokens {before}"
        else:
            words += f" after {len(before)} tokens ending {before[-6:]}"
        if places:
            words += f", multimodal places {places}"
        if root.lora_id is not None or root.cache_salt is not None:
            words += f", LoRA {root.lora_id}, {'a' if root.cache_salt else 'no'} cache salt"
        if root.epoch != self.epoch:
            words += f", computed in weights epoch {root.epoch} (now {self.epoch})"
        bug = self.histories.poisoned_by(number)
        if bug is not None:
            words += f", poisoned by {bug}"
        return words
