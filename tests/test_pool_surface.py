"""The manager talks to its pool through a named surface, and touches no other object's privates.

The manager's modules (`pagedkv.manager`, its coordinators `pagedkv.kv_cache_coordinator` and the
per-type managers of `pagedkv.single_type`) may use a private member (`_name`) of `self` only:
never of their pool, a block, the free queue or a request. Of its pool they use, together,
exactly `POOL_SURFACE`, which `BlockPool` documents: every ref_cnt, free-queue and index write
happens behind it, inside the pool.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

from pagedkv.block_pool import BlockPool

IMPL = Path(__file__).resolve().parent.parent / "impl"
MANAGER_MODULES = (
    IMPL / "manager.py",
    IMPL / "kv_cache_coordinator.py",
    *sorted((IMPL / "single_type").glob("*.py")),
)
"""The modules of the manager: the front, its coordinators, the per-type managers."""

POOL_SURFACE = frozenset(
    {
        # the call token the manager shares, and what it calls while holding it
        "share_call_token",
        "get_new_blocks_locked",
        "touch_owned_locked",
        "free_blocks_locked",
        "cache_full_blocks_locked",
        "intern_hashes_locked",
        "check_hits_locked",
        "add_partial_key_locked",
        "reset_prefix_cache_locked",
        "evict_blocks_locked",
        "check_invariants_locked",
        # the decode fast path: the whole change, or nothing changed and the full path runs
        "cache_next_full_block_locked",
        "append_new_block_locked",
        # public calls that take the token themselves (the manager does not hold it then)
        "take_events",
        # queries and read-only attributes (a lookup reads the index, block by block)
        "get_usage",
        "get_num_free_blocks",
        "cached_block",
        "cached_block_hash_to_block",
        "blocks",
        "null_block",
    }
)
"""What the manager's modules use of their `BlockPool`, together, by name."""

POOL = "self.block_pool"


def private_uses(source: str) -> list[str]:
    """Each use of a private member (`_name`, not a dunder) of another object than `self`, as
    `line: expression`, with `getattr`/`setattr`/`delattr` by a constant name included."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.expr):
            continue
        name: str | None = None
        if isinstance(node, ast.Attribute):
            receiver_is_self = isinstance(node.value, ast.Name) and node.value.id == "self"
            name = None if receiver_is_self else node.attr
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "setattr", "delattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
        ):
            name = node.args[1].value
        if name and name.startswith("_") and not (name.startswith("__") and name.endswith("__")):
            found.append((node.lineno, ast.unparse(node)))
    return [f"{line}: {expression}" for line, expression in sorted(found)]


def pool_members_used(source: str) -> set[str]:
    """The members read of `self.block_pool`, directly or through a local bound to it."""
    tree = ast.parse(source)
    aliases: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and ast.unparse(node.value) == POOL:
            aliases.update(target.id for target in node.targets if isinstance(target, ast.Name))
    used = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            receiver = node.value
            if ast.unparse(receiver) == POOL or (
                isinstance(receiver, ast.Name) and receiver.id in aliases
            ):
                used.add(node.attr)
    return used


def test_the_manager_touches_no_private_member_of_another_object() -> None:
    for module in MANAGER_MODULES:
        assert private_uses(module.read_text()) == [], module.name


def test_the_manager_uses_exactly_the_named_pool_surface() -> None:
    used = set()
    for module in MANAGER_MODULES:
        in_module = pool_members_used(module.read_text())
        assert in_module <= POOL_SURFACE, (module.name, sorted(in_module - POOL_SURFACE))
        used |= in_module
    assert used == POOL_SURFACE


def test_the_pool_surface_is_public_and_documented() -> None:
    pool = BlockPool(4, enable_caching=True)
    for name in sorted(POOL_SURFACE):
        assert not name.startswith("_")
        member = inspect.getattr_static(BlockPool, name, None)
        if member is None:  # an attribute set by the constructor
            assert hasattr(pool, name), name
            continue
        doc = inspect.getdoc(member) or ""
        assert doc, f"BlockPool.{name} has no docstring"
        assert "Complexity:" in doc, f"BlockPool.{name}'s docstring states no complexity"


def test_the_checks_see_what_they_forbid() -> None:
    source = """
def f(self, request, block):
    pool = self.block_pool
    self._private_of_self()
    pool.free_block_queue.popleft()
    pool._free_blocks([block])
    request._all_token_ids
    getattr(block, "_block_hash")
    type(block).__name__
    self.block_pool._idle.pop()
"""
    assert private_uses(source) == [
        "6: pool._free_blocks",
        "7: request._all_token_ids",
        "8: getattr(block, '_block_hash')",
        "10: self.block_pool._idle",
    ]
    assert pool_members_used(source) == {"free_block_queue", "_free_blocks", "_idle"}
