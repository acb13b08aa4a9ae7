"""The local cluster's workers say nothing of a heartbeat their scheduler (the stopped command) did not answer, and
everything else as before."""

from __future__ import annotations

import logging

import pytest

from runtime import runners, worker_quiet


def test_the_local_cluster_s_workers_load_the_preload() -> None:
    _, kwargs = runners.cluster_spec(2, gpus=False)
    assert kwargs["preload"] == ["runtime.worker_quiet", "tasks.worker_preload"]


def test_gpu_and_warm_workers_load_it_before_the_model() -> None:
    """`--gpus` and the warm workers build their workers alike (`make_cluster`)."""
    from runtime import warm_workers

    for devices in ([], ["0", "1"]):
        options = warm_workers.worker_options(devices, 1, 2)
        assert options["preload"] == ["runtime.worker_quiet", "tasks.worker_preload"]
        assert warm_workers.cpu_lane_options(2, 2)["preload"] == ["runtime.worker_quiet", "tasks.worker_preload"]


def test_a_lost_heartbeat_is_dropped_and_other_errors_are_kept(caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger("distributed.worker")
    before = list(logger.filters)
    try:
        worker_quiet.dask_setup(worker=None)
        with caplog.at_level(logging.ERROR, logger="distributed.worker"):
            try:
                raise ConnectionResetError(104, "Connection reset by peer")
            except ConnectionResetError:
                logger.exception("Failed to communicate with scheduler during heartbeat.")
            logger.error("Compute Failed")
        assert [r.getMessage() for r in caplog.records] == ["Compute Failed"]
    finally:
        logger.filters[:] = before
