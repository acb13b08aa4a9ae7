"""`k6vsr server start|stop|status`: the local Prefect server."""

from __future__ import annotations

import argparse
from typing import Any

from k6vsr_core.errors import UserFacingError
from runtime import flow_leases, prefect_api, prefect_server


def run(args: argparse.Namespace) -> dict[str, Any]:
    """`k6vsr server start|stop|status`: the local server, whatever `PREFECT_API_URL` says (status names it)."""
    if args.action != "start" and (args.database is not None or args.secondary):
        raise UserFacingError(f"--database and --secondary go with `k6vsr server start`, not {args.action}")
    if args.action == "start":
        # --secondary alone keeps the remembered database; --database alone makes a primary server.
        secondary = args.secondary if args.database is not None or args.secondary else None
        flow_leases.mark_crashed_runs(prefect_server.start_server(database=args.database, secondary=secondary))
    elif args.action == "stop":
        was_running = prefect_server.stop_server()
        return {**prefect_server.server_status().model_dump(mode="json"), "stopped": was_running}
    status = prefect_server.server_status()
    # The runs that commands report to: those of PREFECT_API_URL when it is set, else the local server's.
    url = prefect_api.configured_api_url() or (status.url if status.running else None)
    if url:
        flow_leases.mark_crashed_runs(url)
    return status.model_dump(mode="json")
