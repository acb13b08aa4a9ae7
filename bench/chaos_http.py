"""The fault campaign of the HTTP job API: kills of `k6vsr serve` and of its job children while jobs upload and run.

    nice -n 10 python bench/chaos_http.py --clips 8 --faults 10 [--seed 1] [--fake-ms 5] [--work DIR]
        [--json-out FILE]

What runs: N synthetic clips (`archive_scale.make_clips`) uploaded as jobs to a real `k6vsr serve` on loopback, on
the CPU with the tiny random bundle and the bench-only stand-in for the networks (`bench/fake_model.py`). First a
clean server on a store of its own, the reference: every clip uploaded, every job awaited, every output fetched.
Then the campaign, on a new store: the clips are uploaded one after another as a client would (one that retries an
upload the server did not take: not answered, or its queue full), while faults land at random moments (a seeded
`random.Random`): SIGKILL or SIGTERM of the server, or of one of its job children. A server that is gone is started
again on the same store and port, as a supervisor (systemd, a container's restart policy) would. Once every fault
is spent and every accepted job has ended, the server is stopped and:

- every job the server accepted (answered 200 with an id) is found and ended: completed, or failed with a reason;
  none lost, none left queued or in progress; a job failed because its child died is submitted again, as its error
  advises, and every clip ends with a completed job;
- every completed job's output is byte-identical to the clean server's for its clip;
- every job record in the store parses (none torn);
- nothing a server started outlives its stop (its Prefect server, meant to last, is stopped by the campaign).

It prints the faults, a summary table and the result as JSON (`--json-out`); it exits 1 when a check fails.
`tests/server/test_chaos_http.py` runs a short campaign of the same code.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import archive_scale  # noqa: E402 - the bench folder is put on the path above
import chaos  # noqa: E402

KEY = "chaos-key-0123456789"
ENDED = ("completed", "failed", "cancelled")
START_S = 180.0  # a server that does not answer /health in this long after its start is a finding
JOB_S = 600.0  # an accepted job that has not ended this long after the last fault is a finding
TARGETS = ("server", "child")
CHILD_WAIT_S = 30.0  # how long a fault meant for a job child waits for one to run a job
RESUBMIT = "worker_exited"  # a job whose child died: "resubmit the same request to resume from its finished tiles"


@dataclass
class HttpCampaign:
    work: Path
    clips: int = 8
    faults: int = 10
    seed: int = 1
    fake_ms: float = 5.0


@dataclass
class HttpFault:
    at_s: float  # seconds into the campaign
    target: str
    signal: str
    pid: int
    accepted_before: int  # jobs accepted when it hit
    ended_before: int  # of which ended


@dataclass
class HttpOutcome:
    clean_s: float = 0.0
    campaign_s: float = 0.0
    faults: list[HttpFault] = field(default_factory=list)
    restarts: int = 0
    upload_retries: int = 0  # uploads the server did not take (it was down or going, or its queue full): sent again
    resubmitted: int = 0  # jobs failed because their child died, submitted again as their error advises
    accepted: int = 0
    completed: int = 0
    failed: list[str] = field(default_factory=list)  # `<clip>: <reason>` of each failed job
    unreasoned: list[str] = field(default_factory=list)  # failed jobs without a reason
    lost: list[str] = field(default_factory=list)  # accepted jobs the server no longer knows, or never ended
    unfinished: list[str] = field(default_factory=list)  # clips with no completed job in the end
    different: list[str] = field(default_factory=list)
    torn: list[str] = field(default_factory=list)
    strays: list[str] = field(default_factory=list)
    hangs: list[str] = field(default_factory=list)

    @property
    def survived(self) -> bool:
        return (
            self.accepted > 0
            and self.completed + len(self.failed) == self.accepted
            and not (self.unreasoned or self.lost or self.unfinished or self.different or self.torn)
            and not (self.strays or self.hangs)
        )


def _cmdline(process: object) -> list[str]:
    import psutil

    try:
        return process.cmdline()  # type: ignore[attr-defined]
    except psutil.Error:
        return []


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Serve:
    """`k6vsr serve` on one store and port, started again as often as it is killed, each start logged."""

    def __init__(self, work: Path, store: Path, name: str, env: dict[str, str]) -> None:
        self.work, self.store, self.name, self.env = work, store, name, env
        self.port = free_port()
        self.process: subprocess.Popen | None = None
        self.starts = 0
        self.client = httpx.Client(
            base_url=f"http://127.0.0.1:{self.port}", headers={"Authorization": f"Bearer {KEY}"}, timeout=30
        )

    def start(self) -> None:
        self.starts += 1
        log = (self.work / "logs" / f"{self.name}-{self.starts:03d}.log").open("w")
        command = [
            sys.executable, "-m", "entrypoints.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port),
            "--store", str(self.store), "--model", str(self.work / "tiny"), "--device", "cpu", "--api-key", KEY,
            "--max-queued-per-key", "1000",
        ]  # fmt: skip
        self.process = subprocess.Popen(
            command, env=self.env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline and self.process.poll() is None:
            try:
                if self.client.get("/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"{self.name} start {self.starts} did not answer /health; see {log.name}")

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def children(self) -> list[int]:
        """The job children of this start of the server (each in a session of its own)."""
        import psutil

        assert self.process is not None
        try:
            found = psutil.Process(self.process.pid).children()
        except psutil.Error:
            return []
        return [child.pid for child in found if "entrypoints.server.child" in " ".join(_cmdline(child))]

    def leftovers(self, children: list[int]) -> list[str]:
        """What a server that has ended left alive: its session's processes and the job `children` it had (killed,
        once listed)."""
        import psutil

        assert self.process is not None
        deadline = time.monotonic() + 10  # a child ends with its server (PR_SET_PDEATHSIG), within a moment
        while any(psutil.pid_exists(pid) for pid in children) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = chaos.session_members(self.process.pid)
        for pid in children:
            left += chaos.session_members(pid)
        for session in [self.process.pid, *children]:
            chaos._kill_session(session)
        return left

    def stop(self) -> list[str]:
        """SIGTERM, as a supervisor stops it; what it leaves alive is returned (and killed)."""
        if self.process is None:
            return []
        children = self.children()
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.leftovers(children)

    def upload(self, clip: Path) -> str | None:
        """The job id, or None where the server did not take it (down, going, or busy)."""
        files = {"video_reference": (clip.name, clip.read_bytes(), "video/mp4")}
        try:
            response = self.client.post("/v1/videos", files=files, data={"sr_resolution_scale": "2", "seed": "7"})
        except httpx.TransportError:
            return None
        return str(response.json()["id"]) if response.status_code == 200 else None

    def job(self, job_id: str) -> dict | None:
        """The job as the server sees it; None while the server does not answer, {} when it does not know it."""
        try:
            response = self.client.get(f"/v1/videos/{job_id}")
        except httpx.TransportError:
            return None
        if response.status_code == 404:
            return {}
        return response.json() if response.status_code == 200 else None

    def content_sha(self, job_id: str) -> str:
        response = self.client.get(f"/v1/videos/{job_id}/content")
        response.raise_for_status()
        return hashlib.sha256(response.content).hexdigest()

    def close(self) -> None:
        self.client.close()


def clean_run(campaign: HttpCampaign, clips: list[Path], env: dict[str, str], outcome: HttpOutcome) -> dict[str, str]:
    """The reference: every clip's output sha256 from a server that nothing disturbs."""
    serve = Serve(campaign.work, campaign.work / "clean-store", "clean", env)
    started = time.perf_counter()
    try:
        serve.start()
        ids = {}
        for clip in clips:
            deadline = time.monotonic() + JOB_S
            while (job_id := serve.upload(clip)) is None:  # its queue is full (429): a place frees as a job ends
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the clean server did not take {clip.name}")
                time.sleep(0.5)
            ids[clip.name] = job_id
        shas = {}
        for name, job_id in ids.items():
            deadline = time.monotonic() + JOB_S
            while (job := serve.job(job_id) or {}).get("status") not in ENDED:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the clean server's job for {name} did not end")
                time.sleep(0.3)
            if job["status"] != "completed":
                raise RuntimeError(f"the clean server's job for {name} ended {job['status']}: {job.get('error')}")
            shas[name] = serve.content_sha(job_id)
        outcome.clean_s = time.perf_counter() - started
        return shas
    finally:
        serve.stop()
        serve.close()
        stop_prefect(campaign.work / "clean-store")


def stop_prefect(store: Path) -> None:
    """The Prefect server a `serve` keeps in its store (it outlives the serve by design)."""
    from runtime import prefect_server

    prefect_server.stop_server(store / "prefect-server")


def inject(
    campaign: HttpCampaign, clips: list[Path], serve: Serve, outcome: HttpOutcome, rng: random.Random
) -> dict[str, str]:
    """Uploads and faults until every fault is spent and every accepted job ended; returns job id -> clip name."""
    to_upload = list(clips)
    clips_by_name = {clip.name: clip for clip in clips}
    jobs: dict[str, str] = {}
    ended: dict[str, dict] = {}
    started = time.perf_counter()
    # A fault's moment: within about two jobs' worth of the clean run's time per clip, so that faults land while jobs
    # upload, queue and run.
    per_clip = max(1.0, outcome.clean_s / max(1, len(clips)))
    planned: tuple[float, str, str] | None = None  # the next fault: its moment, target and signal
    last_fault = started
    while True:
        now = time.perf_counter()
        if not serve.alive():
            outcome.restarts += 1
            serve.start()
            continue
        if planned is None and len(outcome.faults) < campaign.faults:  # drawn once the server answers again
            planned = (now + rng.uniform(0.5, 2.0 * per_clip), rng.choice(TARGETS), rng.choice(sorted(chaos.SIGNALS)))
        if to_upload:
            job_id = serve.upload(to_upload[0])
            if job_id is None:
                outcome.upload_retries += 1
                time.sleep(0.5)
            else:
                jobs[job_id] = to_upload.pop(0).name
        for job_id in [j for j in jobs if j not in ended]:
            job = serve.job(job_id)
            if job is None:
                break  # the server went: started again above
            if job == {} or job.get("status") in ENDED:
                ended[job_id] = job
                if (job.get("error") or {}).get("code") == RESUBMIT:  # as its message advises
                    to_upload.append(clips_by_name[jobs[job_id]])
                    outcome.resubmitted += 1
        if planned is not None and now >= planned[0]:
            children = serve.children()
            fault = strike(serve, rng, planned, now - started, len(jobs), len(ended))
            if fault is not None:
                if fault.target == "server":  # its job children end with it
                    left = serve.leftovers(children)
                    outcome.strays += [f"after fault {len(outcome.faults) + 1}: {entry}" for entry in left]
                outcome.faults.append(fault)
                print(f"fault {len(outcome.faults)}: {asdict(fault)}", flush=True)
                last_fault = time.perf_counter()
                planned = None
        if not to_upload and len(outcome.faults) >= campaign.faults and len(ended) == len(jobs):
            break
        if len(outcome.faults) >= campaign.faults and time.perf_counter() - last_fault > JOB_S:
            outcome.hangs.append(f"{len(jobs) - len(ended)} job(s) not ended {JOB_S:g} s after the last fault")
            break
        time.sleep(0.2)
    outcome.campaign_s = time.perf_counter() - started
    return jobs


def strike(
    serve: Serve, rng: random.Random, planned: tuple[float, str, str], at_s: float, accepted: int, ended: int
) -> HttpFault | None:
    """The planned fault, if its target is there: a job child is awaited (a job running) for `CHILD_WAIT_S`, then
    the server takes its place; None: not yet."""
    due, target, name = planned
    assert serve.process is not None
    children = serve.children()
    if target == "child" and not children:
        if time.perf_counter() - due < CHILD_WAIT_S:
            return None
        target = "server"
    pid = rng.choice(children) if target == "child" else serve.process.pid
    try:
        os.kill(pid, chaos.SIGNALS[name])
    except ProcessLookupError:
        return None
    if target == "server":
        try:
            serve.process.wait(timeout=60)  # SIGTERM: it stops its children and leaves; started again by the loop
        except subprocess.TimeoutExpired:
            serve.process.kill()
            serve.process.wait()
    return HttpFault(round(at_s, 2), target, name, pid, accepted, ended)


def check(serve: Serve, jobs: dict[str, str], reference: dict[str, str], outcome: HttpOutcome) -> None:
    outcome.accepted = len(jobs)
    for job_id, clip in sorted(jobs.items(), key=lambda item: item[1]):
        job = serve.job(job_id)
        if not job:
            outcome.lost.append(f"{clip}: {job_id} {'unknown to the server' if job == {} else 'no answer'}")
        elif job["status"] == "completed":
            outcome.completed += 1
            if serve.content_sha(job_id) != reference[clip]:
                outcome.different.append(clip)
        elif job["status"] == "failed" and (job.get("error") or {}).get("message"):
            outcome.failed.append(f"{clip}: {job['error']['message']}")
        elif job["status"] == "failed":
            outcome.unreasoned.append(f"{clip}: {job_id}")
        else:
            outcome.lost.append(f"{clip}: {job_id} left {job['status']}")
    completed = {clip for job_id, clip in jobs.items() if (serve.job(job_id) or {}).get("status") == "completed"}
    outcome.unfinished = sorted(set(reference) - completed)
    for record in sorted((serve.store / "jobs").glob("*.json")):
        try:
            json.loads(record.read_text())
        except (OSError, ValueError) as err:
            outcome.torn.append(f"{record.name}: {err}")


def run_campaign(campaign: HttpCampaign) -> HttpOutcome:
    from k6vsr_core.model.tiny_bundle import make_tiny_bundle

    work = campaign.work
    (work / "logs").mkdir(parents=True, exist_ok=True)
    if not (work / "tiny").exists():
        make_tiny_bundle(work / "tiny")
    archive_scale.make_clips(work / "in", campaign.clips)
    clips = sorted((work / "in").glob("*.mp4"))
    env = chaos.environment(work, campaign.fake_ms)
    outcome = HttpOutcome()
    reference = clean_run(campaign, clips, env, outcome)
    serve = Serve(work, work / "store", "chaos", env)
    try:
        serve.start()
        jobs = inject(campaign, clips, serve, outcome, random.Random(campaign.seed))
        if not serve.alive():
            serve.start()
        check(serve, jobs, reference, outcome)
    finally:
        outcome.strays += serve.stop()
        serve.close()
        stop_prefect(work / "store")
    return outcome


def summary(campaign: HttpCampaign, outcome: HttpOutcome) -> dict[str, object]:
    injected = len(outcome.faults)
    return {
        "clips": campaign.clips,
        "faults_injected": injected,
        "faults_survived": injected if outcome.survived else 0,
        "by_target": chaos.by_kind(outcome.faults),
        "server_restarts": outcome.restarts,
        "uploads_sent_again": outcome.upload_retries,
        "jobs_accepted": outcome.accepted,
        "jobs_completed": outcome.completed,
        "jobs_failed_with_a_reason": len(outcome.failed),
        "jobs_failed_without_one": len(outcome.unreasoned),
        "jobs_submitted_again_as_advised": outcome.resubmitted,
        "jobs_lost": len(outcome.lost),
        "clips_without_a_completed_job": len(outcome.unfinished),
        "outputs_identical": f"{outcome.completed - len(outcome.different)}/{outcome.completed}",
        "torn_records": len(outcome.torn),
        "stray_processes": len(outcome.strays),
        "hangs": len(outcome.hangs),
        "clean_s": round(outcome.clean_s, 1),
        "campaign_s": round(outcome.campaign_s, 1),
        "seconds_lost_per_fault": round((outcome.campaign_s - outcome.clean_s) / injected, 1) if injected else None,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clips", type=int, default=8)
    parser.add_argument("--faults", type=int, default=10)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--fake-ms", type=float, default=5.0)
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--json-out", type=Path, default=None)
    args = parser.parse_args(argv)
    work = args.work or Path(f"/tmp/k6vsr-chaos-http-{args.clips}")
    for name in ("store", "clean-store", "logs"):
        shutil.rmtree(work / name, ignore_errors=True)
    campaign = HttpCampaign(work, args.clips, args.faults, args.seed, args.fake_ms)
    outcome = run_campaign(campaign)
    result = summary(campaign, outcome)
    problems = {
        "failed": outcome.failed,
        "unreasoned": outcome.unreasoned,
        "lost": outcome.lost,
        "unfinished": outcome.unfinished,
        "different": outcome.different,
        "torn": outcome.torn,
        "strays": outcome.strays,
        "hangs": outcome.hangs,
    }
    chaos.report("chaos_http.py", argv, result, [asdict(fault) for fault in outcome.faults], problems, args.json_out)
    return 0 if outcome.survived and len(outcome.faults) >= campaign.faults else 1


if __name__ == "__main__":
    raise SystemExit(main())
