"""`k6vsr demo`: the whole pipeline on a synthetic clip and a tiny random model."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from entrypoints.demo import run_demo
from entrypoints.request_inputs import params_from
from k6vsr_core import status


def run(args: argparse.Namespace) -> dict[str, Any]:
    status.say("loading Prefect and torch")  # seconds, before the bar can show

    return run_demo(Path(args.output_dir), params_from(argparse.Namespace(scale=args.scale)), quiet=args.json)
