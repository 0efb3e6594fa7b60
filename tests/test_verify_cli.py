"""`pagedkv verify`: the default campaign passes, and broken pools fail with a shrunk sequence."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pagedkv.cli import main
from pagedkv.harness.adapters import pagedkv_pool
from pagedkv.harness.protocol import ManagerConfig
from pagedkv.vocab.semantics import Semantics

TESTS_DIR = Path(__file__).parent


def _steps(report: str) -> int:
    match = re.search(r"steps\s+([\d,]+) in", report)
    assert match, report
    return int(match.group(1).replace(",", ""))


def test_a_swarm_run_checks_every_layer_and_prints_the_coverage_table(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["verify", "--quiet", "--steps", "20000", "--seed", "5"]) == 0
    report = capsys.readouterr().out
    campaigns = report.split("pagedkv verify — ")[1:]
    assert [c.splitlines()[0].split(":")[0] for c in campaigns] == [
        "block pool",
        "KV cache manager",
        "KV cache manager, hybrid (2-4 KV cache groups)",
        "CPU offload tier",
    ]
    offload = campaigns.pop()
    assert "campaign seed          5 (--seed 5 reproduces it)" in offload
    assert "OK: no divergence (targets need >= 100,000 steps)" in offload
    assert _steps(offload) == 20_000 and "prepare_store evicting" in offload
    for campaign in campaigns:
        assert "campaign seed          5 (--seed 5 reproduces it)" in campaign
        assert "OK: no divergence (targets need >= 100,000 steps)" in campaign
        assert re.search(r"steps per CPU second\s+[1-9][\d,]* \(", campaign)
        assert re.search(r"distinct states\s+[1-9]", campaign)
        assert "coverage" in campaign and "(not enforced)" in campaign
        assert _steps(campaign) >= 20_000
    assert "sliding-window hits with leading null blocks" in campaigns[1]
    assert "refusals of allocate_slots" in campaigns[1]
    assert "attention  full" in campaigns[1]
    assert "hybrid hits cut short by one group" in campaigns[2]
    assert re.search(r"attention  .*\bhybrid, 2 groups", campaigns[2])


def test_an_unmet_coverage_target_exits_3(capsys: pytest.CaptureFixture[str]) -> None:
    """Full attention only: the sliding-window targets cannot be met."""
    args = ["verify", "--quiet", "--layer", "manager", "--attention", "full"]
    assert main([*args, "--steps", "100000", "--seed", "1"]) == 3
    report = capsys.readouterr().out
    assert re.search(r"prefix hits, sliding window\s+0\s+>=\s+[\d,]+\s+UNMET", report)
    assert "coverage targets UNMET" in report


@pytest.mark.parametrize(
    ("factory", "attention"),
    [
        ("forward_free", "full"),
        ("no_last_block_rule", "full"),
        ("window_off_by_one", "sliding"),
    ],
)
def test_broken_manager_fails_with_a_shrunk_replayable_run(
    factory: str, attention: str, capsys: pytest.CaptureFixture[str]
) -> None:
    args = [
        "verify",
        "--quiet",
        "--layer",
        "manager",
        "--attention",
        attention,
        "--manager-impl",
        f"broken_managers:{factory}",
    ]
    assert main([*args, "--seed", "3"]) == 1
    report = capsys.readouterr().out
    assert "DIVERGENCE" in report
    seed = re.search(r"^Failing run (\d+): ", report, re.M)
    assert seed, report
    replay = re.search(r"^Replay it: pagedkv verify (.*)$", report, re.M)
    assert replay, report
    steps = re.findall(r"^  \d+\. \w+\(", report, re.M)
    assert 1 <= len(steps) <= 10, report
    assert "error: " in report
    # The printed command replays the run and shrinks it to the same operations.
    assert main(["verify", *replay.group(1).split()]) == 1
    replayed = capsys.readouterr().out
    assert replayed.split("Failing run", 1)[1] == report.split("Failing run", 1)[1]


def test_vllm_conformance_run_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", "--quiet", "--semantics", "vllm-0.8.5", "--steps", "2000"]) == 0
    report = capsys.readouterr().out
    assert "vllm-0.8.5 (valid calls only)" in report


def test_a_harness_error_is_reported_as_such_never_as_a_reproduction(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A crash of the client itself is a bug of the harness: exit 4, its traceback, no shrink."""
    from pagedkv.harness.client.pool import PoolClient

    def crash(self: PoolClient, op: object) -> None:
        raise IndexError("list index out of range")

    monkeypatch.setattr(PoolClient, "_lookup", crash)
    assert main(["verify", "--quiet", "--layer", "pool", "--seed", "1"]) == 4
    report = capsys.readouterr()
    assert "HARNESS ERROR in run" in report.out
    assert "not of the implementation under test" in report.out
    assert "Traceback (most recent call last)" in report.out
    assert "Shrunk from" not in report.out and "shrinking" not in report.err
    assert re.search(r"^Replay it: pagedkv verify --layer pool --replay-run \d+$", report.out, re.M)


@pytest.mark.slow
@pytest.mark.parametrize("factory", ["touch_keeps_queued", "release_resets_ref_cnt"])
def test_a_ref_count_bug_is_shown_as_itself_for_every_seed(
    factory: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 21: shrinking once turned a pool's ref-count bug into a crash of the harness's own
    client on a smaller pool; now every seed reports the real divergence, shrunk alike."""
    for seed in range(1, 11):
        args = ["verify", "--quiet", "--layer", "pool", "--impl", f"broken_pools:{factory}"]
        assert main([*args, "--seed", str(seed)]) == 1, seed
        report = capsys.readouterr().out
        failure = re.search(r"^Failure: (\w[\w ]*?) in (\w+)", report, re.M)
        kinds = {"state", "digest", "result", "invariant", "error class", "atomicity"}
        assert failure and failure.group(1) in kinds, report
        assert "IndexError" not in report and "HARNESS ERROR" not in report
        assert "each replay failed the same way" in report
        assert "did not reproduce" not in report


def test_console_script_reports_divergence_with_nonzero_exit() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS_DIR), str(TESTS_DIR.parent)])}
    completed = subprocess.run(
        [
            sys.executable,
            "-m",
            "pagedkv.cli",
            "verify",
            "--layer",
            "pool",
            "--impl",
            "broken_pools:free_to_head",
            "--seed",
            "1",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert completed.returncode == 1, completed.stdout + completed.stderr
    assert "Shrunk from" in completed.stdout
    assert "free_order" in completed.stdout  # the diff names the diverging observable
    assert "steps" in completed.stderr  # the progress bar
    assert "shrinking the failing run" in completed.stderr


def test_swarm_arguments_must_be_positive(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", "--check-every", "0"]) == 2
    assert main(["verify", "--steps-per-run", "-1"]) == 2
    assert "must be positive" in capsys.readouterr().err


def test_unloadable_impl_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", "--impl", "no_such_module:factory"]) == 2
    assert main(["verify", "--impl", "not-a-target"]) == 2
    assert main(["verify", "--manager-impl", "no_such_module:factory"]) == 2
    assert "cannot load the implementation" in capsys.readouterr().err


NOT_A_FACTORY = 3


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--impl", "not-a-target"], "--impl: expected MODULE:FACTORY"),
        (
            ["--manager-impl", "no_such_module:factory"],
            "--manager-impl no_such_module:factory: no module named 'no_such_module' in the "
            "working directory",
        ),
        (["--impl", "test_verify_cli:nothing"], "--impl test_verify_cli:nothing: test_verify_cli "),
        (
            ["--impl", "test_verify_cli:NOT_A_FACTORY"],
            "--impl test_verify_cli:NOT_A_FACTORY: test_verify_cli.NOT_A_FACTORY is not callable",
        ),
        (["--impl", "test_verify_cli:keyerror_pool"], "--impl test_verify_cli:keyerror_pool("),
        (
            ["--layer", "manager", "--manager-impl", "test_verify_cli:unobservable_manager"],
            "--manager-impl test_verify_cli:unobservable_manager: the object from",
        ),
    ],
)
def test_errors_name_the_option_that_chose_the_implementation(
    args: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["verify", "--quiet", "--steps", "500", *args]) == 2
    err = capsys.readouterr().err
    assert says in err
    assert "load_factory" not in err and "check_pool_factory" not in err
    assert "check_manager_factory" not in err


USER_MODULE = """\
from pagedkv.harness.adapters import pagedkv_manager, pagedkv_pool


def pool(num_gpu_blocks, enable_caching, semantics):
    return pagedkv_pool(num_gpu_blocks, enable_caching, semantics)


def manager(config):
    return pagedkv_manager(config)


def wrong_signature():
    return None
"""


def _pagedkv(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """The `pagedkv` console script, run from `cwd` as a user runs it: nothing on PYTHONPATH."""
    script = Path(sys.executable).with_name("pagedkv")
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    return subprocess.run(
        [str(script), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_factories_are_imported_from_the_working_directory(tmp_path: Path) -> None:
    """As `python -m` would, and nothing is left in the directory (no `.hypothesis/`)."""
    (tmp_path / "userpools.py").write_text(USER_MODULE)
    before = {path.name for path in tmp_path.iterdir()}
    flags = ["--steps", "500", "--seed", "1", "--max-groups", "1"]
    impls = ["--impl", "userpools:pool", "--manager-impl", "userpools:manager"]
    done = _pagedkv(tmp_path, "verify", *flags, *impls)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("OK: no divergence") == 2
    refused = _pagedkv(tmp_path, "verify", "--layer", "pool", "--impl", "userpools:wrong_signature")
    assert refused.returncode == 2
    assert "--impl userpools:wrong_signature(4, True, pagedkv) raised TypeError" in refused.stderr
    assert "Traceback" not in refused.stderr  # only pagedkv's frames: the message says it all
    assert {path.name for path in tmp_path.iterdir()} - before <= {"__pycache__"}


def keyerror_pool(num_gpu_blocks: int, enable_caching: bool, semantics: Semantics) -> object:
    """A factory with a bug of its own: it fails before any pool exists."""
    return {}["pool"]


def late_keyerror_pool(num_gpu_blocks: int, enable_caching: bool, semantics: Semantics) -> object:
    """Builds the pools of 4 blocks the pre-campaign check tries, and no larger one."""
    if num_gpu_blocks > 4:
        return {}["pool"]
    return pagedkv_pool(num_gpu_blocks, enable_caching, semantics)


def unobservable_manager(config: ManagerConfig) -> object:
    """A manager without `snapshot()`: an adapter that was never finished."""
    return object()


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--impl", "test_verify_cli:keyerror_pool"], "raised KeyError('pool')"),
        (["--impl", "test_verify_cli:late_keyerror_pool"], "raised KeyError('pool')"),
        (
            ["--layer", "manager", "--manager-impl", "test_verify_cli:unobservable_manager"],
            "cannot be observed",
        ),
    ],
)
def test_a_failing_factory_is_a_setup_error_not_a_divergence(
    args: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["verify", "--quiet", "--steps", "5000", *args]) == 2
    captured = capsys.readouterr()
    assert "DIVERGENCE" not in captured.out
    assert "setup error (nothing was checked)" in captured.err
    assert says in captured.err
    if "keyerror" in args[-1]:  # the cause, for the user to fix, from the user's first frame
        assert "Traceback (most recent call last)" in captured.err
        assert 'test_verify_cli.py", line' in captured.err.split("Traceback")[1].splitlines()[1]
    else:  # the object had no snapshot(): pagedkv's frames only, the message says it all
        assert "Traceback" not in captured.err


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--against", "vllm>=0.8"], "--against takes vllm==VERSION or vllm==latest"),
        (["--against", "vllm==0.1.0"], "no adapter for vllm==0.1.0; adapters exist for"),
        (["--against", "vllm==0.8.5", "--impl", "broken_pools:free_to_head"], "--impl"),
        (["--against", "vllm==0.8.5", "--semantics", "pagedkv"], "--semantics"),
    ],
)
def test_bad_against_arguments_exit_2_before_fetching(
    args: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["verify", "--quiet", *args]) == 2
    assert says in capsys.readouterr().err


def test_verify_needs_no_hypothesis() -> None:
    """`pip install pagedkv` (no extra): the swarm and its clients use the standard library."""
    script = (
        "import sys; sys.modules['hypothesis'] = None; "  # as if hypothesis were not installed
        "from pagedkv.cli import main; "
        "sys.exit(main(['verify', '--quiet', '--steps', '2000', '--seed', '1']))"
    )
    completed = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=False
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    assert completed.stdout.count("OK: no divergence") == 4  # pool, manager, hybrid, offload
