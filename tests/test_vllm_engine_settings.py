"""The engine settings `--against vllm==0.33.0` builds vLLM's manager with (`engine_0_33`), and
the domain hooks that make the swarm draw what the engine plans.

These need no vLLM: the defaults are read from source text, the settings parsed and checked,
and the hooks tried with stand-in plans. `test_vllm_conformance.py` runs them on vLLM itself.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import pytest
from manager_fixtures import manager_config

from pagedkv.harness.domain import FULL_DOMAIN, Domain
from pagedkv.harness.setup_check import SetupError
from pagedkv.harness.swarm.runs import (
    attention_spec,
    draw_manager_run,
    hybrid_config,
    mamba_align_spec,
    with_retention,
)
from pagedkv.harness.vllm.engine_0_33 import (
    ASYNC_SCHEDULING_BATCHES,
    SETTINGS,
    EngineSettings,
    UnplannableError,
    class_defaults,
    parse_setting,
)
from pagedkv.harness.vllm.v0_33 import (
    DOMAIN,
    PlannedSizesError,
    check_planned_sizes,
    engine_block_sizes,
    planner_layers,
)
from pagedkv.vocab.kv_cache_interface import (
    AttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    SlidingWindowSpec,
)

CONFIG_SOURCE = """
class CacheConfig:
    LIMIT: ClassVar[int] = 2048
    block_size: int = Field(default=None, gt=0)
    prefix_cache_retention_interval: int | None = Field(default=0, ge=0)
    enable_prefix_caching: bool = True
    budget: int = Field(default=LIMIT, ge=1)
    factory: list[str] = field(default_factory=list)
    no_default: int


class Other:
    prefix_cache_retention_interval: int | None = None
"""

DEFAULTS: dict[str, object] = {
    "prefix_cache_retention_interval": 0,
    "prefix_match_unit": None,
    "enable_mamba_shared_prefix_checkpoint": False,
    "watermark": 0.0,
    "max_num_batched_tokens": 2048,
}


def test_defaults_are_read_from_the_class_not_another() -> None:
    fields = class_defaults(CONFIG_SOURCE, "CacheConfig")
    assert fields == {
        "block_size": None,
        "prefix_cache_retention_interval": 0,
        "enable_prefix_caching": True,
        "budget": 2048,  # a ClassVar constant named as the default
    }
    assert class_defaults(CONFIG_SOURCE, "Other") == {"prefix_cache_retention_interval": None}


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("prefix_cache_retention_interval=None", ("prefix_cache_retention_interval", None)),
        ("prefix-cache-retention-interval=dense", ("prefix_cache_retention_interval", None)),
        ("prefix_cache_retention_interval=64", ("prefix_cache_retention_interval", 64)),
        ("watermark=0.0", ("watermark", 0.0)),
        (
            "enable_mamba_shared_prefix_checkpoint=false",
            ("enable_mamba_shared_prefix_checkpoint", False),
        ),
    ],
)
def test_a_setting_is_parsed_to_its_value(text: str, expected: tuple[str, object]) -> None:
    assert parse_setting(text) == expected


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("block_size=16", "NAME one of"),
        ("prefix_cache_retention_interval", "NAME=VALUE"),
        ("watermark=lots", "not a number"),
    ],
)
def test_a_malformed_or_unknown_setting_is_refused_by_name(text: str, says: str) -> None:
    with pytest.raises(SetupError, match=says):
        parse_setting(text)


def test_the_defaults_hold_unless_the_user_sets_one_and_the_report_says_which() -> None:
    settings = EngineSettings.resolve(DEFAULTS, [])
    assert settings.retention == 0
    assert settings.max_in_flight_tokens == ASYNC_SCHEDULING_BATCHES * 2048
    assert "prefix_cache_retention_interval=0 (CacheConfig default)" in settings.describe()
    dense = EngineSettings.resolve(DEFAULTS, ["prefix_cache_retention_interval=None"])
    assert dense.retention is None
    assert "prefix_cache_retention_interval=None (--vllm-setting)" in dense.describe()
    assert "watermark=0.0 (SchedulerConfig default)" in dense.describe()
    assert set(dense.values) == set(SETTINGS)


@pytest.mark.parametrize(
    ("texts", "says"),
    [
        (["watermark=0.1"], "models only 0.0"),
        (["prefix_match_unit=4"], "models only None"),
        (["prefix_cache_retention_interval=-16"], ">= 0"),
        (["prefix_cache_retention_interval=1.5"], "whole number"),
        (["max_num_batched_tokens=0"], ">= 1"),
        (["watermark=0.0", "watermark=0.0"], "given twice"),
    ],
)
def test_a_setting_pagedkv_does_not_model_is_refused(texts: list[str], says: str) -> None:
    with pytest.raises(SetupError, match=says):
        EngineSettings.resolve(DEFAULTS, texts)


def test_a_domain_without_a_plan_keeps_the_drawn_groups() -> None:
    specs = [attention_spec(4, None), attention_spec(4, 8)]
    assert Domain().plan_groups(specs) is specs
    assert "planning" not in Domain().describe()


def test_the_retention_the_engine_uses_is_the_only_one_drawn() -> None:
    engine = dataclasses.replace(DOMAIN, retention_intervals=(0,))
    dense = dataclasses.replace(DOMAIN, retention_intervals=(None,))
    assert engine.draws_sparse_retention and FULL_DOMAIN.draws_sparse_retention
    assert not dense.draws_sparse_retention and not Domain().draws_sparse_retention
    rng = random.Random(5)
    assert {engine.retention(rng, 4) for _ in range(20)} == {0}
    assert {dense.retention(rng, 4) for _ in range(20)} == {None}


def test_hybrid_configurations_are_drawn_through_the_plan_and_nothing_else_moves() -> None:
    """The plan reorders and merges groups; the rest of the draw (pool size, lengths, the
    retention drawn after it) is what it would have been without the plan."""
    reverse = dataclasses.replace(
        DOMAIN, retention_intervals=(0,), group_plan=lambda specs: list(reversed(specs))
    )
    plain = dataclasses.replace(DOMAIN, retention_intervals=(0,))
    for seed in range(30):
        base = manager_config(
            block_size=1 + seed % 5, sliding_window=None if seed % 2 else seed % 3 + 2
        )
        planned = with_retention(
            random.Random(seed), hybrid_config(random.Random(seed), base, reverse), reverse
        )
        drawn = with_retention(
            random.Random(seed), hybrid_config(random.Random(seed), base, plain), plain
        )
        ours = [g.kv_cache_spec for g in planned.kv_cache_config.kv_cache_groups]
        theirs = [g.kv_cache_spec for g in drawn.kv_cache_config.kv_cache_groups]
        assert ours == list(reversed(theirs))
        assert planned.max_model_len == drawn.max_model_len
        assert planned.kv_cache_config.num_blocks == drawn.kv_cache_config.num_blocks
        windowed = any(isinstance(spec, SlidingWindowSpec) for spec in ours)
        retention = planned.kv_cache_config.prefix_cache_retention_interval
        assert retention == (0 if windowed else None)


def test_a_campaign_is_held_to_the_retention_targets_only_where_it_draws_sparse_retention() -> None:
    from types import SimpleNamespace

    from pagedkv.harness.coverage import MANAGER_TARGETS
    from pagedkv.harness.swarm.engine import Campaign
    from pagedkv.vocab.semantics import VLLM_0_33

    def modes(domain: Domain) -> frozenset[str]:
        layer: Any = SimpleNamespace(
            kv_events=False,
            evict_blocks=False,
            mamba_groups=False,
            full_sequence_gate=False,
            cache_blocks=False,
            external_tokens=False,
            deferred_frees=False,
            offload_tier=False,
            mamba_align=False,
            mixed_block_sizes=False,
        )
        campaign = Campaign("t", "i", layer, VLLM_0_33, False, domain, 1, MANAGER_TARGETS, "")
        return campaign.modes

    engine = dataclasses.replace(DOMAIN, retention_intervals=(0,))
    dense = dataclasses.replace(DOMAIN, retention_intervals=(None,))
    assert "sparse retention" in modes(engine) and "sparse retention" in modes(FULL_DOMAIN)
    assert "sparse retention" not in modes(dense)
    needing = [t.counter for t in MANAGER_TARGETS if "sparse retention" in t.needs]
    assert "retention: hits under sparse retention" in needing


def _unified_block_sizes(specs: list[KVCacheSpec]) -> list[int]:
    """The block sizes vLLM 0.33's `unify_kv_cache_spec_page_size` gives layers of these specs
    as `planner_layers` builds them (docs/design/mixed-block-sizes.md §7: the largest page
    keeps its block size, a page 1/r of it gets r times its block size)."""
    pages = []
    for spec, fields in zip(specs, planner_layers(specs), strict=True):
        assert isinstance(spec, AttentionSpec)
        layer = FullAttentionSpec(
            block_size=fields.get("block_size", spec.block_size),
            num_kv_heads=spec.num_kv_heads,
            head_size=fields.get("head_size", spec.head_size),
            dtype=spec.dtype,
        )
        pages.append((layer.block_size, layer.page_size_bytes))
    largest = max(page for _, page in pages)
    assert all(largest % page == 0 for _, page in pages)
    return [block_size * (largest // page) for block_size, page in pages]


def test_vllm_layers_of_mixed_sizes_plan_to_the_drawn_sizes() -> None:
    """The mixed-size hybrid runs the swarm draws for vLLM: each group's layer is built at the
    smallest size, its head scaled so that the planner's page unification grows it back to
    the drawn size; with one size the layers are the specs' own."""
    mixed = 0
    for seed in range(300):
        run = draw_manager_run(
            seed, misuse=False, attention="hybrid", domain=DOMAIN, mixed_block_sizes=True
        )
        specs = [group.kv_cache_spec for group in run.config.kv_cache_config.kv_cache_groups]
        sizes = [spec.block_size for spec in specs]
        if len(set(sizes)) == 1:
            assert planner_layers(specs) == [{} for _ in specs]
            continue
        mixed += 1
        assert {fields["block_size"] for fields in planner_layers(specs)} == {min(sizes)}
        assert engine_block_sizes(specs) == (min(sizes), None)
        assert _unified_block_sizes(specs) == sizes
    assert mixed >= 20


def test_mixed_sizes_no_head_size_makes_are_refused_by_name() -> None:
    full = [
        FullAttentionSpec(block_size=b, num_kv_heads=1, head_size=1, dtype="float16")
        for b in (4, 8)
    ]
    wide = FullAttentionSpec(block_size=8, num_kv_heads=2, head_size=1, dtype="float16")
    with pytest.raises(UnplannableError, match="one shape"):
        planner_layers([full[0], wide])
    with pytest.raises(UnplannableError, match="one shape"):
        planner_layers([*full, mamba_align_spec(4, full[0].page_size_bytes, "mamba2")])
    odd = FullAttentionSpec(block_size=6, num_kv_heads=1, head_size=1, dtype="float16")
    with pytest.raises(UnplannableError, match="whole ratios"):
        planner_layers([full[0], odd])


def test_planned_sizes_other_than_the_drawn_fail_loudly() -> None:
    from types import SimpleNamespace

    specs: list[KVCacheSpec] = [
        FullAttentionSpec(block_size=b, num_kv_heads=1, head_size=1, dtype="float16")
        for b in (4, 8)
    ]
    planned = [SimpleNamespace(kv_cache_spec=SimpleNamespace(block_size=b)) for b in (4, 8)]
    check_planned_sizes(planned, specs)
    with pytest.raises(PlannedSizesError, match=r"\[8, 8\], not the drawn \[4, 8\]"):
        check_planned_sizes(planned[1:] * 2, specs)
