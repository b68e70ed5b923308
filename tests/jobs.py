"""The suite's subprocess work, run on a background thread beside the in-process tests.

A process compiling or running XLA programs on the CPU keeps about one core busy (the whole suite, run in order,
kept 1.36 of CI's 2 cores busy: measured 2026-12-01), and about half of the suite's time is subprocesses: CLI fits,
the TPU compiler, upstream's step in a child, the benchmark and README scripts. Each is a *job*: a function of
:class:`JobInputs` and a directory of its own that starts processes and returns what its tests assert on.

``@job_fixture`` makes a job a session fixture of its name: a test takes it as any fixture and gets the job's
result (waiting for it; the job's exception is raised in the test). When the session starts, conftest runs the jobs
of the selected tests one at a time (one process beside this one is what 2 cores hold), in the order of ``JOBS``
(the order the test modules are imported), and moves the tests that read a job after the others, those of the last
job first, so the jobs run while the in-process tests do; when those are done, the main thread runs the queue's
jobs from its end while the worker runs it from the front. A job must build its child's environment from
``JobInputs.env``: code it calls that reads ``os.environ`` itself (the ``aot`` check's children) sees what an
in-process test set meanwhile. conftest prints each job's time at the end of the session.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from support.models import loop_config


@dataclass(frozen=True)
class JobInputs:
    """What a job may read (made on the main thread before any job starts; read only)."""

    synth_dir: str
    """conftest's session dataset."""
    tiny: Any
    """conftest's ``tiny``: the numerics model's configs, batches and initial weights."""
    loop_tiny: Any
    """conftest's ``loop_tiny``: the same for the loop model."""
    loop_config: Path
    """conftest's ``loop_config`` as a ``fit`` YAML: the loop model's straight fit, as the CLI reads it."""
    env: dict[str, str]
    """The environment as the session started: a child's base (in-process tests set variables meanwhile)."""


Job = Callable[[JobInputs, Path], Any]


#: Every job of the suite by its fixture name, in the order the test modules define them.
JOBS: dict[str, Job] = {}


def job_fixture(job: Job) -> Any:
    """``job`` as a session fixture named as it is: its result, computed in the background (:class:`Background`)."""
    assert job.__name__ not in JOBS, f"two jobs are named {job.__name__}"
    JOBS[job.__name__] = job

    @pytest.fixture(scope="session", name=job.__name__)
    def result(background: Background) -> Any:
        return background.result(job)

    result.__doc__ = job.__doc__
    return result


def jobs_of(item: pytest.Item) -> list[Job]:
    """The jobs a test reads (directly or through its fixtures)."""
    return [JOBS[name] for name in item.fixturenames if name in JOBS]


class Background:
    """The session's jobs on one worker thread, started in the order given; a job asked for before the worker has
    started it runs on the asking thread instead (the readers ask from the last job back: the worker and the main
    thread then meet in the middle of the queue, both cores busy to the end)."""

    def __init__(self, inputs: JobInputs | None, jobs: Iterable[Job], root: Path) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="job")
        self._futures: dict[Job, concurrent.futures.Future] = {}
        self._inputs, self._root = inputs, root
        self._started = time.monotonic()
        self.ended: dict[str, tuple[float, float, str]] = {}
        """Each finished job's (seconds it ran, seconds since the jobs started when it ended, the thread it ran on)."""
        for job in jobs:
            (root / job.__name__).mkdir(parents=True)
            self._futures[job] = self._pool.submit(self._timed, job)

    def _timed(self, job: Job) -> Any:
        start = time.monotonic()
        try:
            return job(self._inputs, self._root / job.__name__)
        finally:
            end = time.monotonic()
            self.ended[job.__name__] = (end - start, end - self._started, threading.current_thread().name)

    def result(self, job: Job) -> Any:
        """``job``'s return value, once it has run (it raises what the job raised)."""
        if job not in self._futures:
            raise RuntimeError(f"{job.__name__} was not started: no collected test takes it as a fixture")
        future = self._futures[job]
        if future.cancel():  # still queued: run it here rather than wait behind the worker's queue
            future = self._futures[job] = concurrent.futures.Future()
            try:
                future.set_result(self._timed(job))
            except BaseException as error:  # noqa: BLE001 - every reader of the job gets what it raised
                future.set_exception(error)
        return future.result()

    def summary(self) -> str:
        """One line per finished job: how long it ran, when it ended and where (what to cut when the suite grows)."""
        return "\n".join(f"{name:<20} {took:6.0f} s, ended at {at:6.0f} s on {thread}"
                         for name, (took, at, thread) in self.ended.items())

    def close(self) -> None:
        """Drop the jobs not started (a session stopped early); the running one finishes."""
        self._pool.shutdown(wait=True, cancel_futures=True)


# The scheduling: the tests that read a job run last, the jobs of the selected tests start with the session.


def job_order(item: pytest.Item) -> int:
    """0 for a test that reads no background job, else how far from the end of ``jobs.JOBS`` (the order the worker
    runs them in) the last of its jobs is, plus 1."""
    order = list(JOBS.values())
    return max((len(order) - order.index(job) for job in jobs_of(item)), default=0)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The tests that read a background job (``jobs.py``) run after the others, those of the last jobs first: a job
    the worker has not started by then runs in this process's thread (``jobs.Background``)."""
    items.sort(key=job_order)


@pytest.fixture(scope="session", autouse=True)
def background(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Background]:
    """The selected tests' jobs (``jobs.py``), started now, one at a time, in the order of ``jobs.JOBS``."""
    needed = {job for item in request.session.items for job in jobs_of(item)}
    jobs = [job for job in JOBS.values() if job in needed]
    inputs = None
    if jobs:
        synth_dir, tiny = request.getfixturevalue("synth_dir"), request.getfixturevalue("tiny")
        base = tmp_path_factory.mktemp("loop-config")
        config = base / "config.yaml"
        loop = dataclasses.asdict(loop_config(tiny, synth_dir, base, "replay"))
        config.write_text(yaml.safe_dump(loop, sort_keys=False))
        inputs = JobInputs(synth_dir, tiny, request.getfixturevalue("loop_tiny"), config, dict(os.environ))
    jobs_running = Background(inputs, jobs, tmp_path_factory.mktemp("jobs"))
    _SESSION_JOBS.append(jobs_running)
    yield jobs_running
    jobs_running.close()


_SESSION_JOBS: list[Background] = []


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Each background job's time, after the durations (what to cut when the suite grows)."""
    for jobs_running in _SESSION_JOBS:
        if jobs_running.ended:
            terminalreporter.write_sep("-", "background jobs")
            terminalreporter.write_line(jobs_running.summary())
