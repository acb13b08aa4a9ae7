"""The fleet bench's pieces (bench/fleet_sim.py): hosts as network and mount namespaces that see only their own
folders and reach each other over the bridge, a cut link, and a teardown that leaves nothing, also when the run
inside fails; the counts it reads from the workers' logs; and the whole fleet (Prefect on PostgreSQL, moto, Dask)
running a short archive across its hosts, once plainly and once with a worker host killed whole, to the one-host
run's bytes. The bench's own size (20 clips, every fault) takes 13-30 minutes on two cores: bench/RESULTS.md."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from bench import fleet_sim

SERVE = [sys.executable, "-m", "http.server", "--bind", "0.0.0.0", "5000"]


def _ns_processes(ns: str) -> bool:
    return subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.strip() != ""


def test_hosts_see_only_their_own_folders_reach_each_other_and_leave_nothing(tmp_path: Path) -> None:
    assert os.geteuid() == 0, "the fleet's namespaces need root"
    with pytest.raises(RuntimeError, match="inside the fleet"), fleet_sim.fleet(tmp_path / "work") as hosts:
        (hosts.hosts["w1"].home / "mine.txt").write_text("w1's")
        seen = hosts.run(
            "w1",
            ["sh", "-c", 'echo private > /tmp/w1.txt; ls "$HOME"; ls /tmp; ls "$0" 2>&1 || true', str(tmp_path)],
            hosts.env("w1"),
            timeout=30,
        )
        assert "mine.txt" in seen and "w1.txt" in seen and "No such file or directory" in seen  # the machine's /tmp
        assert (hosts.hosts["w1"].tmp / "w1.txt").read_text() == "private\n"
        other = hosts.run("w2", ["sh", "-c", 'ls -A "$HOME" /tmp'], hosts.env("w2"), timeout=30)
        assert "mine.txt" not in other and "w1.txt" not in other

        server = hosts.start("store", "http", SERVE, hosts.env("store"))
        hosts.reachable("w1", "store", 5000, 60)
        hosts.link("w1", up=False)
        with pytest.raises(RuntimeError, match="did not answer w1"):
            hosts.reachable("w1", "store", 5000, 3)
        hosts.link("w1", up=True)
        hosts.reachable("w1", "store", 5000, 60)
        hosts.kill_host("store")
        assert server.wait(timeout=30) == -signal.SIGKILL
        hosts.start("store", "http", SERVE, hosts.env("store"))
        namespaces = [host.ns for host in hosts.hosts.values()]
        raise RuntimeError("inside the fleet")  # the teardown runs all the same
    assert hosts.left == [] and fleet_sim.leftovers(hosts.tag) == []  # type: ignore[attr-defined]
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(ns in listed for ns in namespaces)
    assert not any(_ns_processes(ns) for ns in namespaces)


def test_what_a_killed_run_left_is_removed_by_clean_and_a_live_run_is_not(tmp_path: Path) -> None:
    """A run killed outright (no teardown) leaves its namespaces, links and processes: `--clean` removes them, and
    leaves those of a run whose process still runs."""
    gone = subprocess.Popen(["true"])
    gone.wait()
    left = fleet_sim.Fleet(tmp_path / "left", tag=str(gone.pid))  # named as the run of a process now gone
    (tmp_path / "left" / "logs").mkdir(parents=True)
    with fleet_sim.fleet(tmp_path / "live") as live:
        try:
            left.up()
            server = left.start("store", "http", SERVE, left.env("store"))
            removed = fleet_sim.clean_stale()
        finally:
            left.down()
        made = {host.ns for host in left.hosts.values()} | {host.veth for host in left.hosts.values()}
        assert made | {left.bridge} <= set(removed)  # and any other stale run's, were there one on the machine
        assert not [name for name in removed if f"-{live.tag}-" in name]
        assert fleet_sim.leftovers(left.tag) == [] and server.wait(timeout=30) == -signal.SIGKILL
        assert len(fleet_sim.leftovers(live.tag)) == 2 * len(fleet_sim.HOSTS) + 1  # the live run's are all there
    assert live.left == []  # type: ignore[attr-defined]


def _task(host: str, key: str, start: str, finish: str, t: float) -> dict:
    return {"t": t, "host": host, "event": "task", "key": key, "start": start, "finish": finish}


def _record(host: str, run: str, stage: str, item: str, t: float) -> dict:
    return {"t": t, "host": host, "event": "record", "run": f"{run}/done", "stage": stage, "item": item}


def test_lost_tasks_and_items_computed_twice_are_counted_from_the_workers_logs() -> None:
    store = "s3://media/store-kill"
    run = f"{store}/runs/0123456789abcdef"
    lines = [
        _task("w1", "old", "ready", "executing", 1.0),  # before the archive: not counted
        _task("w2", "decode-a", "ready", "executing", 11.0),
        _record("w2", run, "decode", "0-0", 12.0),
        _task("w2", "decode-a", "executing", "memory", 12.5),
        _task("w2", "decode-b", "ready", "executing", 13.0),  # the host dies here
        _task("w1", "decode-b", "ready", "executing", 20.0),
        _record("w1", run, "decode", "0-1", 21.0),
        _task("w1", "decode-b", "executing", "memory", 21.5),
        _task("w1", "blend-c", "ready", "executing", 22.0),  # still running on a host that is cut off
        _record("w1", run, "blend", "0", 23.0),
        _record("w2", run, "blend", "0", 24.0),  # written again by another host
        _record("w1", "s3://media/store/runs/other/done", "blend", "0", 25.0),  # another archive's store
    ]
    counted = fleet_sim.recomputed(lines, since=10.0, store=store)
    assert counted["lost_tasks"] == ["w1: blend-c", "w2: decode-b"]
    assert counted["lost_tasks_rerun_elsewhere"] == 1  # decode-b finished on w1; blend-c finished nowhere
    assert counted["records_written_twice"] == {"0123456789ab blend 0": ["w1", "w2"]}
    assert counted["records_written_by_host"] == {"w1": 2, "w2": 2} and counted["items"] == 3


def test_a_short_archive_across_the_fleet_gives_the_one_host_bytes_through_a_killed_host(tmp_path: Path) -> None:
    """Two clips across the hosts (the bench-only network stand-in), then again while a worker host is killed
    whole: every output the one-host run's bytes, every clip's flow run completed, no file of a run outside the
    store, no record written twice, nothing left behind (the bench's own checks, `failures`)."""
    assert os.geteuid() == 0, "the fleet's namespaces need root"
    out = tmp_path / "fleet.json"
    assert (
        fleet_sim.main(["--clips", "2", "--faults", "kill", "--work", str(tmp_path / "work"), "--json-out", str(out)])
        == 0
    )
    result = json.loads(out.read_text())
    assert fleet_sim.failures(result) == []
    assert result["outputs"] == 2 and result["fleet_differs"] == [] and result["fault_kill"]["differs"] == []
