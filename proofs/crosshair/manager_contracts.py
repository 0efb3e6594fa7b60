"""Contracts on `KVCacheManager.allocate_slots` itself, for CrossHair.

The pure-function contracts (`contracts.py`) check the arithmetic `allocate_slots` calls; they
cannot see a mistake in how `allocate_slots` combines it (passing no speculative tokens to
`num_full_blocks`, forgetting the lookahead, freeing one window block too few). These contracts
build a real `KVCacheManager` from small symbolic ints (block size, pool size, prompt length,
shared blocks, draft tokens, lookahead, window), drive it to a state with public calls (admit a
prompt, maybe with the prefix hits another request left), make one more `allocate_slots` call,
and state what must hold afterwards in terms of the inputs only:

- it returns None exactly when the blocks it needs do not fit in the free blocks (after the
  blocks the window dropped are freed, and without the hits that leave the free queue);
- the request then holds exactly cdiv(computed + scheduled + lookahead, B) blocks, its hits
  first, and the free count fell by exactly the blocks it took;
- exactly the full blocks of real tokens are cached, (computed + scheduled - drafts) // B, each
  under the hash its tokens chain to (`hash_request_tokens`), and no block after them is hashed;
- under a sliding window exactly the blocks wholly before token computed - W + 1 are the null
  block, and no other;
- a refused call (None) changes nothing.

Any refactor of `allocate_slots` (its planning step, the decode fast path) stays covered: the
contracts call the public method and look only at the manager's observable state. Scope: the
bounds of each contract's leading asserts (tiny, so CrossHair's path search reaches them all).
"""

from __future__ import annotations

from pagedkv.block_hash import hash_request_tokens
from pagedkv.harness.swarm.runs import attention_spec
from pagedkv.manager import KVCacheManager
from pagedkv.single_type import SingleTypeKVCacheManager
from pagedkv.vocab.kv_cache_interface import uniform_kv_cache_config
from pagedkv.vocab.request import Request
from proofs.crosshair.contracts import Contract

MAX_BLOCK_SIZE = 4
MAX_POOL = 8
MAX_PROMPT = 12
MAX_DRAFTS = 3
MAX_LOOKAHEAD = 5
MAX_MODEL_LEN = 64


def _manager(block_size: int, num_blocks: int, window: int, use_eagle: bool) -> KVCacheManager:
    """A manager with builtin hashing (CrossHair cannot see through sha256); window 0: full."""
    spec = attention_spec(block_size, window or None)
    return KVCacheManager(
        uniform_kv_cache_config(spec, num_blocks),
        MAX_MODEL_LEN,
        caching_hash_algo="builtin",
        use_eagle=use_eagle,
    )


def _group(manager: KVCacheManager) -> SingleTypeKVCacheManager:
    """The manager's one KV cache group (its per-type manager: block lists, cached counts)."""
    (group,) = manager.coordinator.single_type_managers
    return group


def _skipped(num_computed_tokens: int, window: int, block_size: int, num_blocks: int) -> int:
    """Leading blocks wholly before token num_computed_tokens - W + 1 (0 under full attention),
    counted from the definition, block by block."""
    if window == 0:
        return 0
    first_seen = num_computed_tokens - window + 1
    return sum(1 for p in range(num_blocks) if (p + 1) * block_size <= first_seen)


def _check_after(
    manager: KVCacheManager,
    request: Request,
    new: list[object],
    *,
    computed: int,
    scheduled: int,
    drafts: int,
    lookahead: int,
    window: int,
) -> None:
    """The postconditions of a successful allocate_slots on the request's blocks and hashes
    (module docstring); the callers check the free count."""
    block_size = manager.block_size
    pool = manager.block_pool
    blocks = _group(manager).req_to_blocks[request.request_id]
    required = -(-(computed + scheduled + lookahead) // block_size)
    assert len(blocks) == required, "the request does not hold exactly the blocks it needs"
    assert new == blocks[len(blocks) - len(new) :], "new blocks are not appended last"
    num_full = (computed + scheduled - drafts) // block_size
    assert _group(manager).num_cached_block[request.request_id] == num_full, "wrong blocks cached"
    chain = hash_request_tokens(manager.caching_hash_fn, block_size, request)
    null = pool.null_block
    for position, block in enumerate(blocks):
        if block is null:
            continue
        if position < num_full:
            assert block.block_hash == chain[position], "a full block under the wrong hash"
        else:
            assert block.block_hash is None, "a block past the full ones is hashed"
    skipped = _skipped(request.num_computed_tokens, window, block_size, len(blocks))
    nulls = [position for position, block in enumerate(blocks) if block is null]
    assert nulls == list(range(skipped)), "the window dropped the wrong blocks"


def contract_decode_step(
    block_size: int,
    num_blocks: int,
    prompt_len: int,
    num_drafts: int,
    lookahead: int,
    window: int,
) -> None:
    """A decode step with draft tokens and lookahead slots after a whole prefill, under full
    attention (window 0) or a sliding window."""
    assert 1 <= block_size <= MAX_BLOCK_SIZE
    assert 2 <= num_blocks <= MAX_POOL
    assert 1 <= prompt_len <= MAX_PROMPT
    assert 0 <= num_drafts <= MAX_DRAFTS
    assert 0 <= lookahead <= MAX_LOOKAHEAD
    assert 0 <= window <= 2 * MAX_BLOCK_SIZE + 1
    manager = _manager(block_size, num_blocks, window, False)
    request = Request("r", [position % 2 for position in range(prompt_len)])
    if manager.allocate_slots(request, prompt_len) is None:
        return  # the prompt alone does not fit
    request.num_computed_tokens = prompt_len
    request.append_output_token_ids(1)
    request.spec_token_ids = [0] * num_drafts
    pool = manager.block_pool
    free_before = pool.get_num_free_blocks()
    held = list(_group(manager).req_to_blocks["r"])
    scheduled = 1 + num_drafts
    freed = sum(
        1
        for block in held[: _skipped(prompt_len, window, block_size, len(held))]
        if block is not pool.null_block
    )
    required = -(-(prompt_len + scheduled + lookahead) // block_size)
    allocated = manager.allocate_slots(request, scheduled, None, lookahead)
    if allocated is None:
        assert required - len(held) > free_before + freed, "refused although it fits"
        assert pool.get_num_free_blocks() == free_before + freed, "a refusal took blocks"
        return
    assert required - len(held) <= free_before + freed, "allocated although it does not fit"
    (new,) = allocated
    assert pool.get_num_free_blocks() == free_before + freed - len(new), "free count off"
    _check_after(
        manager,
        request,
        list(new),
        computed=prompt_len,
        scheduled=scheduled,
        drafts=num_drafts,
        lookahead=lookahead,
        window=window,
    )


def contract_admission_with_hits(
    block_size: int,
    num_blocks: int,
    shared_blocks: int,
    extra_tokens: int,
    lookahead: int,
    first_freed: bool,
    use_eagle: bool,
) -> None:
    """A second request admitted with the prefix hits the first one left (still running, or
    freed: then its hits sit in the free queue and touching takes them out), with lookahead."""
    assert 1 <= block_size <= MAX_BLOCK_SIZE
    assert 2 <= num_blocks <= MAX_POOL
    assert 1 <= shared_blocks <= 3
    assert 0 <= extra_tokens <= 2 * MAX_BLOCK_SIZE
    assert 0 <= lookahead <= MAX_LOOKAHEAD
    manager = _manager(block_size, num_blocks, 0, use_eagle)
    shared = [position % 3 for position in range(shared_blocks * block_size)]
    first = Request("a", [*shared, 2])
    if manager.allocate_slots(first, first.num_tokens) is None:
        return
    first.num_computed_tokens = first.num_tokens
    if first_freed:
        manager.free(first)
    second = Request("b", [*shared, *([1] * extra_tokens)])
    (hits,), num_hit_tokens = manager.get_computed_blocks(second)
    pool = manager.block_pool
    assert num_hit_tokens == len(hits) * block_size
    assert len(hits) <= shared_blocks and num_hit_tokens < second.num_tokens
    free_hits = sum(1 for block in hits if block.ref_cnt == 0)
    ref_cnt_before = [block.ref_cnt for block in hits]
    free_before = pool.get_num_free_blocks()
    scheduled = second.num_tokens - num_hit_tokens
    required = -(-(second.num_tokens + lookahead) // block_size)
    allocated = manager.allocate_slots(second, scheduled, (hits,), lookahead)
    if allocated is None:
        assert required - len(hits) > free_before - free_hits, "refused although it fits"
        assert [block.ref_cnt for block in hits] == ref_cnt_before, "a refusal touched hits"
        assert pool.get_num_free_blocks() == free_before, "a refusal took blocks"
        assert "b" not in _group(manager).req_to_blocks, "a refusal gave the request blocks"
        return
    assert required - len(hits) <= free_before - free_hits, "allocated although it does not fit"
    (new,) = allocated
    blocks = _group(manager).req_to_blocks["b"]
    assert blocks[: len(hits)] == hits, "the hits are not the request's first blocks"
    assert [block.ref_cnt for block in hits] == [n + 1 for n in ref_cnt_before], "hits untouched"
    assert pool.get_num_free_blocks() == free_before - free_hits - len(new), "free count off"
    _check_after(
        manager,
        second,
        list(new),
        computed=num_hit_tokens,
        scheduled=scheduled,
        drafts=0,
        lookahead=lookahead,
        window=0,
    )


def contract_window_steps(block_size: int, window: int, prompt_len: int, num_steps: int) -> None:
    """Decode steps one token at a time under a sliding window: after each, exactly the blocks
    wholly before the window of the next token are the null block (and were freed)."""
    assert 1 <= block_size <= MAX_BLOCK_SIZE
    assert 1 <= window <= 3 * MAX_BLOCK_SIZE
    assert 1 <= prompt_len <= MAX_PROMPT
    assert 1 <= num_steps <= 2 * MAX_BLOCK_SIZE
    manager = _manager(block_size, MAX_POOL * 2, window, False)
    request = Request("r", [0] * prompt_len)
    assert manager.allocate_slots(request, prompt_len) is not None  # the pool holds it
    request.num_computed_tokens = prompt_len
    request.append_output_token_ids(1)
    pool = manager.block_pool
    for _ in range(num_steps):
        free_before = pool.get_num_free_blocks()
        held = _group(manager).req_to_blocks["r"]
        skipped = _skipped(request.num_computed_tokens, window, block_size, len(held))
        freed = sum(1 for block in held[:skipped] if block is not pool.null_block)
        allocated = manager.allocate_slots(request, 1)
        assert allocated is not None, "a decode step of a lone request did not fit"
        (new,) = allocated
        assert pool.get_num_free_blocks() == free_before + freed - len(new), "free count off"
        _check_after(
            manager,
            request,
            list(new),
            computed=request.num_computed_tokens,
            scheduled=1,
            drafts=0,
            lookahead=0,
            window=window,
        )
        request.num_computed_tokens += 1
        request.append_output_token_ids(0)
    held = _group(manager).req_to_blocks["r"]
    in_use = sum(1 for block in pool.blocks if block.ref_cnt > 0 and block is not pool.null_block)
    assert in_use == sum(1 for block in held if block is not pool.null_block), "a block leaked"


CONTRACTS: tuple[Contract, ...] = (
    Contract(
        contract_decode_step,
        ((2, 8, 5, 2, 3, 0), (1, 4, 3, 1, 1, 2), (4, 6, 9, 3, 5, 5), (3, 2, 1, 0, 0, 0)),
    ),
    Contract(
        contract_admission_with_hits,
        ((2, 8, 2, 3, 1, False, False), (1, 4, 1, 0, 2, True, True), (4, 8, 1, 4, 5, True, False)),
    ),
    Contract(contract_window_steps, ((2, 3, 4, 6), (1, 1, 1, 3), (4, 9, 12, 8))),
)
"""The manager contracts the runner checks (`python -m proofs.crosshair`)."""
