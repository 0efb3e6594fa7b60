"""The block pool as a finite world: a spec pool and a pool under test, and every call on them.

The driver owns every reference the pool hands out, so its state is the pool's: no other
bookkeeping. Calls (each a transition, applied to both pools in lock-step):

- `get_new_blocks(n)` for every n from 0 to the free count; misuse: one more, and -1;
- `touch(ids)` for every list of up to `max_touch_len` pool ids (the null block included) that
  keeps each ref_cnt <= `max_ref_cnt` (ref counts are capped so that the state space is finite);
  misuse: an id outside the pool, and a valid id followed by one (nothing may change);
- `free_blocks(ids)` for every ordering of every set of up to `max_free_len` held blocks; misuse:
  a block twice, a free block after a held one, an id outside the pool; the null block (passed
  over) alone and after a held block;
- `cache_full_blocks` of every ordered choice of held unhashed blocks (and the null block) for the
  full blocks of each fixed prompt, with the hashes computed or already stored, and extending a
  cached parent by one block; misuse: a free block, a hashed block, a block twice, more full
  blocks than blocks, more than the prompt's full blocks, a parent without a hash;
- `get_cached_block(h)` for every hash of the prompts and one made-up hash;
- `reset_prefix_cache()`.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

from pagedkv.harness.adapters import pagedkv_pool, spec_pool
from pagedkv.harness.client.catalog import side_name
from pagedkv.harness.comparison import ComparedPair
from pagedkv.harness.divergence import Divergence, operation_of
from pagedkv.harness.probes import pool_probe
from pagedkv.harness.protocol import PoolFactory, PoolSnapshot, PoolUnderTest
from pagedkv.spec.block_hash import request_block_hashes
from pagedkv.spec.block_pool import NULL_BLOCK_ID
from pagedkv.spec.semantics import PAGEDKV_SEMANTICS
from pagedkv.vocab.hashes import BlockHashType, HashFn, get_hash_fn
from pagedkv.vocab.request import Request
from pagedkv.vocab.semantics import Semantics
from proofs.exhaustive.fingerprint import fingerprint
from proofs.exhaustive.search import Frozen, Transition, World, freeze, thaw


@dataclass(frozen=True)
class PoolSearchConfig:
    """One pool configuration to search exhaustively.

    Attributes:
        num_blocks: blocks in the pool, the null block included.
        block_size: tokens per block, for hashing the prompts.
        prompts: token lists whose full blocks `cache_full_blocks` hashes (request "p0", ...).
        enable_caching: prefix caching on or off.
        max_ref_cnt: no call takes a block's ref_cnt above this.
        max_free_len: longest list given to `free_blocks` (every order of every set).
        max_touch_len: longest list given to `touch`.
        misuse: include calls that break a precondition (each must fail and change nothing).
        semantics: pagedkv's or vLLM 0.8.5's side of the deliberate differences.
        hash_algo: "sha256" or "builtin".
    """

    num_blocks: int
    block_size: int
    prompts: tuple[tuple[int, ...], ...]
    enable_caching: bool = True
    max_ref_cnt: int = 2
    max_free_len: int = 2
    max_touch_len: int = 1
    misuse: bool = True
    semantics: Semantics = PAGEDKV_SEMANTICS
    hash_algo: str = "sha256"

    @property
    def name(self) -> str:
        caching = "caching" if self.enable_caching else "no-caching"
        flags = "".join(
            f" {flag}"
            for flag, on in (
                ("no-misuse", not self.misuse),
                (self.semantics.name, self.semantics != PAGEDKV_SEMANTICS),
            )
            if on
        )
        prompts = " ".join("".join(map(str, p)) for p in self.prompts)
        return (
            f"pool N={self.num_blocks} B={self.block_size} {caching} prompts=[{prompts}] "
            f"ref<={self.max_ref_cnt} free<={self.max_free_len} touch<={self.max_touch_len}"
            f"{flags}"
        )


@dataclass(frozen=True)
class _Prompt:
    """A fixed request and the chain of its full-block hashes."""

    name: str
    request: Request = field(compare=False)
    hashes: tuple[BlockHashType, ...]


class PoolWorld:
    """A state of the pool search (see the module docstring for the transitions)."""

    def __init__(
        self,
        pair: ComparedPair[PoolUnderTest],
        config: PoolSearchConfig,
        prompts: tuple[_Prompt, ...],
        hash_fn: HashFn,
    ) -> None:
        self.pair = pair
        self.config = config
        self.prompts = prompts
        self.hash_fn = hash_fn

    def dump(self) -> Frozen:
        return freeze(self.pair)

    def load(self, frozen: Frozen, state: PoolSnapshot) -> PoolWorld:
        # The configuration, prompts and hash function never change: they are shared.
        pair: ComparedPair[PoolUnderTest] = thaw(frozen)
        pair.state = state
        return PoolWorld(pair, self.config, self.prompts, self.hash_fn)

    def key(self) -> Hashable:
        return pool_key(self.pair.state), fingerprint(self.pair.impl)

    # -- transitions -------------------------------------------------------------------------

    def transitions(self) -> Sequence[Transition]:
        state: PoolSnapshot = self.pair.state
        config = self.config
        steps: list[Transition] = []
        steps += self._get_new_blocks(state)
        steps += self._touches(state)
        steps += self._frees(state)
        if config.enable_caching:
            steps += self._caches(state)
        elif config.misuse and self.prompts:
            prompt = self.prompts[0]
            steps.append(self._cache(prompt, (1,), (), 0, 1))
        steps += self._lookups()
        steps.append(_call("reset_prefix_cache()", lambda pool: pool.reset_prefix_cache()))
        return steps

    def _get_new_blocks(self, state: PoolSnapshot) -> list[Transition]:
        counts = list(range(state.num_free_blocks + 1))
        if self.config.misuse:
            counts += [state.num_free_blocks + 1, -1]
        return [_get_new_blocks(n) for n in counts]

    def _touches(self, state: PoolSnapshot) -> list[Transition]:
        config = self.config
        steps = []
        ids = range(config.num_blocks)
        # Under vLLM semantics the null block's ref_cnt moves too: cap it like any other.
        refcounted_null = config.semantics.null_block_refcounted
        for length in range(1, config.max_touch_len + 1):
            for block_ids in itertools.product(ids, repeat=length):
                if all(
                    (block_id == NULL_BLOCK_ID and not refcounted_null)
                    or state.ref_cnt[block_id] + block_ids.count(block_id) <= config.max_ref_cnt
                    for block_id in block_ids
                ):
                    steps.append(_touch(block_ids))
        if config.misuse:
            steps += [_touch((config.num_blocks,)), _touch((-1,))]
            steps.append(_touch((1, config.num_blocks)))
        return steps

    def _frees(self, state: PoolSnapshot) -> list[Transition]:
        config = self.config
        held = [b for b in range(1, config.num_blocks) if state.ref_cnt[b] > 0]
        free = [b for b in range(1, config.num_blocks) if state.ref_cnt[b] == 0]
        releasable = list(held)
        if config.semantics.null_block_refcounted and state.ref_cnt[NULL_BLOCK_ID] > 0:
            releasable.insert(0, NULL_BLOCK_ID)  # vLLM counts the null block's references too
        steps = []
        for length in range(1, min(config.max_free_len, len(releasable)) + 1):
            steps += [_free(order) for order in itertools.permutations(releasable, length)]
        if config.misuse and not config.semantics.null_block_refcounted:
            steps += [_free((NULL_BLOCK_ID,)), _free((config.num_blocks,))]
            if held:
                steps += [_free((held[0], held[0])), _free((held[0], NULL_BLOCK_ID))]
                if free:
                    steps.append(_free((held[0], free[0])))
            elif free:
                steps.append(_free((free[0],)))
        return steps

    def _caches(self, state: PoolSnapshot) -> list[Transition]:
        config = self.config
        held_unhashed = [
            b
            for b in range(1, config.num_blocks)
            if state.ref_cnt[b] > 0 and state.block_hash[b] is None
        ]
        candidates = [NULL_BLOCK_ID, *held_unhashed]
        steps = []
        for prompt in self.prompts:
            num_full = len(prompt.hashes)
            for length in range(1, num_full + 1):
                for block_ids in itertools.permutations(candidates, length):
                    steps.append(self._cache(prompt, block_ids, (), 0, length))
                    steps.append(self._cache(prompt, block_ids, prompt.hashes, 0, length))
            # Extend a cached parent by one block: the parent's hash is stored, the new computed.
            for position in range(1, num_full):
                parents = state.index.get(prompt.hashes[position - 1], ())
                for parent in parents:
                    for block_id in held_unhashed:
                        block_ids = (NULL_BLOCK_ID,) * (position - 1) + (parent, block_id)
                        stored = prompt.hashes[:position]
                        steps.append(self._cache(prompt, block_ids, stored, position, position + 1))
        if config.misuse and self.prompts:
            steps += self._bad_caches(state, held_unhashed)
        return steps

    def _bad_caches(self, state: PoolSnapshot, held_unhashed: list[int]) -> list[Transition]:
        config = self.config
        prompt = self.prompts[0]
        num_full = len(prompt.hashes)
        free = [b for b in range(1, config.num_blocks) if state.ref_cnt[b] == 0]
        hashed = [b for b in range(1, config.num_blocks) if state.block_hash[b] is not None]
        steps = []
        if free:
            steps.append(self._cache(prompt, (free[0],), (), 0, 1))  # a free block
        if hashed:
            steps.append(self._cache(prompt, (hashed[0],), (), 0, 1))  # already hashed
        if held_unhashed:
            first = held_unhashed[0]
            steps.append(self._cache(prompt, (first,), (), 0, 2))  # more full blocks than blocks
            if num_full >= 2:
                steps.append(self._cache(prompt, (first, first), (), 0, 2))  # a block twice
            beyond = (NULL_BLOCK_ID,) * num_full + (first,)
            steps.append(self._cache(prompt, beyond, (), 0, num_full + 1))  # past the prompt
            unhashed_parent = [b for b in held_unhashed if b != first]
            if unhashed_parent and num_full >= 2:
                parent = unhashed_parent[0]
                steps.append(self._cache(prompt, (parent, first), prompt.hashes[:1], 1, 2))
        return steps

    def _cache(
        self,
        prompt: _Prompt,
        block_ids: tuple[int, ...],
        stored: tuple[BlockHashType, ...],
        num_cached: int,
        num_full: int,
    ) -> Transition:
        label = (
            f"cache_full_blocks({prompt.name}, {list(block_ids)}, "
            f"stored={len(stored)}, num_cached={num_cached}, num_full={num_full})"
        )
        block_size = self.config.block_size
        hash_fn = self.hash_fn
        request = prompt.request

        def run(world: World) -> None:
            hashes = {"spec": list(stored), "impl": list(stored)}
            spec = world.pair.spec

            def call(pool: PoolUnderTest) -> None:
                pool.cache_full_blocks(
                    request,
                    block_ids,
                    hashes[side_name(pool, spec)],
                    num_cached,
                    num_full,
                    block_size,
                    hash_fn,
                )

            world.pair.call("cache_full_blocks", call, lambda: label)
            if hashes["spec"] != hashes["impl"]:
                raise Divergence(
                    f"{label}: stored hashes differ: spec {hashes['spec']}, impl {hashes['impl']}",
                    "state",
                    "cache_full_blocks",
                    "stored hashes",
                )
            world.pair.end_step()

        return Transition(label, run)

    def _lookups(self) -> list[Transition]:
        made_up = BlockHashType(0, (0,) * self.config.block_size, None)
        named = [
            (f"h({prompt.name}, {position})", block_hash)
            for prompt in self.prompts
            for position, block_hash in enumerate(prompt.hashes)
        ]
        named.append(("h(made-up)", made_up))
        seen: set[BlockHashType] = set()
        steps = []
        for name, block_hash in named:
            if block_hash in seen:
                continue  # prompts that share a block share its hash
            seen.add(block_hash)
            steps.append(_lookup(name, block_hash))
        return steps


def pool_key(state: PoolSnapshot) -> Hashable:
    """Everything in a pool snapshot that can change what happens next."""
    return (
        state.free_order,
        state.ref_cnt,
        state.block_hash,
        frozenset(state.index.items()),
    )


def initial_pool_world(factory: PoolFactory, config: PoolSearchConfig) -> PoolWorld:
    """A fresh spec pool and a fresh `factory` pool, agreed on their initial state."""
    hash_fn = get_hash_fn(config.hash_algo)
    prompts = tuple(
        _Prompt(
            f"p{number}",
            request := Request(f"p{number}", tokens),
            tuple(request_block_hashes(hash_fn, config.block_size, request)),
        )
        for number, tokens in enumerate(config.prompts)
    )
    spec = spec_pool(config.num_blocks, config.enable_caching, config.semantics)
    impl = factory(config.num_blocks, config.enable_caching, config.semantics)
    pair: ComparedPair[PoolUnderTest] = ComparedPair(
        spec, impl, pool_probe, check_every=1, same_messages=factory is pagedkv_pool
    )
    pair.full_check("the initial state")
    return PoolWorld(pair, config, prompts, hash_fn)


# -- single calls ----------------------------------------------------------------------------


def _call(label: str, call: Callable[[PoolUnderTest], object]) -> Transition:
    """One call on both pools (full mode: whole snapshots and invariants after it)."""

    def run(world: World) -> None:
        world.pair.call(operation_of(label), call, lambda: label)
        world.pair.end_step()

    return Transition(label, run)


def _get_new_blocks(num_blocks: int) -> Transition:
    return _call(f"get_new_blocks({num_blocks})", lambda pool: pool.get_new_blocks(num_blocks))


def _touch(block_ids: tuple[int, ...]) -> Transition:
    return _call(f"touch({list(block_ids)})", lambda pool: pool.touch(block_ids))


def _free(block_ids: tuple[int, ...]) -> Transition:
    return _call(f"free_blocks({list(block_ids)})", lambda pool: pool.free_blocks(block_ids))


def _lookup(name: str, block_hash: BlockHashType) -> Transition:
    return _call(f"get_cached_block({name})", lambda pool: pool.get_cached_block(block_hash))
