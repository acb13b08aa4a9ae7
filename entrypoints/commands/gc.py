"""`k6vsr gc`: reclaim the disk of finished or abandoned runs."""

from __future__ import annotations

import argparse
from typing import Any

from entrypoints.command_inputs import store_from
from storage import collect_garbage


def run(args: argparse.Namespace) -> dict[str, Any]:
    report = collect_garbage(store_from(args), args.keep_outputs, args.older_than_hours * 3600, dry_run=args.dry_run)
    reclaimed = sum(r["bytes"] for r in report if r["deleted"])
    return {"runs": report, "bytes_reclaimed": reclaimed, "dry_run": args.dry_run}
