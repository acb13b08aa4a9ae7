"""`k6vsr workers start|stop|status`: the warm workers."""

from __future__ import annotations

import argparse
from typing import Any

from entrypoints.command_inputs import model_from
from k6vsr_core.errors import UserFacingError
from runtime import warm_workers
from service.runs import model_info


def run(args: argparse.Namespace) -> dict[str, Any]:
    """`k6vsr workers start|stop|status`: the warm workers (runtime.warm_workers)."""
    if args.action == "start":
        gpus = args.gpus or (args.workers == 0 and bool(warm_workers.gpu_ids()))
        if args.workers < 0:
            raise UserFacingError(f"-n must be at least 1, not {args.workers}")
        spec = model_from(args).model_dump_json() if args.model else None
        if args.model:
            model_info(model_from(args))  # a missing or broken model fails here, in one line
        warm_workers.start_workers(args.workers, gpus=gpus, model_json=spec)
    elif args.action == "stop":
        was_running = warm_workers.stop_workers()
        return {**warm_workers.workers_status().model_dump(mode="json"), "stopped": was_running}
    return warm_workers.workers_status().model_dump(mode="json")
