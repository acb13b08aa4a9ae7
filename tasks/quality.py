"""The quality report of a run's output (`k6vsr_core.quality`), measured once and kept in the run store.

It reads the finished output and the source, so it runs after the mux, on the CPU of the flow's process (no
tensor). A run whose output was already in the store finds the report there. A measurement that fails is logged and
the run goes on without one: the report describes the output, it never decides it.
"""

from __future__ import annotations

import time

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from k6vsr_core.quality import QualityReport, measure_files
from service.runs import RunRef

REPORT = "quality.json"


@task(name="quality", task_run_name="quality-{run.run_key}", cache_policy=NO_CACHE)
def measure_quality(run: RunRef, attempt: str) -> QualityReport | None:
    """The output's quality report; None for a latent run (no source frames to compare with) or when it fails."""
    store = run.open()
    path = store.where / REPORT
    try:
        manifest = store.read_manifest()
        if manifest.latent_fps is not None:
            return None
        if store.file_done(path, "quality", "all"):
            return QualityReport.model_validate_json(path.read_bytes())
        started = time.perf_counter()
        with store.output_path.fetch() as output:
            report = measure_files(manifest.plan, output, store.source_file(manifest))
        tmp = store.temp_file(path, ".json")
        try:
            tmp.write_text(report.model_dump_json(indent=2))
            store.commit_file(tmp, path, "quality", "all", time.perf_counter() - started, attempt)
        finally:
            tmp.unlink(missing_ok=True)
        return report
    except Exception as err:  # noqa: BLE001 - a report never fails the run it describes
        get_run_logger().warning("could not measure the output's quality: %s", err)
        return None
