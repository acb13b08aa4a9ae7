"""The two lanes of `runtime.schedule` on a flow run's task runner: where model work and CPU work run.

- Threads (a command computing in its own process): the model lane is the flow's own runner, `MODEL_SLOTS` threads
  (one task's store reads and writes overlap the other's model work; the memory budget allows for two at once); the
  CPU lane is a thread pool of its own, so a blend or a segment never waits for a model thread.
- Dask (warm workers, `--workers`, `--gpus`, a scheduler's address): both lanes are the cluster.
  - Warm workers and `--gpus` (`runtime.warm_workers.make_cluster`): model workers declare `MODEL_SLOTS` units of
    `MODEL_RESOURCE` and run that many threads, CPU-lane workers declare `CPU_RESOURCE`; each lane's task asks for
    one unit of its own resource (`dask.annotate`), so the process that drives the GPU runs model tasks alone.
  - `--workers N`: each worker declares `MODEL_SLOTS` units of `MODEL_RESOURCE` and runs `WORKER_THREADS` threads;
    a model task asks for one unit, so a worker runs two model tasks at most and its other threads take blends and
    segments.
  - The workers of a cluster started by others may declare no such resource: an annotated task would then wait
    forever, so none is annotated and the model lane is as wide as the cluster's threads.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from prefect.task_runners import ThreadPoolTaskRunner

from k6vsr_core.contract.plan import ClipPlan
from runtime.runners import is_dask_runner, warm_address
from runtime.schedule import ModelQueue
from runtime.slots import CPU_RESOURCE, CPU_THREADS, MODEL_RESOURCE, MODEL_SLOTS

SubmitTask = Callable[[Any, dict[str, Any]], Any]  # (task, parameters) -> its Prefect future


@dataclass(frozen=True)
class Lanes:
    model: SubmitTask
    cpu: SubmitTask
    slots: int  # model tasks the flow keeps running at once
    where: str  # how the lanes were chosen, for the run's log
    # CPU tasks at once where the two lanes share threads (None: the CPU lane's own pool bounds them); None or a
    # count, a window's blend may start with its first tile and wait for the others on its thread.
    cpu_slots: int | None = None
    stream_blend: bool = True
    spread: bool = False  # model tasks go to Dask workers, which may be several devices

    def fuses(self, plan: ClipPlan) -> bool:
        """Whether a chunk's denoise and its tiles' decodes are one task (`runtime.schedule.clip_graph(fused=...)`):
        in this process's threads always (one device takes them in that order anyway); on Dask workers only where a
        chunk is one tile (the default), so that a chunk's tiles are still decoded on as many workers as are free."""
        return not self.spread or all(len(chunk.tiles) == 1 for chunk in plan.chunks)


@contextmanager
def lanes_for(runner: Any) -> Iterator[Lanes]:
    """The lanes on `runner`, the task runner the flow run entered."""
    if not is_dask_runner(runner):
        pool: ThreadPoolTaskRunner[Any] = ThreadPoolTaskRunner(max_workers=CPU_THREADS)
        with pool as cpu:
            yield Lanes(runner.submit, cpu.submit, MODEL_SLOTS, f"{MODEL_SLOTS} model threads, {CPU_THREADS} CPU")
        return
    info = runner.client.scheduler_info(n_workers=-1)
    workers = list(info["workers"].values())
    cluster = "the warm workers" if info["address"] == warm_address() else "Dask workers"
    on = f"tiles run on {cluster} at {info['address']}"
    declared = [int(worker.get("resources", {}).get(MODEL_RESOURCE, 0)) for worker in workers]
    lanes = [int(worker.get("resources", {}).get(CPU_RESOURCE, 0)) for worker in workers]
    if workers and any(declared) and any(lanes) and all(m or c for m, c in zip(declared, lanes, strict=True)):
        # Model workers and CPU-lane workers apart: each lane asks for its own resource, so a blend or a segment
        # never runs in the process that drives the GPU.
        where = f"{on}: {sum(declared)} model slots on {sum(map(bool, declared))} workers, {sum(lanes)} CPU slots on"
        where += f" {sum(map(bool, lanes))} CPU-lane workers"
        yield Lanes(
            _annotated(runner, MODEL_RESOURCE),
            _annotated(runner, CPU_RESOURCE),
            sum(declared),
            where,
            cpu_slots=sum(lanes),
            spread=True,
        )
        return
    if workers and all(declared):
        # The threads a worker has beside its model slots: so many blends and segments at once, never a thread more,
        # so that a model task always finds one.
        spare = sum(max(0, int(w.get("nthreads", 1)) - d) for w, d in zip(workers, declared, strict=True))
        where = f"{on}: {sum(declared)} model slots and {spare} CPU threads on {len(declared)} workers"
        model = _annotated(runner, MODEL_RESOURCE)
        yield Lanes(model, runner.submit, sum(declared), where, cpu_slots=spare, stream_blend=spare > 0, spread=True)
        return
    threads = sum(int(worker.get("nthreads", 1)) for worker in workers) or 1
    where = f"{on}: {threads} threads, without {MODEL_RESOURCE}"
    # Both lanes take any thread: a blend waiting there for its tiles could hold the one a decode needs.
    yield Lanes(runner.submit, runner.submit, threads, where, stream_blend=False, spread=True)


def _annotated(runner: Any, resource: str) -> SubmitTask:
    """Submits to `runner`, the task asking Dask for one unit of `resource`."""
    import dask

    def submit(task: Any, parameters: dict[str, Any]) -> Any:
        with dask.annotate(resources={resource: 1}):
            return runner.submit(task, parameters)

    return submit


@dataclass
class SharedQueue:
    """The lane queues of the clips of an archive, whose tasks go to the same workers: made to the width of the
    first clip's lanes (every clip's lanes are the same workers)."""

    _queues: tuple[ModelQueue, ModelQueue | None] | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def for_lanes(self, lanes: Lanes) -> tuple[ModelQueue, ModelQueue | None]:
        with self._lock:
            if self._queues is None:
                self._queues = _queues(lanes)
            return self._queues


def shared_queues(lanes: Lanes, shared: SharedQueue | None = None) -> tuple[ModelQueue, ModelQueue | None]:
    """The model queue and CPU queue (None: unbounded) a clip's scheduler takes slots from: `shared`'s (an archive's
    clips), else its own."""
    return shared.for_lanes(lanes) if shared is not None else _queues(lanes)


def _queues(lanes: Lanes) -> tuple[ModelQueue, ModelQueue | None]:
    cpu = ModelQueue(lanes.cpu_slots) if lanes.cpu_slots else None
    return ModelQueue(lanes.slots), cpu
