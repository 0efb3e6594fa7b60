"""Exhaustive state search: every reachable state of tiny pools and managers, spec vs impl.

`explore_pool(factory, config)` and `explore_manager(factory, config)` search one configuration
breadth first (`search.py`), the object built by `factory` replaying every call of the spec
in lock-step (`pool_world.py`, `manager_world.py` list the calls). At every state both
invariant checks pass and the snapshots are equal; every failed call fails the same way on both
sides and changes nothing. A failure comes with the shortest trace that reaches it.

    python -m proofs.exhaustive [--scope ci|nightly|large] [--layer pool|manager|all]
                                [--impl MODULE:FACTORY] [--manager-impl MODULE:FACTORY]

Exit status: 0 when every configuration of the scope was searched completely and nothing failed,
1 when a search failed or stopped at its state limit, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from pagedkv.harness.adapters import load_factory, pagedkv_manager, pagedkv_pool
from pagedkv.harness.comparison import quiet_refusal_warnings
from pagedkv.harness.protocol import ManagerFactory, PoolFactory
from pagedkv.vocab.semantics import VLLM_0_8_5
from proofs.exhaustive.manager_world import (
    ManagerSearchConfig,
    ManagerWorld,
    RequestKeys,
    initial_manager_world,
)
from proofs.exhaustive.pool_world import PoolSearchConfig, PoolWorld, initial_pool_world
from proofs.exhaustive.search import SearchResult, breadth_first

DEFAULT_MAX_STATES = 2_000_000

# -- scopes ----------------------------------------------------------------------------------

_B1_PROMPTS = ((0, 0), (0, 1))  # two chains sharing their first block (block size 1)
_B1_PROMPTS3 = ((0, 0), (0, 1), (1, 0))  # and one whose second block equals another's
_B2_PROMPTS = ((0, 1, 0, 0), (0, 1, 1, 1))  # the same shape at block size 2

POOL_SCOPES: dict[str, tuple[PoolSearchConfig, ...]] = {
    "ci": (
        PoolSearchConfig(3, 1, _B1_PROMPTS3),
        PoolSearchConfig(3, 2, _B2_PROMPTS),
        PoolSearchConfig(4, 1, _B1_PROMPTS),
        PoolSearchConfig(4, 1, _B1_PROMPTS, enable_caching=False),
        PoolSearchConfig(3, 1, _B1_PROMPTS, max_ref_cnt=3, max_touch_len=2, max_free_len=3),
        PoolSearchConfig(3, 1, _B1_PROMPTS, semantics=VLLM_0_8_5, misuse=False),
    ),
    "large": (
        PoolSearchConfig(4, 1, _B1_PROMPTS3),
        PoolSearchConfig(4, 2, _B2_PROMPTS),
        PoolSearchConfig(4, 1, _B1_PROMPTS, max_ref_cnt=3, max_touch_len=2, max_free_len=3),
        PoolSearchConfig(4, 1, _B1_PROMPTS, semantics=VLLM_0_8_5, misuse=False),
        PoolSearchConfig(5, 1, _B1_PROMPTS),
    ),
}
"""Pool configurations per scope: `ci` runs in CI, `large` on demand."""

_B1 = ((0, 1), (0, 1, 1))  # r1's prompt extends r0's (block size 1)
_B1_THREE = ((0, 1), (0, 1, 1), (0,))  # and a third that is r0's first block
_B1_TWINS = ((0, 1, 1), (0, 1, 1))  # equal prompts: whole-prompt hits
_B2 = ((0, 1, 0), (0, 1, 1))  # one shared full block, then a partial one (block size 2)
_B2_LONG = ((0, 1, 0, 0, 1), (0, 1, 0, 0, 0))  # two shared full blocks, then a partial one
_B1_SHORT = ((0,), (0, 1))  # r1's prompt extends r0's one-token prompt (block size 1)
_LORA = RequestKeys(lora_id=1)
_IMAGE_A = RequestKeys(mm=((1, 2, "img-a"),))  # an image across the first block boundary (B=2)
_IMAGE_B_SALTED = RequestKeys(mm=((1, 2, "img-b"),), cache_salt="tenant-1")
_IMAGE_AT_0 = RequestKeys(mm=((0, 1, "img-a"),))  # one image, at the first slot ...
_IMAGE_AT_1 = RequestKeys(mm=((1, 1, "img-a"),))  # ... or the second, of equal tokens (B=2)

MANAGER_SCOPES: dict[str, tuple[ManagerSearchConfig, ...]] = {
    # max_model_len must be long enough that requests keep running after their prompt (two at
    # once, sharing blocks) and, under a window, after a block left it: a request that reaches
    # max_model_len finishes within the step, and its state is never seen.
    "ci": (
        ManagerSearchConfig(4, 1, 5, _B1),
        ManagerSearchConfig(4, 1, 4, _B1_THREE, samples=(0,)),
        ManagerSearchConfig(4, 2, 5, _B2),
        ManagerSearchConfig(4, 1, 4, _B1, chunked_prefill=True, use_eagle=True),
        ManagerSearchConfig(4, 1, 4, _B1, enable_caching=False),
        ManagerSearchConfig(4, 1, 5, _B1, sliding_window=2),
        ManagerSearchConfig(4, 1, 5, _B1_TWINS, sliding_window=2, samples=(1,)),
        ManagerSearchConfig(4, 1, 5, _B1, sliding_window=2, samples=(0,), use_eagle=True),
        ManagerSearchConfig(4, 2, 6, _B2, sliding_window=2, samples=(0,)),
        ManagerSearchConfig(4, 1, 6, _B1, sliding_window=3, samples=(0,)),  # hits need 2 blocks
        # cdiv(W - 1, B) = 2 but (W - 1) // B = 1: the only CI window where they differ
        ManagerSearchConfig(5, 2, 7, _B2_LONG, sliding_window=4, samples=(0,)),
        # vLLM 0.8.5 under a sliding window drives the null block's ref_cnt down without bound
        # (every free of a windowed request decrements it): an infinite state space.
        ManagerSearchConfig(4, 1, 5, _B1, semantics=VLLM_0_8_5, misuse=False),
        # Draft tokens (none or all accepted) and lookahead slots: at B=1 every draft fills a
        # block that must not be cached, and every lookahead slot needs a block of its own.
        # Prompts are short, so that a decode step with drafts still fits in three blocks.
        ManagerSearchConfig(4, 1, 4, _B1_SHORT, samples=(0,), drafts=(0, 1), lookaheads=(0, 1)),
        ManagerSearchConfig(4, 2, 6, _B2, samples=(0,), drafts=(0, 2), lookaheads=(0, 1)),
        ManagerSearchConfig(4, 1, 4, _B1_SHORT, sliding_window=2, samples=(0,), drafts=(0, 1)),
        # Extra keys: equal LoRA ids share blocks; other images and a salt never do.
        ManagerSearchConfig(4, 1, 5, _B1, samples=(0,), keys=(_LORA, _LORA)),
        ManagerSearchConfig(
            4, 2, 5, ((0, 1, 0), (0, 1, 0)), samples=(0,), keys=(_IMAGE_A, _IMAGE_B_SALTED)
        ),
        # The same image at two places in blocks of equal tokens: never one key (what the
        # attention-truth invariant found pagedkv's keys did not say).
        ManagerSearchConfig(
            4, 2, 5, ((0, 0, 1), (0, 0, 1)), samples=(0,), keys=(_IMAGE_AT_0, _IMAGE_AT_1)
        ),
        # Hybrid: a full-attention and a sliding-window group over one pool (840 states), and
        # a sliding window beside chunked local attention, where one group's hit is cut short
        # by the other and must be found again (2,160 states).
        ManagerSearchConfig(5, 1, 3, _B1_SHORT, samples=(0,), more_groups=(("window", 2),)),
        ManagerSearchConfig(
            6, 1, 4, _B1, sliding_window=2, samples=(0,), more_groups=(("chunk", 2),)
        ),
    ),
    "large": (
        ManagerSearchConfig(5, 1, 5, _B1_THREE, samples=(0,)),
        ManagerSearchConfig(5, 1, 6, _B1),
        ManagerSearchConfig(5, 1, 6, _B1, semantics=VLLM_0_8_5, misuse=False),
        ManagerSearchConfig(4, 1, 5, _B1_THREE, sliding_window=2, samples=(0,)),
        ManagerSearchConfig(4, 2, 6, _B2, sliding_window=2),
        ManagerSearchConfig(4, 1, 5, _B1, sliding_window=2, chunked_prefill=True, use_eagle=True),
        ManagerSearchConfig(5, 1, 6, _B1, sliding_window=3),
        ManagerSearchConfig(4, 2, 7, _B2, sliding_window=3, samples=(0,)),
        ManagerSearchConfig(
            4, 1, 5, _B1, sliding_window=2, samples=(0,), drafts=(0, 1), lookaheads=(0, 1)
        ),
        ManagerSearchConfig(4, 1, 5, (*_B1_TWINS, (0, 1)), samples=(0,), keys=(None, _LORA)),
        ManagerSearchConfig(5, 1, 6, _B1, drafts=(0, 1, 2), lookaheads=(0, 2)),
        ManagerSearchConfig(
            7, 1, 4, _B1, samples=(0,), more_groups=(("window", 2), ("chunk", 2))
        ),  # three groups: 10,080 states
    ),
}
"""Manager configurations per scope: `ci` runs in CI, `large` on demand."""

POOL_SCOPES["nightly"] = POOL_SCOPES["large"]
MANAGER_SCOPES["nightly"] = (MANAGER_SCOPES["large"][3], MANAGER_SCOPES["large"][11])
"""The full tier's scope (`./dev test --full`): the whole pool `large` scope (N = 5 takes 23
minutes inside the full tier), and the manager `large` configurations measured to finish within
5 minutes each on the 2-core development machine: a window of 2 over three requests (21,978
states, 277 s alone, 508 s inside the full tier) and the three groups (10,080 states, 159 s
alone, 284 s inside it). The first `large` manager configuration alone ran past 22 minutes;
the rest of that scope stays on demand."""

# -- searches --------------------------------------------------------------------------------


def explore_pool(
    factory: PoolFactory,
    config: PoolSearchConfig,
    *,
    max_states: int = DEFAULT_MAX_STATES,
    visit: Callable[[PoolWorld], None] | None = None,
) -> SearchResult:
    """Search every reachable state of the pool `config` describes, `factory`'s pool vs spec.

    `visit` sees each distinct state once (see `proofs.exhaustive.search.breadth_first`).
    """
    with quiet_refusal_warnings():
        return breadth_first(
            config.name,
            lambda: initial_pool_world(factory, config),
            max_states=max_states,
            visit=visit,
        )


def explore_manager(
    factory: ManagerFactory,
    config: ManagerSearchConfig,
    *,
    max_states: int = DEFAULT_MAX_STATES,
    visit: Callable[[ManagerWorld], None] | None = None,
) -> SearchResult:
    """Search every reachable state of the manager `config` describes, `factory`'s vs spec.

    `visit` sees each distinct state once (see `proofs.exhaustive.search.breadth_first`).
    """
    with quiet_refusal_warnings():
        return breadth_first(
            config.name,
            lambda: initial_manager_world(factory, config),
            max_states=max_states,
            visit=visit,
        )


# -- command line ----------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m proofs.exhaustive", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--scope", choices=sorted(POOL_SCOPES), default="ci")
    parser.add_argument("--layer", choices=("pool", "manager", "all"), default="all")
    parser.add_argument("--impl", metavar="MODULE:FACTORY", help="pool factory to check")
    parser.add_argument("--manager-impl", metavar="MODULE:FACTORY", help="manager factory")
    parser.add_argument("--max-states", type=int, default=DEFAULT_MAX_STATES)
    args = parser.parse_args(argv)
    pool_factory: PoolFactory = load_factory(args.impl) if args.impl else pagedkv_pool
    manager_factory: ManagerFactory = (
        load_factory(args.manager_impl) if args.manager_impl else pagedkv_manager
    )
    results: list[SearchResult] = []

    def report(result: SearchResult) -> None:
        results.append(result)
        print(result.summary(), flush=True)
        if result.failure is not None:
            print(result.failure.render(), flush=True)

    if args.layer in ("pool", "all"):
        for pool_config in POOL_SCOPES[args.scope]:
            report(explore_pool(pool_factory, pool_config, max_states=args.max_states))
    if args.layer in ("manager", "all"):
        for manager_config in MANAGER_SCOPES[args.scope]:
            report(explore_manager(manager_factory, manager_config, max_states=args.max_states))
    states = sum(result.states for result in results)
    transitions = sum(result.transitions for result in results)
    seconds = sum(result.seconds for result in results)
    failed = [result for result in results if not result.ok]
    verdict = f"FAILED ({len(failed)} of {len(results)})" if failed else "ok"
    print(
        f"exhaustive search, scope {args.scope}: {verdict}: {len(results)} configurations, "
        f"{states:,} states, {transitions:,} transitions, {seconds:.1f} s"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
