"""The dataset index's benchmark stage (``tools/benchmark.py --what index``): every reader and rank
count measured in fresh spawned interpreters, as a run's ranks are."""

from __future__ import annotations

from multiprocessing import resource_tracker

import pytest


@pytest.fixture
def spawn_tracker_stopped():
    """Stop the resource tracker the spawned measurements started, which would outlive the session."""
    yield
    getattr(resource_tracker._resource_tracker, "_stop", lambda: None)()


@pytest.mark.usefixtures("spawn_tracker_stopped")
@pytest.mark.slow  # a dozen fresh interpreters: ~2 minutes
def test_the_benchmark_stage_reports_every_reader_and_rank_count():
    from benchmarks.index import READERS as BENCH_READERS
    from benchmarks.index import measure, table

    records: list[dict] = []
    returned = measure(records.append, entries=2_000, ranks=(2,), repeats=1, workers=1)
    assert returned == records
    scans = {r["reader"]: r for r in records if r["what"] == "index"}
    assert sorted(scans) == sorted(BENCH_READERS) and all(r["samples"] == 2_000 for r in scans.values())
    assert scans["index"]["index_bytes"] < scans["imagefolder"]["index_bytes"]
    assert scans["index"]["worker_growth_bytes_median"] < scans["imagefolder"]["worker_growth_bytes_median"]
    assert sorted(r["reader"] for r in records if r["what"] == "index_ranks") == sorted(BENCH_READERS)
    assert all(r["startup_s_median"] > 0 for r in records if r["what"] == "index_ranks")
    assert len(table(records).splitlines()) == len(records)
