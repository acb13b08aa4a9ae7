"""The two lanes of `flows.schedule` on a flow run's task runner: where model work and CPU work run.

- Threads (a command computing in its own process): the model lane is the flow's own runner, `MODEL_SLOTS` threads
  (one task's store reads and writes overlap the other's model work; the memory budget allows for two at once); the
  CPU lane is a thread pool of its own, so a blend or a segment never waits for a model thread.
- Dask (warm workers, `--workers`, `--gpus`, a scheduler's address): both lanes are the cluster. The workers this
  project starts declare `MODEL_SLOTS` units of the resource `MODEL_RESOURCE` and run `WORKER_THREADS` threads;
  a model task asks for one unit (`dask.annotate`), so a worker runs two model tasks at most and its other threads
  take blends and segments. The workers of a cluster started by others may declare no such resource: an annotated
  task would then wait forever, so none is annotated and the model lane is as wide as the cluster's threads.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from prefect.task_runners import ThreadPoolTaskRunner

from flows.runners import is_dask_runner, warm_address
from flows.slots import CPU_THREADS, MODEL_RESOURCE, MODEL_SLOTS

SubmitTask = Callable[[Any, dict[str, Any]], Any]  # (task, parameters) -> its Prefect future


@dataclass(frozen=True)
class Lanes:
    model: SubmitTask
    cpu: SubmitTask
    slots: int  # model tasks the flow keeps running at once
    where: str  # how the lanes were chosen, for the run's log


@contextmanager
def lanes_for(runner: Any) -> Iterator[Lanes]:
    """The lanes on `runner`, the task runner the flow run entered."""
    if not is_dask_runner(runner):
        with ThreadPoolTaskRunner(max_workers=CPU_THREADS) as cpu:
            yield Lanes(runner.submit, cpu.submit, MODEL_SLOTS, f"{MODEL_SLOTS} model threads, {CPU_THREADS} CPU")
        return
    info = runner.client.scheduler_info(n_workers=-1)
    workers = info["workers"].values()
    cluster = "the warm workers" if info["address"] == warm_address() else "Dask workers"
    on = f"tiles run on {cluster} at {info['address']}"
    declared = [int(worker.get("resources", {}).get(MODEL_RESOURCE, 0)) for worker in workers]
    if workers and all(declared):
        import dask

        def model(task: Any, parameters: dict[str, Any]) -> Any:
            with dask.annotate(resources={MODEL_RESOURCE: 1}):
                return runner.submit(task, parameters)

        yield Lanes(
            model, runner.submit, sum(declared), f"{on}: {sum(declared)} model slots on {len(declared)} workers"
        )
        return
    threads = sum(int(worker.get("nthreads", 1)) for worker in workers) or 1
    yield Lanes(runner.submit, runner.submit, threads, f"{on}: {threads} threads, without {MODEL_RESOURCE}")
