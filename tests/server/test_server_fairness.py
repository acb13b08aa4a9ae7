"""Keys (without keys: client addresses) share what they wait for: the workers take jobs in turns across keys, and
the places of the queue and the upload slots are shared, each key's share shrinking as more keys wait.

The rule on its own (`entrypoints.server.fair`), then the runner's admission, then the app in this process without
its job runner (jobs are queued, never run; a test takes them off the queue as a worker does), and last a real
`k6vsr serve` whose worker runs them.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from http_harness import error_of

from entrypoints.server.app import Limits, ServerConfig, create_app, key_owner
from entrypoints.server.fair import OVERFLOW, FairQueue, FairShare, OverShare, PoolFull
from entrypoints.server.job_records import JobStore, KeyQueueFull, QueueFull, UploadsBusy
from entrypoints.server.job_runner import JobRunner
from k6vsr_core.media.sample import make_sample_clip
from service.runs import ModelSpec

KEY_A, KEY_B, KEY_C = "key-a-0123456789abcdef", "key-b-0123456789abcdef", "key-c-0123456789abcdef"


def drain(queue: FairQueue) -> list[str]:
    taken = []
    while (job := queue.get(timeout=0)) is not None:
        taken.append(job)
    return taken


# ---------------------------------------------------------------------------------------- turns across keys


def test_a_key_with_one_job_never_waits_behind_another_keys_backlog() -> None:
    """A A A A then B: B's job starts second, whether A's first had started before B came or not."""
    queue = FairQueue()
    queue.put("a1", "A")
    assert queue.get(timeout=0) == "a1"  # a worker takes it at once
    for job in ("a2", "a3", "a4"):
        queue.put(job, "A")
    queue.put("b1", "B")
    assert drain(queue) == ["b1", "a2", "a3", "a4"]

    queue = FairQueue()
    for job, owner in (("a1", "A"), ("a2", "A"), ("a3", "A"), ("a4", "A"), ("b1", "B")):
        queue.put(job, owner)
    assert drain(queue) == ["a1", "b1", "a2", "a3", "a4"]


def test_keys_with_backlogs_alternate_and_a_key_that_just_ran_goes_last() -> None:
    queue = FairQueue()
    for i in range(3):
        queue.put(f"a{i}", "A")
    for i in range(3):
        queue.put(f"b{i}", "B")
    queue.put("c0", "C")
    assert [queue.get(timeout=0) for _ in range(3)] == ["a0", "b0", "c0"]
    queue.put("c1", "C")  # C ran last: A and B take their turns first
    assert drain(queue) == ["a1", "b1", "c1", "a2", "b2"]


def test_a_cancelled_job_leaves_the_queue_and_takes_no_turn() -> None:
    queue = FairQueue()
    for job, owner in (("a1", "A"), ("b1", "B"), ("a2", "A")):
        queue.put(job, owner)
    assert queue.remove("b1") and not queue.remove("b1") and "b1" not in queue
    assert queue.counts() == {"A": 2} and len(queue) == 2
    assert drain(queue) == ["a1", "a2"]
    assert queue.counts() == {}


def test_a_closed_queue_wakes_every_worker_with_none() -> None:
    queue = FairQueue()
    got: list[str | None] = []
    workers = [threading.Thread(target=lambda: got.append(queue.get())) for _ in range(3)]
    for worker in workers:
        worker.start()
    queue.put("a1", "A")
    queue.close()
    for worker in workers:
        worker.join(timeout=10)
    assert not any(worker.is_alive() for worker in workers)
    assert sorted(got, key=str) in (["a1", None, None], [None, None, None])
    queue.put("a2", "A")
    assert queue.get() is None  # stopping: nothing more starts


def test_forgotten_owners_keep_their_place_in_line() -> None:
    """Past REMEMBERED owners the least recent starters are forgotten: they go first, where they were anyway."""
    queue = FairQueue()
    queue.REMEMBERED = 2
    for owner in ("A", "B", "C"):
        queue.put(owner.lower(), owner)
        assert queue.get(timeout=0) == owner.lower()
    for owner in ("C", "B", "A"):
        queue.put(owner.lower() + "2", owner)
    assert drain(queue) == ["a2", "b2", "c2"]


# ---------------------------------------------------------------------------------------- shares of places


def test_shares_shrink_as_more_keys_wait() -> None:
    share = FairShare(12)
    holdings: dict[str, int] = {}
    assert share.share(holdings, "A") == 12  # alone: the whole queue
    holdings["A"] = 5
    assert share.share(holdings, "A") == 12 and share.share(holdings, "B") == 6
    holdings["B"] = 1
    assert share.share(holdings, "C") == 4
    holdings["C"] = 1
    assert share.share(holdings, "D") == 3 and share.share(holdings, "A") == 4
    many = {f"k{i}": 1 for i in range(40)}
    assert share.share(many, "A") == 1  # never below one place
    assert FairShare(12, cap=2).share({}, "A") == 2
    assert share.share({"A": 5, "B": 0}, "A") == 12  # a key holding nothing is not waiting


def test_a_lone_key_may_fill_the_queue_and_no_more() -> None:
    share = FairShare(4)
    for held in range(4):
        share.check({"A": held}, "A")
    with pytest.raises(PoolFull):
        share.check({"A": 4}, "A")
    with pytest.raises(OverShare) as over:
        FairShare(4, cap=2).check({"A": 2}, "A")
    assert over.value.capped and over.value.share == 2


def test_a_key_over_its_share_is_refused_only_while_another_waits() -> None:
    share = FairShare(4)
    share.check({"A": 3}, "A")  # alone
    with pytest.raises(OverShare) as over:
        share.check({"A": 2, "B": 1}, "A")
    assert (over.value.share, over.value.holders, over.value.capped) == (2, 2, False)
    share.check({"A": 2, "B": 1}, "B")


def test_a_newcomer_gets_its_share_of_a_queue_the_others_fill() -> None:
    """Two keys hold half each: a third is taken up to its share (4 // 3), past the queue's size; a second key
    arriving at a queue a lone key filled gets its half. The others take no more meanwhile."""
    share = FairShare(4)
    share.check({"A": 2, "B": 2}, "C")
    share.check({"A": 2, "B": 2, "C": 0}, "C")
    with pytest.raises(OverShare):
        share.check({"A": 2, "B": 2, "C": 1}, "C")
    for owner in ("A", "B"):
        with pytest.raises(OverShare):
            share.check({"A": 2, "B": 2, "C": 1}, owner)
    share.check({"A": 4}, "B")
    share.check({"A": 4, "B": 1}, "B")
    with pytest.raises(OverShare):
        share.check({"A": 4, "B": 2}, "B")


def test_more_keys_than_places_or_the_overflow_bound_fill_the_queue() -> None:
    share = FairShare(4)
    with pytest.raises(PoolFull):  # every place taken within its holder's share of one
        share.check({"A": 1, "B": 1, "C": 1, "D": 1}, "E")
    big = FairShare(8)
    # Holders past their shares (taken when fewer waited) leave room within; the bound still holds.
    with pytest.raises(PoolFull):
        big.check({"A": 8, "B": 4, "C": 2, "D": 2}, "E")
    assert OVERFLOW * 8 == 8 + 4 + 2 + 2
    big.check({"A": 8, "B": 4, "C": 2, "D": 1}, "E")


# ---------------------------------------------------------------------------------------- the runner's admission


def runner_for(tmp_path: Path, **limits: int) -> JobRunner:
    store = JobStore(tmp_path, input_quota_bytes=1 << 20)
    given = Limits(
        max_upload_bytes=1 << 20,
        max_fields=8,
        max_fields_bytes=8 << 10,
        input_quota_bytes=1 << 20,
        max_output_pixels=2048 * 10**6,
        retention_s=60,
        **limits,
    )
    return JobRunner(store, ModelSpec(model="unused"), 1, given)


def test_admission_shares_the_queue_and_the_upload_slots(tmp_path: Path) -> None:
    """Waiting jobs and requests being read count as places: a lone key fills the queue, a second key still gets
    its half and the first no more; the worker takes them in turns; uploads past --max-uploads-per-key are
    refused naming it."""
    runner = runner_for(tmp_path, max_queued=4, uploads_per_key=2)
    for job_id in ("a1", "a2", "a3", "a4"):
        with runner.admission("key-a"):
            runner.submit(job_id, "key-a")
    with pytest.raises(QueueFull), runner.admission("key-a"):
        pass
    with runner.admission("key-b"):
        runner.submit("b1", "key-b")
    with pytest.raises(KeyQueueFull) as over, runner.admission("key-a"):
        pass
    assert (over.value.limit, over.value.holders, over.value.capped) == (2, 2, False)
    assert "while 2 keys" in over.value.why
    with runner.admission("key-b"):
        runner.submit("b2", "key-b")
    with pytest.raises(KeyQueueFull), runner.admission("key-b"):
        pass
    assert drain(runner.queue) == ["a1", "b1", "a2", "b2", "a3", "a4"]
    with runner.admission("key-b"), runner.admission("key-b"):
        with pytest.raises(UploadsBusy) as busy, runner.admission("key-b"):
            pass
    assert busy.value.capped and "--max-uploads-per-key" in busy.value.why


def test_upload_slots_shrink_as_more_keys_send(tmp_path: Path) -> None:
    runner = runner_for(tmp_path, max_queued=6, uploads_per_key=3)
    with runner.admission("a"), runner.admission("a"), runner.admission("a"):
        with runner.admission("b"), runner.admission("b"):  # share 6 // 2 = 3
            with runner.admission("c"), runner.admission("c"):  # share 6 // 3 = 2
                with pytest.raises(UploadsBusy) as busy, runner.admission("c"):
                    pass
                with pytest.raises(UploadsBusy), runner.admission("a"):  # past its share now that three send
                    pass
    assert (busy.value.limit, busy.value.holders, busy.value.capped) == (2, 3, False)
    assert "while 3 keys or client addresses send" in busy.value.why


def test_max_queued_per_key_caps_a_key_whatever_its_share(tmp_path: Path) -> None:
    from entrypoints.cli import build_parser
    from entrypoints.server.app import config_from

    runner = runner_for(tmp_path, max_queued=8, queued_per_key=3)
    for job_id in ("a1", "a2", "a3"):
        runner.submit(job_id, "key-a")
    with pytest.raises(KeyQueueFull) as over, runner.admission("key-a"):
        pass
    assert over.value.capped and "--max-queued-per-key" in over.value.why
    parse = build_parser().parse_args
    assert config_from(parse(["serve"]), tmp_path, "m").limits.queued_per_key is None
    assert config_from(parse(["serve", "--max-queued-per-key", "2"]), tmp_path, "m").limits.queued_per_key == 2


# ---------------------------------------------------------------------------------------- through the app


@pytest.fixture
def app_and_clip(tmp_path: Path, tiny_bundle_path: Path):
    limits = Limits(
        max_upload_bytes=1 << 20,
        max_fields=8,
        max_fields_bytes=8 << 10,
        max_queued=4,
        input_quota_bytes=8 << 20,
        max_output_pixels=2048 * 10**6,
        retention_s=3600.0,
    )
    config = ServerConfig(store_root=tmp_path / "store", limits=limits, api_keys=(KEY_A, KEY_B, KEY_C))
    app = create_app(config, ModelSpec(model=str(tiny_bundle_path), device="cpu"))
    clip = make_sample_clip(tmp_path / "clip.mp4", width=64, height=64, num_frames=1, audio=False)
    return TestClient(app), app.state.videos.runner, clip


def post(client: TestClient, clip: Path, key: str, seed: int):
    files = {"video_reference": ("x.mp4", clip.read_bytes(), "video/mp4")}
    headers = {"Authorization": f"Bearer {key}"}
    return client.post("/v1/videos", files=files, data={"seed": str(seed)}, headers=headers)


def test_jobs_of_two_keys_run_in_turns(app_and_clip) -> None:
    """Key A submits four jobs, its first taken by the worker at once, then key B one: B's job starts second."""
    client, runner, clip = app_and_clip
    a = [post(client, clip, KEY_A, seed=0).json()["id"]]
    assert runner.queue.get(timeout=0) == a[0]
    a += [post(client, clip, KEY_A, seed=seed).json()["id"] for seed in (1, 2, 3)]
    b = post(client, clip, KEY_B, seed=4).json()["id"]
    assert runner.queue.counts() == {key_owner(KEY_A): 3, key_owner(KEY_B): 1}
    assert drain(runner.queue) == [b, *a[1:]]


def test_a_third_key_gets_its_share_of_a_queue_two_keys_fill(app_and_clip) -> None:
    client, runner, clip = app_and_clip
    for seed, key in enumerate((KEY_A, KEY_A, KEY_B, KEY_B)):
        assert post(client, clip, key, seed).status_code == 200
    refused = error_of(post(client, clip, KEY_A, seed=10), 429)
    assert refused["code"] == "key_queue_full" and "while 2 keys" in refused["message"], refused
    assert post(client, clip, KEY_C, seed=11).status_code == 200  # its share: 4 // 3
    refused = error_of(post(client, clip, KEY_C, seed=12), 429)
    assert refused["code"] == "key_queue_full" and "while 3 keys" in refused["message"], refused
    assert len(runner.queue) == 5


def test_a_lone_key_uses_the_whole_queue(app_and_clip) -> None:
    client, runner, clip = app_and_clip
    for seed in range(4):
        assert post(client, clip, KEY_A, seed).status_code == 200
    assert error_of(post(client, clip, KEY_A, seed=4), 429)["code"] == "queue_full"
    assert post(client, clip, KEY_B, seed=5).status_code == 200  # a second key still gets its half
    assert error_of(post(client, clip, KEY_A, seed=6), 429)["code"] == "key_queue_full"


def test_a_cancelled_job_gives_back_its_place_and_its_turn(app_and_clip) -> None:
    client, runner, clip = app_and_clip
    ids = [post(client, clip, KEY_A, seed).json()["id"] for seed in range(4)]
    cancelled = client.delete(f"/v1/videos/{ids[1]}", headers={"Authorization": f"Bearer {KEY_A}"})
    assert cancelled.json()["status"] == "cancelled"
    again = post(client, clip, KEY_A, seed=9)
    assert again.status_code == 200, again.text
    assert drain(runner.queue) == [ids[0], *ids[2:], again.json()["id"]]


# ---------------------------------------------------------------------------------------- a real server


def test_a_served_key_with_one_job_runs_second(tmp_path: Path, tiny_bundle_path: Path, prefect_server: str) -> None:
    """`k6vsr serve` with one worker: key A queues four jobs, key B one; the worker starts B's second (the order
    the server's log records the starts in)."""
    import re

    from http_harness import Server

    allowed = tmp_path / "allowed"
    allowed.mkdir()
    clip = make_sample_clip(allowed / "clip.mp4", width=64, height=64, num_frames=1, audio=False)
    args = ["--allow-path", str(allowed), "--api-key", KEY_A, "--api-key", KEY_B]
    server = Server(tmp_path, tmp_path / "store", tiny_bundle_path, "fair", args, KEY_A).start()
    try:
        a = []
        for seed in range(4):
            response = server.post_json(video_path=str(clip), sr_resolution_scale=2, seed=seed)
            assert response.status_code == 200, response.text
            a.append(response.json()["id"])
        with server.as_key(KEY_B) as b_client:
            response = b_client.post("/v1/videos", json={"video_path": str(clip), "sr_resolution_scale": 2, "seed": 9})
            assert response.status_code == 200, response.text
            b = response.json()["id"]
            for job_id in a:
                assert server.wait(job_id)["status"] == "completed", server.log()
            assert b_client.get(f"/v1/videos/{b}").json()["status"] == "completed"
        started = re.findall(r"job (video_[\w-]+) started on worker 0", server.log_path.read_text())
        assert started == [a[0], b, *a[1:]], server.log()
    finally:
        server.stop()
