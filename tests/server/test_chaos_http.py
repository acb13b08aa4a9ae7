"""The fault campaign of bench/chaos_http.py, short: a few uploaded jobs, a few kills of `k6vsr serve` and of its
job children at random moments (seeded), the same checks.

After the last fault every accepted job has ended (completed, or failed with a reason), none is lost, every
completed output is the clean server's bytes, no job record is torn and nothing a server started outlives it.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import chaos_http  # noqa: E402 - bench/ is put on the path above


def test_a_short_campaign_of_server_and_job_kills_loses_no_job_and_gives_the_same_bytes(tmp_path: Path) -> None:
    # Seed 5 draws a SIGKILL of a job child, then a SIGKILL and a SIGTERM of the server.
    campaign = chaos_http.HttpCampaign(tmp_path / "work", clips=2, faults=3, seed=5)
    outcome = chaos_http.run_campaign(campaign)
    assert len(outcome.faults) == 3, outcome
    assert {fault.target for fault in outcome.faults} == {"child", "server"}, outcome.faults
    assert outcome.hangs == [] and outcome.lost == [] and outcome.unreasoned == [], outcome
    assert outcome.accepted >= 2 and outcome.completed + len(outcome.failed) == outcome.accepted, outcome
    assert outcome.unfinished == [] and outcome.completed >= 2 and outcome.different == [], outcome
    assert outcome.torn == [] and outcome.strays == [], outcome
    assert outcome.survived
