"""The fault campaign of bench/chaos.py, short: a few clips, a few faults at random moments (seeded), same checks.

Real `k6vsr archive` commands on the CPU with the bench-only stand-in for the networks and their own local Prefect
server; each fault is a SIGKILL or SIGTERM of the command or of the local server. After the last rerun every output
is byte-identical to a clean archive's, no finished item was computed twice, nothing the commands started is left
running, no flow run is left Running, the manifest lists every clip done and every failed run said why.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import chaos  # noqa: E402 - bench/ is put on the path above


def test_a_short_campaign_of_kills_leaves_the_same_bytes_and_nothing_behind(tmp_path: Path) -> None:
    campaign = chaos.Campaign(
        tmp_path / "work", clips=2, faults=3, seed=3, targets=("command", "server"), measure_fixed=False
    )
    outcome = chaos.run_campaign(campaign)
    assert len(outcome.faults) == 3, outcome
    assert {fault.target for fault in outcome.faults} <= {"command", "server"}
    assert outcome.hangs == []
    assert (outcome.outputs, outcome.identical, outcome.different) == (2, 2, [])
    assert outcome.recomputed == {}
    assert outcome.strays == []
    assert outcome.flow_runs_left == {"running": 0, "pending": 0}
    assert outcome.manifest_problems == []
    assert outcome.unclear == []
    assert outcome.survived
