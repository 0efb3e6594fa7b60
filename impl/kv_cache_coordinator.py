"""The coordinators: the KV cache groups of a manager, each kept by its per-type manager.

`KVCacheManager` checks a call's preconditions and keeps the request-level state (identity,
stored hashes, stats); its coordinator makes the changes, group by group, through the per-type
managers (`pagedkv.single_type`), all drawing from one `BlockPool`. The coordinators differ only
in how they find a prefix hit, as vLLM 0.33's do:

- `UnitaryKVCacheCoordinator` (one group): the group's own hit; with EAGLE, found for EAGLE
  (`for_eagle`) and less its last block.
- `HybridKVCacheCoordinator` (several groups): the longest hit every group allows, full
  attention first, asking the others again until none shortens it; with EAGLE, vLLM 0.33's
  procedure (`eagle_common_hit` in the spec states its steps).

Every method runs while the manager holds the pool's call token, after every precondition of
the call holds: it changes state and never refuses.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from pagedkv.block import KVCacheBlock
from pagedkv.block_pool import BlockPool
from pagedkv.single_type import SingleTypeKVCacheManager, single_type_manager
from pagedkv.single_type.mamba import MambaAlignManager
from pagedkv.single_type.sliding_window import SlidingWindowManager
from pagedkv.vocab.hashes import BlockHashType, HashFn
from pagedkv.vocab.kv_cache_interface import KVCacheSpec
from pagedkv.vocab.request import Request

GroupBlocks = tuple[list[KVCacheBlock], ...]
"""One list of blocks per KV cache group, in the config's group order."""


def group_view(
    chain: list[BlockHashType], block_size: int, hash_block_size: int
) -> list[BlockHashType]:
    """A group's block hashes from the request's chain at `hash_block_size` H: for its block
    k, the chain hash at the block's end, `chain[(k + 1) * B / H - 1]` (the chain itself when
    B == H). Complexity: O(len(chain) * H / B)."""
    if block_size == hash_block_size:
        return chain
    scale = block_size // hash_block_size
    return chain[scale - 1 :: scale]


class KVCacheCoordinator(ABC):
    """The per-type managers of a config's KV cache groups, over one pool.

    Attributes:
        single_type_managers: each group's per-type manager, in group order.
        num_groups: how many there are.
        use_eagle: a hit drops its last block (EAGLE needs its hidden states).
        sparse: a sliding-window group caches under sparse retention.
        state_group: the first Mamba group in mode "align" (refusals name it), or None.
        eagle_lookup: hits are found `for_eagle` (with use_eagle, unless vLLM 0.8.5's
            `eagle_window_hit_one_short`).

    Args:
        specs: each group's spec, in group order (one block size with caching).
        block_pool: the pool every group draws from.
        use_eagle: as the manager's.
        eagle_lookup: as above.
        retention_interval: the config's `prefix_cache_retention_interval`.
        alignment: with several block sizes and caching, S (hits end on its multiples).

    Raises:
        KVCacheConfigError: a spec type no per-type manager serves, or EAGLE with one that
            does not support it (`pagedkv.single_type.single_type_manager`).
    """

    def __init__(
        self,
        specs: Sequence[KVCacheSpec],
        block_pool: BlockPool,
        use_eagle: bool,
        eagle_lookup: bool,
        retention_interval: int | None = None,
        alignment: int | None = None,
    ) -> None:
        self.block_pool = block_pool
        self.single_type_managers: tuple[SingleTypeKVCacheManager, ...] = tuple(
            single_type_manager(spec, block_pool, group_id, use_eagle, retention_interval)
            for group_id, spec in enumerate(specs)
        )
        # Whether a group may leave full blocks out of the prefix cache (sparse retention).
        self.sparse = any(manager.sparse for manager in self.single_type_managers)
        if alignment is not None:
            # Several block sizes with caching: hits end on multiples of S (`alignment`); a
            # window of smaller blocks finds them so and caches only the blocks they read.
            for manager in self.single_type_managers:
                if isinstance(manager, SlidingWindowManager):
                    manager.alignment_blocks = alignment // manager.block_size
                    manager.sparse = manager.sparse or manager.alignment_blocks > 1
        self.num_groups = len(self.single_type_managers)
        self.use_eagle = use_eagle
        self.eagle_lookup = eagle_lookup
        # The groups whose attention may stop reading a request's leading blocks.
        self._skipping = tuple(
            manager for manager in self.single_type_managers if manager.allows_null_blocks
        )
        # The groups whose blocks hold recurrent states (a Mamba group in mode "align").
        self._stateful = tuple(
            manager for manager in self.single_type_managers if manager.holds_state
        )
        self.state_group = self._stateful[0].group_id if self._stateful else None

    @abstractmethod
    def find_longest_cache_hit(
        self, lookup: list[BlockHashType], block_hashes: list[BlockHashType]
    ) -> GroupBlocks:
        """Each group's hit for a request whose lookup covers the hashes `lookup` (a prefix of
        its stored `block_hashes`): the same length in every group, EAGLE's drop made.

        Complexity: O(len(lookup) * groups) lookups, and more passes when a group shortens
        the hit (the subclass says).
        """

    def junction(
        self, num_hits: int, lookup: list[BlockHashType], block_hashes: list[BlockHashType]
    ) -> int:
        """The shared-prefix junction of a lookup whose hit has `num_hits` blocks, in tokens
        (0: none; only several groups have one: `HybridKVCacheCoordinator.junction`).
        Complexity: O(1)."""
        return 0

    def get_num_blocks_to_allocate(self, num_new: int) -> int:
        """The blocks every group takes together when each list grows by `num_new` positions
        (one block size: `num_new` in every group, but one in a Mamba group in mode "align",
        whose new positions before its running one are null). Complexity: O(groups)."""
        if not self._stateful:
            return num_new * self.num_groups
        num_new = max(num_new, 0)  # a list longer than needed (lookahead slots) takes none
        return sum(
            manager.num_blocks_to_allocate(
                manager.planned_new() if isinstance(manager, MambaAlignManager) else num_new
            )
            for manager in self.single_type_managers
        )

    def plan_state_step(self, request_id: str, end: int, num_hits: int) -> None:
        """Tell each state group the step about to be counted and allocated (its tokens end
        at `end`, lookahead out, after `num_hits` hits). Complexity: O(state groups)."""
        for manager in self._stateful:
            assert isinstance(manager, MambaAlignManager)
            manager.plan_step(request_id, end, num_hits)

    def defers(self, hits: Sequence[list[KVCacheBlock]]) -> bool:
        """Whether a group defers these hits to the next scheduler step (a Mamba state keyed
        in this one). Complexity: O(groups)."""
        return any(manager.defers(hits[manager.group_id]) for manager in self._stateful)

    def new_step_starts(self) -> None:
        """A new scheduler step starts: every group forgets the keys of the last one.
        Complexity: O(groups + keys)."""
        for manager in self._stateful:
            manager.new_step_starts()

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Group by group, drop (and free, the newest first) the request's blocks its group's
        attention no longer reads. Complexity: O(groups + blocks dropped)."""
        for manager in self._skipping:
            manager.remove_skipped_blocks(request_id, num_computed_tokens)

    def add_hits(self, request_id: str, hits: GroupBlocks) -> None:
        """Touch every group's hits (one length, maybe 0; `()` for none), then append each
        group's to its list: no group's allocation can then evict another's hit. A request
        new to the manager gets its lists here. Complexity: O(groups + hits)."""
        managers = self.single_type_managers
        if hits and hits[0]:
            touch = self.block_pool.touch_owned_locked
            for group_hits in hits:
                touch(group_hits)
            for manager, group_hits in zip(managers, hits, strict=True):
                manager.add_hits(request_id, group_hits)
        elif request_id not in managers[0].req_to_blocks:
            for manager in managers:
                manager.add_hits(request_id, [])

    def allocate_new_blocks(
        self,
        request: Request,
        num_new: int,
        block_hashes: list[BlockHashType],
        num_cached: int,
        num_full: int,
        hash_fn: HashFn | None,
        junction: int = 0,
    ) -> GroupBlocks:
        """Group by group, take `num_new` blocks (free: the caller checked) and, with a hash
        function (caching on), cache the full blocks [num_cached, num_full) under the stored
        `block_hashes` (the first group to cache a new block appends its hash; a sparse group
        those its retention keeps, given the request's `junction`).

        Returns:
            The new blocks of each group.

        Complexity: O(groups * (num_new + blocks cached * block_size)).
        """
        request_id = request.request_id
        new_blocks = []
        for manager in self.single_type_managers:
            new_blocks.append(manager.allocate_new_blocks(request_id, num_new))
            if hash_fn is not None:
                manager.cache_blocks(request, block_hashes, num_cached, num_full, hash_fn, junction)
        return tuple(new_blocks)

    def allocate_per_group(self, request_id: str, counts: Sequence[int]) -> GroupBlocks:
        """Group by group, take `counts[group]` blocks (free: the caller checked), caching
        nothing (groups whose block counts differ are served with caching off).
        Complexity: O(groups + new blocks)."""
        return tuple(
            manager.allocate_new_blocks(request_id, count)
            for manager, count in zip(self.single_type_managers, counts, strict=True)
        )

    def free(self, request_id: str, tail_first: bool) -> None:
        """Release the request's blocks group by group, each group's last first or in order.
        Complexity: O(groups + blocks held)."""
        for manager in self.single_type_managers:
            manager.free(request_id, tail_first)

    def num_common_prefix_blocks(
        self, request_id: str, num_running_requests: int
    ) -> tuple[int, ...]:
        """Per group, the leading blocks with ref_cnt `num_running_requests`.
        Complexity: O(groups + the common prefixes)."""
        return tuple(
            manager.num_common_prefix_blocks(request_id, num_running_requests)
            for manager in self.single_type_managers
        )

    def block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The ids of the request's blocks, one list per group (empty for a request that holds
        none). Complexity: O(groups + blocks held)."""
        return tuple(
            [block.block_id for block in manager.req_to_blocks.get(request_id, ())]
            for manager in self.single_type_managers
        )


class UnitaryKVCacheCoordinator(KVCacheCoordinator):
    """One KV cache group (vLLM 0.33's unitary coordinator). `add_hits`,
    `allocate_new_blocks` and `free` are the base class's written for one group, without the
    loops over groups and the tuples they build (measured: an admission with 32 hits 2-3 us,
    about 8%, faster)."""

    def __init__(
        self,
        specs: Sequence[KVCacheSpec],
        block_pool: BlockPool,
        use_eagle: bool,
        eagle_lookup: bool,
        retention_interval: int | None = None,
    ) -> None:
        super().__init__(specs, block_pool, use_eagle, eagle_lookup, retention_interval)
        self._manager = self.single_type_managers[0]

    def add_hits(self, request_id: str, hits: GroupBlocks) -> None:
        manager = self._manager
        if hits and hits[0]:
            self.block_pool.touch_owned_locked(hits[0])
            manager.add_hits(request_id, hits[0])
        elif request_id not in manager.req_to_blocks:
            manager.add_hits(request_id, [])

    def allocate_new_blocks(
        self,
        request: Request,
        num_new: int,
        block_hashes: list[BlockHashType],
        num_cached: int,
        num_full: int,
        hash_fn: HashFn | None,
        junction: int = 0,
    ) -> GroupBlocks:
        manager = self._manager
        new_blocks = manager.allocate_new_blocks(request.request_id, num_new)
        if hash_fn is not None:
            manager.cache_blocks(request, block_hashes, num_cached, num_full, hash_fn, junction)
        return (new_blocks,)

    def free(self, request_id: str, tail_first: bool) -> None:
        self._manager.free(request_id, tail_first)

    def find_longest_cache_hit(
        self, lookup: list[BlockHashType], block_hashes: list[BlockHashType]
    ) -> GroupBlocks:
        """The group's longest hit within `lookup` (found `for_eagle` with `eagle_lookup`),
        less its last block with EAGLE. Complexity: O(len(lookup))."""
        hits = self.single_type_managers[0].find_longest_cache_hit(lookup, self.eagle_lookup)
        if self.use_eagle and hits:
            hits.pop()  # EAGLE recomputes the last matched block for its hidden states
        return (hits,)


class _LookupUnit:
    """Groups of one spec, looked up together with EAGLE (vLLM 0.33's attention groups).

    Attributes:
        full: full attention (its hit is only cut once found).
        groups: the KV cache groups, in order.
        manager: the first group's per-type manager (its scan serves the unit).
    """

    def __init__(self, full: bool, groups: tuple[int, ...], manager: SingleTypeKVCacheManager):
        self.full = full
        self.groups = groups
        self.manager = manager


class HybridKVCacheCoordinator(KVCacheCoordinator):
    """Several KV cache groups (vLLM 0.33's hybrid coordinator): a hit covers the same token
    prefix in every group."""

    def __init__(
        self,
        specs: Sequence[KVCacheSpec],
        block_pool: BlockPool,
        use_eagle: bool,
        eagle_lookup: bool,
        retention_interval: int | None = None,
        alignment: int | None = None,
    ) -> None:
        super().__init__(specs, block_pool, use_eagle, eagle_lookup, retention_interval, alignment)
        # The hit search asks full attention first (its hit shrinks only by trimming), then the
        # others, which may skip positions and drop blocks (sliding window, chunked local).
        managers = self.single_type_managers
        self._full_groups = tuple(
            group for group, manager in enumerate(managers) if not manager.allows_null_blocks
        )
        self._skipping_groups = tuple(
            group for group, manager in enumerate(managers) if manager.allows_null_blocks
        )
        # With EAGLE, vLLM 0.33 looks groups of equal specs up together, full attention first.
        members: dict[KVCacheSpec, list[int]] = {}
        for group, spec in enumerate(specs):
            members.setdefault(spec, []).append(group)
        units = [
            _LookupUnit(
                not managers[groups[0]].allows_null_blocks, tuple(groups), managers[groups[0]]
            )
            for groups in members.values()
        ]
        units.sort(key=lambda unit: not unit.full)
        self._eagle_units = tuple(units)

    def find_longest_cache_hit(
        self, lookup: list[BlockHashType], block_hashes: list[BlockHashType]
    ) -> GroupBlocks:
        """`_eagle_common_hit` with EAGLE, else `_longest_common_hit`.

        Complexity: O(len(lookup) * groups) lookups per pass; a pass after the first only when
        a windowed or chunked group shortened the hit.
        """
        if self.use_eagle:
            return self._eagle_common_hit(len(lookup), block_hashes)
        return self._longest_common_hit(lookup)

    def junction(
        self, num_hits: int, lookup: list[BlockHashType], block_hashes: list[BlockHashType]
    ) -> int:
        """Where the hit of the unit looked up first (vLLM 0.33's first attention group: the
        groups of the first full-attention group's spec, else of group 0's) ends, in tokens,
        when the common hit of `num_hits` blocks is shorter; else 0. Found as the common hit
        finds it first: within `lookup`, or with EAGLE `for_eagle` within one block more (at
        most `block_hashes`) less its last block.

        Complexity: O(len(lookup) * groups of the unit) lookups.
        """
        unit = self._eagle_units[0]
        if self.use_eagle:
            limit = min(len(lookup) + 1, len(block_hashes))
            found = len(self._unit_hit(unit, block_hashes, limit, True)[0]) - 1
        else:
            found = len(self._unit_hit(unit, lookup, len(lookup), False)[0])
        return found * unit.manager.block_size if found > num_hits else 0

    def _longest_common_hit(self, block_hashes: list[BlockHashType]) -> GroupBlocks:
        """Each group's hit at the longest length L (in blocks) every group allows.

        Whether a group allows L depends on L alone (every block of [0, L) cached under full
        attention; the last window's or the last chunk's blocks otherwise), and each group's
        `find_longest_cache_hit` gives the longest L it allows within the hashes it is given.
        Full attention allows every L up to its cached prefix, so its groups scan once and are
        trimmed at the end; the others are asked again, for the current L, until none shortens
        it. A group whose last answer is the current L still allows it and is not asked again.
        """
        managers = self.single_type_managers
        hits: list[list[KVCacheBlock]] = [[] for _ in managers]
        length = len(block_hashes)
        for group in self._full_groups:
            hits[group] = managers[group].find_longest_cache_hit(
                block_hashes if length == len(block_hashes) else block_hashes[:length]
            )
            length = len(hits[group])
        answered = [-1] * len(managers)  # the length of each group's hit, once asked
        settled = False
        while not settled:
            settled = True
            for group in self._skipping_groups:
                if answered[group] == length:
                    continue
                hit = managers[group].find_longest_cache_hit(
                    block_hashes if length == len(block_hashes) else block_hashes[:length]
                )
                hits[group] = hit
                answered[group] = len(hit)
                if len(hit) < length:
                    length = len(hit)
                    settled = False
        for group in self._full_groups:
            del hits[group][length:]
        return tuple(hits)

    def mixed_hit(
        self, lookup: list[BlockHashType], hash_block_size: int, scheduler_block_size: int
    ) -> tuple[int, GroupBlocks]:
        """The hit of groups of several block sizes (caching on, no EAGLE) within the chain
        `lookup` (hashes at `hash_block_size` H), in tokens, with each group's blocks: as
        `_longest_common_hit`, in tokens, each group reading its view of the chain (the hash
        at each of its block ends) and each hit rounded down to `scheduler_block_size` S (full
        attention's cut there; a window's or chunk's, of S-token blocks, ends there already).

        Complexity: O(len(lookup) * groups) lookups per pass, as `_longest_common_hit`.
        """
        managers = self.single_type_managers
        views = [group_view(lookup, manager.block_size, hash_block_size) for manager in managers]
        hits: list[list[KVCacheBlock]] = [[] for _ in managers]
        length = len(lookup) * hash_block_size
        length -= length % scheduler_block_size
        for group in self._full_groups:
            block_size = managers[group].block_size
            hit = managers[group].find_longest_cache_hit(views[group][: length // block_size])
            found = len(hit) * block_size
            length = found - found % scheduler_block_size
            hits[group] = hit
        answered = [-1] * len(managers)  # the tokens of each group's hit, once asked
        settled = False
        while not settled:
            settled = True
            for group in self._skipping_groups:
                if answered[group] == length:
                    continue
                block_size = managers[group].block_size
                hit = managers[group].find_longest_cache_hit(views[group][: length // block_size])
                hits[group] = hit
                answered[group] = len(hit) * block_size
                if answered[group] < length:
                    length = answered[group]
                    settled = False
        for group in self._full_groups:
            del hits[group][length // managers[group].block_size :]
        return length, tuple(hits)

    def mixed_junction(
        self,
        length: int,
        lookup: list[BlockHashType],
        hash_block_size: int,
        scheduler_block_size: int,
    ) -> int:
        """`junction` for groups of several block sizes (no EAGLE), in tokens: the first
        unit's hit within `lookup`, rounded down to S, where it is longer than the common hit
        of `length` tokens; else 0. Complexity: O(len(lookup) * groups of the unit)."""
        unit = self._eagle_units[0]
        block_size = unit.manager.block_size
        view = group_view(lookup, block_size, hash_block_size)
        found = len(self._unit_hit(unit, view, len(view), False)[0]) * block_size
        found -= found % scheduler_block_size
        return found if found > length else 0

    def _eagle_common_hit(self, num_lookup: int, block_hashes: list[BlockHashType]) -> GroupBlocks:
        """The hit with EAGLE, as vLLM 0.33's coordinator finds it (the spec's
        `eagle_common_hit` states the steps): units of equal specs looked up together, full
        attention first; passes until none shortens the length; a unit not yet asked at this
        length finds its hit `for_eagle` within one block more and drops the last block; a
        unit asked already finds its own hit within the length, and if it shortens it every
        unit is asked anew.
        """
        units = self._eagle_units
        found: list[list[list[KVCacheBlock]] | None] = [None] * len(units)
        verified: set[int] = set()
        single_pass = len(units) == 2 and units[0].full
        length = num_lookup
        while True:
            current = length
            for index, unit in enumerate(units):
                hits = found[index]
                if unit.full and hits is not None:
                    current = min(current, len(hits[0]))
                    continue
                if index not in verified:
                    limit = min(current + 1, len(block_hashes))
                    hits = self._unit_hit(unit, block_hashes, limit, True)
                    if hits[0]:  # EAGLE recomputes the last matched block
                        for group_hits in hits:
                            group_hits.pop()
                    verified.add(index)
                else:
                    hits = self._unit_hit(unit, block_hashes, current, False)
                    if len(hits[0]) < current:
                        verified.clear()
                current = len(hits[0])
                found[index] = hits
            if current >= length or single_pass:
                length = current
                break
            length = current
        result: list[list[KVCacheBlock]] = [[] for _ in self.single_type_managers]
        for unit, hits in zip(units, found, strict=True):
            assert hits is not None
            for group, group_hits in zip(unit.groups, hits, strict=True):
                result[group] = group_hits[:length] if unit.full else group_hits
        return tuple(result)

    def _unit_hit(
        self,
        unit: _LookupUnit,
        block_hashes: list[BlockHashType],
        num_blocks: int,
        for_eagle: bool,
    ) -> list[list[KVCacheBlock]]:
        """The unit's hit within the first `num_blocks` hashes (`for_eagle` or not), a position
        counting as cached only if it is in every group of the unit; each group's blocks."""
        managers = self.single_type_managers
        groups = unit.groups

        def cached_in_every_group(i: int) -> list[KVCacheBlock] | None:
            blocks = []
            for group in groups:
                block = managers[group].cached_block(block_hashes[i])
                if block is None:
                    return None
                blocks.append(block)
            return blocks

        null = [self.block_pool.null_block] * len(groups)
        hit = unit.manager.scan_hit(num_blocks, cached_in_every_group, null, for_eagle)
        return [[blocks[k] for blocks in hit] for k in range(len(groups))]


def kv_cache_coordinator(
    specs: Sequence[KVCacheSpec],
    block_pool: BlockPool,
    use_eagle: bool,
    eagle_lookup: bool,
    retention_interval: int | None = None,
    alignment: int | None = None,
) -> KVCacheCoordinator:
    """The coordinator of these groups: unitary for one, hybrid for several (`alignment`:
    S for groups of several block sizes with caching, which are several).

    Raises:
        KVCacheConfigError: as `KVCacheCoordinator`.

    Complexity: O(groups).
    """
    if len(specs) == 1:
        return UnitaryKVCacheCoordinator(
            specs, block_pool, use_eagle, eagle_lookup, retention_interval
        )
    return HybridKVCacheCoordinator(
        specs, block_pool, use_eagle, eagle_lookup, retention_interval, alignment
    )
