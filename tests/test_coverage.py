"""Coverage counters and targets: how they are counted, scaled, enforced and shown."""

from __future__ import annotations

from pagedkv.harness.coverage import (
    MANAGER_TARGETS,
    MIN_STEPS_FOR_TARGETS,
    POOL_TARGETS,
    Coverage,
    Target,
    evaluate,
    refusal_kind,
    render_histogram,
    render_targets,
    unmet,
)
from pagedkv.vocab.errors import BlockStateError, InvalidArgumentError, RequestError


def test_a_refusal_kind_names_the_rule_without_ids_or_numbers() -> None:
    assert refusal_kind(RequestError("req-7", "fewer full blocks than already cached", "3")) == (
        "RequestError: fewer full blocks than already cached"
    )
    assert refusal_kind(BlockStateError(12, "block does not belong to this pool")) == (
        "BlockStateError: block does not belong to this pool"
    )
    error = InvalidArgumentError("request 'req-3': num_tokens must be > 0, got -1")
    assert refusal_kind(error) == "InvalidArgumentError: num_tokens must be > N got N"


def test_errors_are_counted_by_class_and_by_the_operation_refused() -> None:
    coverage = Coverage()
    coverage.count_error("allocate_slots", RequestError("a", "rule one"))
    coverage.count_error("allocate_slots", RequestError("b", "rule one"))
    coverage.count_error("free", RequestError("b", "rule two"))
    assert coverage.counts["typed error RequestError"] == 3
    assert coverage.refusals("allocate_slots") == {"RequestError: rule one": 2}
    assert coverage.refusals("free") == {"RequestError: rule two": 1}


def test_targets_scale_with_the_campaign_and_apply_only_to_their_modes() -> None:
    targets = (
        Target("preemptions", 500, "why"),
        Target("typed error RequestError", 100, "why", frozenset({"misuse"})),
        Target("kinds of allocate_slots refusals", 2, "why", scales=False),
        Target("distinct states", 1_000, "why"),
    )
    coverage = Coverage(steps=200_000)
    coverage.counts["preemptions"] = 999
    coverage.count_error("allocate_slots", RequestError("a", "one"))
    coverage.count_error("allocate_slots", RequestError("a", "two"))
    coverage.states.update(range(2_000))
    results = evaluate(coverage, targets, frozenset())
    assert [(r.count, r.required, r.enforced, r.met) for r in results] == [
        (999, 1_000, True, False),
        (2, 200, False, False),  # no misuse in this campaign: shown, not enforced
        (2, 2, True, True),
        (2_000, 2_000, True, True),
    ]
    assert [r.target.counter for r in unmet(results)] == ["preemptions"]
    table = render_targets(results)
    assert "UNMET" in table[1] and "(not enforced)" in table[2] and table[3].endswith("met")


def test_short_campaigns_show_their_counts_but_are_not_held_to_targets() -> None:
    coverage = Coverage(steps=MIN_STEPS_FOR_TARGETS - 1)
    results = evaluate(coverage, MANAGER_TARGETS, frozenset({"misuse"}))
    assert not any(result.enforced for result in results)
    assert unmet(results) == []


def test_every_target_says_why_and_is_counted_by_a_driver() -> None:
    for target in (*MANAGER_TARGETS, *POOL_TARGETS):
        assert target.why and target.per_100k > 0
    names = {target.counter for target in MANAGER_TARGETS}
    for wanted in (
        "decode steps inside a block",
        "block fills",
        "new-block allocations",
        "evictions of cached blocks",
        "prefix hits, full attention",
        "prefix hits, sliding window",
        "sliding-window hits with leading null blocks",
        "preemptions for lack of blocks",
        "successful prefix-cache resets",
        "distinct states",
    ):
        assert wanted in names  # issue 10's list


def test_the_histogram_shows_each_bucket_as_a_share_of_runs() -> None:
    coverage = Coverage(runs=4)
    coverage.histogram.update(
        ["pool 2-16 blocks"] * 3 + ["pool 17-64 blocks", "feature lora", "operation reset"]
    )
    lines = render_histogram(coverage)
    assert "  features   lora 25%" in lines
    assert "  operations reset 25%" in lines
    assert "  pool       17-64 blocks 25%, 2-16 blocks 75%" in lines
