"""A campaign's runs on several cores (`--jobs`) or several machines (`--shard`), merged.

A campaign is a sequence of independent runs: run i is drawn from its seed alone
(`run_seed(campaign_seed, layer, i)`), runs on a fresh pair, and adds its counts to the
campaign's coverage; counters add up and distinct states unite. So the runs can go anywhere in
any order, and the coverage of all of them merged is the coverage of the campaign run in one
process, with the same digest, as long as the *set* of runs is the same. That set is fixed by run
index before anything runs: a budget of S steps is the runs 0 .. K-1, K the fewest whose
lengths (each drawn from its seed) reach S, exactly the runs the sequential engine makes
(`planned_runs`). Shard k of n takes the indices i with i % n == k - 1 (`shard_indices`);
`--jobs N` hands the indices out to N worker processes, one run at a time, in index order.

Failures: each part stops at its first failing run; the campaign's first failure is the failing
run of lowest index. With workers, no run is handed out after a failure is seen and the runs
in flight finish, so every run of lower index has run: the failure reported is the one the
sequential campaign would report, with the coverage of the runs up to it (a merge of shards
also counts the other shards' runs past it). The failing run is then run again in this process
by its seed (`rerun_failure`), which gives the operations and the error to shrink and replay as
usual.

A wall-clock budget (`--seconds`) stops handing out runs when it is spent; what then ran
depends on speed, as it does in one process.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import multiprocessing
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from pagedkv.harness.coverage import Coverage
from pagedkv.harness.swarm.engine import CampaignRun, Layer, RunFailure, execute_run
from pagedkv.harness.swarm.runs import run_seed

LayerFactory = Callable[[], Layer]
"""Builds the layer in a worker process: picklable (a module-level function, or a
`functools.partial` of one with picklable arguments)."""


def planned_runs(layer: Layer, seed: int, max_steps: int) -> int:
    """How many runs a campaign of `max_steps` steps makes when none fails: the fewest whose
    lengths reach `max_steps` (the sequential engine finishes the run in progress)."""
    steps = index = 0
    while steps < max_steps:
        steps += layer.draw(run_seed(seed, layer.name, index)).num_steps
        index += 1
    return index


def shard_indices(indices: Iterable[int], shard: int, num_shards: int) -> Iterator[int]:
    """Shard `shard` (1-based) of `num_shards`: the indices i with i % num_shards == shard - 1."""
    if not 1 <= shard <= num_shards:
        raise ValueError(f"shard {shard} of {num_shards}: need 1 <= K <= N")
    return (index for index in indices if index % num_shards == shard - 1)


def campaign_indices(layer: Layer, seed: int, max_steps: int | None) -> Iterable[int]:
    """The run indices of a campaign: those `planned_runs` gives, or every index when there is
    no step budget (a wall-clock budget stops it)."""
    if max_steps is None:
        return itertools.count()
    return range(planned_runs(layer, seed, max_steps))


@dataclass(frozen=True)
class RunResult:
    """What one run sends back from a worker: its index and seed, its coverage, its CPU time,
    and whether it failed (the error itself stays in the worker: `rerun_failure`)."""

    index: int
    seed: int
    coverage: Coverage
    cpu_seconds: float
    failed: bool


def run_one(layer: Layer, seed: int, index: int, check_every: int | None) -> RunResult:
    """Run `index` of the campaign of `seed`, on a coverage of its own."""
    start = time.process_time()
    coverage = Coverage()
    run = layer.draw(run_seed(seed, layer.name, index))
    _, error = execute_run(layer, run, coverage, check_every)
    return RunResult(index, run.seed, coverage, time.process_time() - start, error is not None)


def run_indices(
    layer: Layer,
    *,
    seed: int,
    indices: Iterable[int],
    jobs: int = 1,
    factory: LayerFactory | None = None,
    max_seconds: float | None = None,
    check_every: int | None = None,
    progress: Callable[[Coverage], None] | None = None,
) -> CampaignRun:
    """Run the campaign's runs of `indices` (in increasing order), in this process or in `jobs`
    worker processes that build their layer with `factory`; the coverage merged, stopped at the
    first failure (module docstring), which is run again here to be shrunk.

    Its `cpu_seconds` is the CPU time of every run, wherever it ran.
    """
    start_wall = time.monotonic()
    deadline = None if max_seconds is None else start_wall + max_seconds
    coverage = Coverage()
    if jobs <= 1 or factory is None:
        results: Iterator[RunResult] = _in_process(layer, seed, indices, check_every, deadline)
    else:
        results = _in_workers(factory, jobs, seed, indices, check_every, deadline)
    cpu_seconds = 0.0
    done: list[RunResult] = []
    first_failure: RunResult | None = None
    last_progress = start_wall
    for result in results:
        done.append(result)
        coverage.merge(result.coverage)
        cpu_seconds += result.cpu_seconds
        if result.failed and (first_failure is None or result.index < first_failure.index):
            first_failure = result
        now = time.monotonic()
        if progress is not None and now - last_progress >= 0.1:
            last_progress = now
            progress(coverage)
    failure = None
    if first_failure is not None:
        # The runs up to the failing one, as one process would have counted them.
        coverage = Coverage()
        for result in done:
            if result.index <= first_failure.index:
                coverage.merge(result.coverage)
        failure = rerun_failure(layer, first_failure.index, first_failure.seed, check_every)
    return CampaignRun(
        layer.name, seed, coverage, cpu_seconds, time.monotonic() - start_wall, failure
    )


def rerun_failure(layer: Layer, index: int, seed: int, check_every: int | None) -> RunFailure:
    """The failing run of `index` (run seed `seed`), run again here: its operations and error.
    A run that passes here failed only over there: a harness error that says so."""
    run = layer.draw(seed)
    ops, error = execute_run(layer, run, Coverage(), check_every)
    if error is None:
        error = RuntimeError(
            f"run {seed} (index {index}) failed in a worker process but passed when run again "
            "in the main process: its outcome depends on the process"
        )
    return RunFailure(run, index, tuple(ops), error)


def _in_process(
    layer: Layer,
    seed: int,
    indices: Iterable[int],
    check_every: int | None,
    deadline: float | None,
) -> Iterator[RunResult]:
    for index in indices:
        if deadline is not None and time.monotonic() >= deadline:
            return
        result = run_one(layer, seed, index, check_every)
        yield result
        if result.failed:
            return


_worker_layer: list[Layer] = []
"""The layer of this worker process (built once, by `_start_worker`)."""


def _start_worker(factory: LayerFactory) -> None:
    logging.disable(logging.WARNING)  # refused resets log a warning each (as in `verify`)
    _worker_layer[:] = [factory()]


def _work(seed: int, index: int, check_every: int | None) -> RunResult:
    return run_one(_worker_layer[0], seed, index, check_every)


def _in_workers(
    factory: LayerFactory,
    jobs: int,
    seed: int,
    indices: Iterable[int],
    check_every: int | None,
    deadline: float | None,
) -> Iterator[RunResult]:
    """Results as they come, from `jobs` workers kept busy with the next index in order; none
    handed out after a failure or past the deadline."""
    sys.stdout.flush()  # a forked worker flushes what it inherited of the streams at exit
    sys.stderr.flush()
    methods = multiprocessing.get_all_start_methods()
    context = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
    pending = iter(indices)
    stop = False
    with concurrent.futures.ProcessPoolExecutor(
        max_workers=jobs, mp_context=context, initializer=_start_worker, initargs=(factory,)
    ) as executor:
        in_flight: set[concurrent.futures.Future[RunResult]] = set()
        while True:
            while not stop and len(in_flight) < 2 * jobs:
                if deadline is not None and time.monotonic() >= deadline:
                    stop = True
                    break
                index = next(pending, None)
                if index is None:
                    stop = True
                    break
                in_flight.add(executor.submit(_work, seed, index, check_every))
            if not in_flight:
                return
            done, in_flight = concurrent.futures.wait(
                in_flight, return_when=concurrent.futures.FIRST_COMPLETED
            )
            for future in sorted(done, key=lambda f: f.result().index):
                result = future.result()
                stop = stop or result.failed
                yield result
