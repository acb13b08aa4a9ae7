"""The HTTP job API (`k6vsr serve`), driven over real HTTP on loopback with the tiny random bundle.

One server runs for the module (a real `python -m entrypoints.cli serve` process with an API key, one allowed folder, a
1 MB upload cap and the default limits otherwise) on one store; the restart test kills a first server mid-job and that
module server resumes the job. Clips are 1-frame and 64 px, so every job has 1 tile (x2, x2.25) or 9 (x4). The
limits that need small values, keys and the fuzz test are in `test_server_limits.py`.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from fractions import Fraction
from pathlib import Path

import av
import httpx
import numpy as np
import pytest
from http_harness import Server, completed, error_of, frames_of, has_audio_stream, modes_under
from media_kit import hdr_source

from k6vsr_core import media
from k6vsr_core.contract.params import parse_params
from k6vsr_core.media.sample import make_sample_clip
from service.runs import ModelSpec, prepare_run

KEY = "test-key-0123456789"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, tiny_bundle_path: Path, prefect_server: str) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("serve")
    allowed, outside = root / "allowed", root / "outside"
    allowed.mkdir()
    outside.mkdir()
    make_sample_clip(allowed / "square.mp4", width=64, height=64, num_frames=1)
    make_sample_clip(allowed / "wide.mp4", width=96, height=64, num_frames=1)
    make_sample_clip(allowed / "silent.mp4", width=64, height=64, num_frames=1, audio=False)
    make_sample_clip(outside / "secret.mp4", width=112, height=64, num_frames=1)  # like no clip inside
    (outside / "notes.txt").write_text("not a video")
    (allowed / "escape.mp4").symlink_to(outside / "secret.mp4")
    (allowed / "broken.mp4").write_bytes(b"this is not a video" * 100)
    _pal_tape(allowed / "tape.mp4")
    hdr_source(allowed / "hdr10.mp4", "smpte2084", frames=3)
    return {"root": root, "allowed": allowed, "outside": outside, "store": root / "store", "bundle": tiny_bundle_path}


def _pal_tape(path: Path) -> None:
    """A PAL 4:3 frame at an eighth of its size (90x72), its pixels 16:15 as a tape transfer's."""
    with av.open(str(path), "w") as container:
        video = container.add_stream("libx264", rate=25)
        video.width, video.height, video.pix_fmt = 90, 72, "yuv420p"
        video.codec_context.sample_aspect_ratio = Fraction(16, 15)
        container.mux(video.encode(av.VideoFrame.from_ndarray(np.zeros((72, 90, 3), np.uint8), format="rgb24")))
        container.mux(video.encode(None))


def start_server(stack: dict[str, Path], name: str) -> Server:
    # One client key here: these tests exercise the queue's own bound, so the key may hold all of it (the per-key
    # share is tested in test_server_bounds).
    args = [
        "--allow-path",
        str(stack["allowed"]),
        "--api-key",
        KEY,
        "--max-upload-mb",
        "1",
        "--max-queued-per-key",
        "16",
    ]
    return Server(stack["root"], stack["store"], stack["bundle"], name, args, KEY).start()


@pytest.fixture(scope="module")
def server(stack: dict[str, Path]):
    running = start_server(stack, "server")
    yield running
    running.stop()


def server_paths(stack: dict[str, Path]) -> list[str]:
    """What no response may contain: where the server keeps its files and the folders it reads."""
    return [str(stack["root"]), str(stack["root"].resolve()), "/proc/", os.path.expanduser("~")]


def _worker_children_of(pid: int) -> list[int]:
    """Job worker processes started by server `pid` that are still alive (Linux /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"entrypoints.server.child" in argv and str(pid).encode() in argv:
                found.append(int(entry.name))
    return found


# Runs first: a server killed with a job in progress, then the module server on the same store, which resumes it.
def test_server_restart_mid_job_resumes_it(stack: dict[str, Path], request: pytest.FixtureRequest) -> None:
    first = start_server(stack, "first")
    try:
        posted = first.post_json(video_path=str(stack["allowed"] / "square.mp4"), sr_resolution_scale=2)
        assert posted.status_code == 200, posted.text
        job_id = posted.json()["id"]
        assert first.wait(job_id, until=("in_progress", "completed"))["status"] == "in_progress"
        first.kill()
    finally:
        first.stop()
    record = (stack["store"] / "jobs" / f"{job_id}.json").read_text()
    assert '"status": "in_progress"' in record
    if sys.platform.startswith("linux"):
        deadline = time.monotonic() + 30  # the worker dies with its server (once started: slow on a busy machine)
        while _worker_children_of(first.process.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _worker_children_of(first.process.pid)

    server: Server = request.getfixturevalue("server")  # a new server on the same store
    done = server.wait(job_id)
    assert done["status"] == "completed", done
    assert done["output"]["width"] == 128 and done["output"]["frames"] == 1


@pytest.mark.parametrize(
    ("scale", "clip", "size"),
    [("2", "square.mp4", (128, 128)), ("4", "square.mp4", (256, 256)), ("2.25", "wide.mp4", (224, 128))],
)
def test_json_and_upload_give_the_same_frames(
    server: Server, stack: dict[str, Path], tmp_path: Path, scale: str, clip: str, size: tuple[int, int]
) -> None:
    source = stack["allowed"] / clip
    by_path = completed(server, server.post_json(video_path=str(source), sr_resolution_scale=float(scale)))
    by_upload = completed(server, server.post_upload(source, sr_resolution_scale=scale))
    assert by_upload["run_key"] == by_path["run_key"]
    # The owner sees its path relative to the allowed folder, never where the server keeps anything.
    assert by_upload["source"] == {"type": "upload"} and by_path["source"] == {"type": "path", "video_path": clip}
    assert by_path["params"]["sr_resolution_scale"] == float(scale)
    assert by_path["size"] == f"{size[0]}x{size[1]}"
    assert by_path["quality"]["frames"] == by_path["output"]["frames"] and "findings" in by_path["quality"]

    a = server.content(by_path["id"], tmp_path / "path.mp4")
    b = server.content(by_upload["id"], tmp_path / "upload.mp4")
    frames_a, frames_b = frames_of(a), frames_of(b)
    assert frames_a.shape == (1, size[1], size[0], 3)
    assert np.array_equal(frames_a, frames_b)
    probe = media.probe(a)
    assert (probe.width, probe.height, probe.num_frames, round(probe.fps)) == (*size, 1, 24)
    assert has_audio_stream(a) and has_audio_stream(b)
    assert by_path["output"]["has_audio"] is True and by_path["output"]["bytes"] == a.stat().st_size


def test_repeated_request_reuses_the_run_and_delete_removes_the_job(
    server: Server, stack: dict[str, Path], tmp_path: Path
) -> None:
    body = {"video_path": str(stack["allowed"] / "square.mp4"), "sr_resolution_scale": 2, "seed": 5}
    first = completed(server, server.post_json(**body))
    again = completed(server, server.post_json(**body))
    assert again["run_key"] == first["run_key"] and again["id"] != first["id"]
    assert again["tiles"]["reused"] == again["tiles"]["total"] and again["tiles"]["computed"] == 0
    assert np.array_equal(
        frames_of(server.content(first["id"], tmp_path / "1.mp4")),
        frames_of(server.content(again["id"], tmp_path / "2.mp4")),
    )

    jobs = stack["store"] / "jobs"
    assert (jobs / again["id"] / "output.mp4").is_file()
    deleted = server.client.delete(f"/v1/videos/{again['id']}")
    assert deleted.status_code == 200 and deleted.json() == {
        "id": again["id"],
        "object": "video.deleted",
        "deleted": True,
    }
    assert not (jobs / again["id"]).exists() and not (jobs / f"{again['id']}.json").exists()
    error_of(server.client.get(f"/v1/videos/{again['id']}"), 404)
    assert (stack["store"] / "runs" / first["run_key"] / "output.mp4").is_file()  # the shared run is kept
    assert server.client.get(f"/v1/videos/{first['id']}/content").status_code == 200


def test_silent_source_gives_a_video_only_mp4(server: Server, stack: dict[str, Path], tmp_path: Path) -> None:
    done = completed(server, server.post_json(video_path=str(stack["allowed"] / "silent.mp4"), sr_resolution_scale=2))
    assert done["output"]["has_audio"] is False
    out = server.content(done["id"], tmp_path / "silent.mp4")
    assert not has_audio_stream(out)
    assert frames_of(out).shape == (1, 128, 128, 3)


def test_tile_batch_2_is_its_own_run(server: Server, stack: dict[str, Path], tmp_path: Path) -> None:
    source = stack["allowed"] / "wide.mp4"  # 2 tiles at x2: one chunk of 2 with batch 2
    done = completed(server, server.post_upload(source, sr_resolution_scale=2, sr_tiles_batch_size=2))
    assert done["params"]["sr_tiles_batch_size"] == 2 and done["tiles"]["total"] == 2
    spec = ModelSpec(model=str(stack["bundle"]), device="cpu")
    keys = {
        batch: prepare_run(source, parse_params(scale=2, tiles_batch_size=batch), spec, stack["store"]).run.run_key
        for batch in (1, 2)
    }
    assert done["run_key"] == keys[2] != keys[1]
    assert frames_of(server.content(done["id"], tmp_path / "b2.mp4")).shape == (1, 128, 192, 3)


def test_refusals(server: Server, stack: dict[str, Path]) -> None:
    allowed, outside = stack["allowed"], stack["outside"]
    secrets = server_paths(stack)
    jobs = stack["store"] / "jobs"
    before = sorted(p.name for p in jobs.iterdir())
    url = "/v1/videos"

    # Missing or wrong key, on every route.
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        anonymous = httpx.Client(base_url=server.client.base_url, headers=headers)
        error_of(anonymous.get(url), 401)
        error_of(anonymous.get(f"{url}/video_abcdefghijklmnopqrstuvwx"), 401)
        error_of(anonymous.post(url, json={"video_path": str(allowed / "square.mp4")}), 401)
        error_of(anonymous.get("/health"), 401)
        anonymous.close()

    # Paths outside the allowed folder, through `..`, or through a symbolic link.
    for path in (
        outside / "secret.mp4",
        allowed / ".." / "outside" / "secret.mp4",
        allowed / "escape.mp4",
        Path("/etc/passwd"),
    ):
        error = error_of(server.post_json(video_path=str(path)), 403, secrets)
        assert error["param"] == "video_path" and error["type"] == "permission_error"
        assert error["code"] == "path_not_allowed"

    # Uploads beyond the 1 MB cap, with a Content-Length and streamed without one.
    big = os.urandom(3 << 19)
    error_of(server.client.post(url, files={"video_reference": ("a.mp4", big)}), 413)
    boundary = "k6vsr-test-boundary"
    body = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="video_reference"; filename="a.mp4"\r\n\r\n'.encode()
        + big
        + f"\r\n--{boundary}--\r\n".encode()
    )
    chunks = (body[i : i + 65536] for i in range(0, len(body), 65536))
    form_type = {"Content-Type": f"multipart/form-data; boundary={boundary}"}
    streamed = server.client.post(url, content=chunks, headers=form_type)  # chunked: no Content-Length
    assert error_of(streamed, 413)["param"] == "video_reference"

    # Bad parameters name their field.
    square = str(allowed / "square.mp4")
    for field, value in [
        ("sr_resolution_scale", 3),
        ("sr_resolution_scale", "x2"),
        ("sr_tiles_batch_size", 0),
        ("sr_tile_min_overlap", 1.5),
        ("sr_target_resolution", "8k"),
        ("sr_target_resize_mode", "zoom"),
        ("seed", -1),
        ("seed", "abc"),
        ("num_inference_steps", 0),
        ("sr_unknown", 1),
    ]:
        error = error_of(server.post_json(video_path=square, **{field: value}), 400, secrets)
        assert error["param"] == field and field in error["message"], error
    error = error_of(server.post_upload(allowed / "square.mp4", sr_resolution_scale="3"), 400)
    assert error["param"] == "sr_resolution_scale"

    # Broken clips, missing fields, wrong bodies: the decoder's reason, with no path of the server.
    broken = error_of(server.post_json(video_path=str(allowed / "broken.mp4")), 400, secrets)
    assert broken["code"] == "invalid_video" and "'broken.mp4'" in broken["message"]
    broken = error_of(server.post_upload(allowed / "broken.mp4"), 400, secrets)
    assert broken["param"] == "video_reference" and broken["code"] == "invalid_video"
    assert error_of(server.post_json(video_path=str(allowed / "missing.mp4")), 400, secrets)["code"] == "path_not_found"
    error_of(server.post_json(sr_resolution_scale=2), 400)
    error_of(server.client.post(url, content=b"{not json", headers={"Content-Type": "application/json"}), 400)
    error_of(server.client.post(url, files={"other": ("a.mp4", b"x")}), 400)
    error_of(server.client.post(url, content=b"x", headers={"Content-Type": "text/plain"}), 415)
    error_of(server.client.get(f"{url}/video_doesnotexist_0123456789"), 404)
    error_of(server.client.get(f"{url}/..%2F..%2Fetc%2Fpasswd"), 404)
    error_of(server.client.get("/nowhere"), 404)
    error_of(server.client.put(url), 405)

    assert sorted(p.name for p in jobs.iterdir()) == before  # refused requests leave nothing in the store


def test_paths_outside_get_one_answer_whatever_they_name(server: Server, stack: dict[str, Path]) -> None:
    """Whether a path outside exists, is a video or is a folder changes nothing in the answer: nothing outside is
    looked at."""
    allowed, outside = stack["allowed"], stack["outside"]
    targets = [
        outside / "secret.mp4",
        outside / "notes.txt",
        outside / "missing.mp4",
        outside,
        Path("/proc/self/environ"),
    ]
    answers = set()
    for index, target in enumerate(targets):
        link = allowed / f"to-outside-{index}.mp4"
        link.symlink_to(target)
        try:
            for path in (link, target, allowed / ".." / "outside" / target.name):
                error = error_of(server.post_json(video_path=str(path)), 403, server_paths(stack))
                answers.add(json.dumps(error, sort_keys=True))
        finally:
            link.unlink()
    assert len(answers) == 1, answers


def test_the_file_checked_is_the_file_that_runs(server: Server, stack: dict[str, Path], tmp_path: Path) -> None:
    """A path job runs the file as it was when submitted: swapping it for a link to a file outside while the job
    waits behind another changes nothing, and nothing is ever made from the file outside."""
    from storage import source_info

    allowed, outside = stack["allowed"], stack["outside"]
    swapped = allowed / "swapped.mp4"
    shutil.copyfile(allowed / "square.mp4", swapped)
    ahead = server.post_json(video_path=str(allowed / "square.mp4"), sr_resolution_scale=4, seed=31)
    posted = server.post_json(video_path=str(swapped), sr_resolution_scale=2, seed=32)
    assert posted.status_code == 200 and posted.json()["status"] == "queued", posted.text
    swapped.unlink()
    swapped.symlink_to(outside / "secret.mp4")  # a 112x64 clip, where the one submitted was 64x64
    try:
        completed(server, ahead)
        done = completed(server, posted)
    finally:
        swapped.unlink()
    assert done["size"] == "128x128" and done["source"] == {"type": "path", "video_path": "swapped.mp4"}
    spec = ModelSpec(model=str(stack["bundle"]), device="cpu")
    expected = prepare_run(allowed / "square.mp4", parse_params(scale=2, seed=32), spec, stack["store"])
    assert done["run_key"] == expected.run.run_key
    assert frames_of(server.content(done["id"], tmp_path / "out.mp4")).shape == (1, 128, 128, 3)
    secret = source_info(outside / "secret.mp4").sha256
    for manifest in (stack["store"] / "runs").glob("*/manifest.json"):
        assert json.loads(manifest.read_text())["source"]["sha256"] != secret
    # The Prefect API, which the server does not guard, names only the job's own copy, never the client's path.
    api = os.environ["PREFECT_API_URL"]
    runs = httpx.post(f"{api}/flow_runs/filter", json={"flow_runs": {"name": {"any_": [done["id"]]}}}).json()
    assert runs and all(str(allowed) not in json.dumps(run["parameters"]) for run in runs)


def test_form_totals_are_bounded(server: Server, stack: dict[str, Path]) -> None:
    """3000 fields of 60 KiB in one chunked request: refused after the first 64 KiB of fields, with a short answer,
    without the server reading the rest or holding it."""
    import psutil

    boundary = "k6vsr-fields"
    value = b"x" * (60 << 10)

    def parts():
        for index in range(3000):
            yield f'--{boundary}\r\nContent-Disposition: form-data; name="f{index}"\r\n\r\n'.encode() + value + b"\r\n"
        yield f"--{boundary}--\r\n".encode()

    process = psutil.Process(server.process.pid)
    rss_before = process.memory_info().rss
    status, body, sent = server.post_chunked({"Content-Type": f"multipart/form-data; boundary={boundary}"}, parts())
    assert status == 413 and json.loads(body)["error"]["code"] == "fields_too_large", body
    assert len(body) < 1000
    assert sent < 32 << 20, sent  # what the socket buffers took, not the 184 MB
    assert process.memory_info().rss - rss_before < 32 << 20

    many = {f"f{index}": "1" for index in range(40)}
    files = {"video_reference": ("a.mp4", (stack["allowed"] / "square.mp4").read_bytes())}
    assert error_of(server.client.post("/v1/videos", files=files, data=many), 413)["code"] == "too_many_fields"
    many_json = {"video_path": str(stack["allowed"] / "square.mp4"), **many}
    assert error_of(server.client.post("/v1/videos", json=many_json), 413)["code"] == "too_many_fields"


def test_malformed_input_gets_a_400_not_a_500(server: Server, stack: dict[str, Path]) -> None:
    allowed = stack["allowed"]
    secrets = server_paths(stack)
    too_long = error_of(server.post_json(video_path=str(allowed / ("a" * 5000))), 400, secrets)
    assert too_long["code"] == "invalid_path"
    deep = str(allowed) + "/b" * 3000 + "/c.mp4"
    assert error_of(server.post_json(video_path=deep), 400, secrets)["code"] == "path_not_found"
    for depth, status in ((30_000, 400), (100_000, 413)):
        nested = b'{"video_path": ' + b"[" * depth + b"]" * depth + b"}"
        response = server.client.post("/v1/videos", content=nested, headers={"Content-Type": "application/json"})
        error_of(response, status)
    assert "Traceback" not in server.log_path.read_text(errors="replace")


def test_output_pixels_are_bounded_at_submit(server: Server, stack: dict[str, Path], tmp_path: Path) -> None:
    """121 black frames of 1280x864 (a few KB) at x4 would be 121 frames of 5120x3456: over the default 2048 MP."""
    clip = tmp_path / "long.mp4"
    with av.open(str(clip), "w") as container:
        stream = container.add_stream("libx264", rate=24)
        stream.width, stream.height, stream.pix_fmt = 1280, 864, "yuv420p"
        stream.options = {"preset": "ultrafast", "crf": "51"}
        black = av.VideoFrame.from_ndarray(np.zeros((864, 1280, 3), np.uint8), format="rgb24")
        for index in range(121):
            black.pts = index
            for packet in stream.encode(black):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    jobs = stack["store"] / "jobs"
    before = sorted(p.name for p in jobs.iterdir())
    error = error_of(server.post_upload(clip, sr_resolution_scale=4), 400, server_paths(stack))
    assert error["code"] == "output_too_large" and "121 frame(s) of 5120x3456" in error["message"], error
    assert sorted(p.name for p in jobs.iterdir()) == before


def test_files_are_owner_only(server: Server, stack: dict[str, Path]) -> None:
    """Uploads, outputs, records and runs are created 0600 (folders 0700) under the default --umask 077."""
    completed(server, server.post_upload(stack["allowed"] / "wide.mp4", sr_resolution_scale=2, seed=51))
    loose = {path: oct(mode) for path, mode in modes_under(stack["store"]).items() if mode & 0o077}
    assert not loose


def test_queue_is_bounded(server: Server, stack: dict[str, Path]) -> None:
    """At most 16 jobs wait (the default); the next one gets 429 with Retry-After. Cancelling a queued job frees its
    input at once."""
    square = str(stack["allowed"] / "square.mp4")
    jobs = stack["store"] / "jobs"
    ahead = server.post_json(video_path=square, sr_resolution_scale=4, seed=41).json()
    posted, refused = [], None
    for seed in range(100, 140):
        response = server.post_json(video_path=square, sr_resolution_scale=2, seed=seed)
        if response.status_code == 429:
            refused = response
            break
        assert response.status_code == 200, response.text
        posted.append(response.json()["id"])
    assert refused is not None, "the queue took 40 jobs"
    waiting = [job for job in server.client.get("/v1/videos").json()["data"] if job["status"] == "queued"]
    assert len(waiting) <= 16 <= len(posted)
    assert error_of(refused, 429)["code"] == "queue_full" and refused.headers["Retry-After"].isdigit()

    for job_id in posted:
        response = server.client.delete(f"/v1/videos/{job_id}")
        assert response.status_code == 200, response.text
        if response.json().get("started_at") is None:  # cancelled while queued
            assert not (jobs / job_id / "input").exists()  # freed at once, not at the second DELETE
    for job_id in [ahead["id"], *posted]:
        server.delete_until_gone(job_id)
    again = server.post_json(video_path=square, sr_resolution_scale=2, seed=100)
    assert again.status_code == 200, again.text
    server.delete_until_gone(again.json()["id"])


# Runs last: cancelling a running job restarts its worker process, which the tests after it would wait for.
def test_cancel_and_delete(server: Server, stack: dict[str, Path]) -> None:
    square = str(stack["allowed"] / "square.mp4")
    store = stack["store"]
    running = server.post_json(video_path=square, sr_resolution_scale=4, seed=7).json()
    waiting = server.post_json(video_path=square, sr_resolution_scale=4, seed=8).json()
    assert server.wait(running["id"], until=("in_progress", "completed"))["status"] == "in_progress"
    assert server.job(waiting["id"])["status"] == "queued"
    assert error_of(server.client.get(f"/v1/videos/{waiting['id']}/content"), 409)["code"] == "job_queued"

    cancelled = server.client.delete(f"/v1/videos/{waiting['id']}")
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
    assert not (store / "jobs" / waiting["id"]).exists()  # its input is freed at once
    cancelled = server.client.delete(f"/v1/videos/{running['id']}")
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
    time.sleep(0.5)
    for job_id in (running["id"], waiting["id"]):
        assert server.job(job_id)["status"] == "cancelled"
        assert error_of(server.client.get(f"/v1/videos/{job_id}/content"), 409)["code"] == "job_cancelled"

    # The cancelled run is reclaimed from the run store once its worker has stopped.
    deadline = time.monotonic() + 30
    while (store / "runs" / running["run_key"]).exists():
        assert time.monotonic() < deadline, "the cancelled job's run is still in the store"
        time.sleep(0.2)
    assert not (store / "jobs" / running["id"]).exists()

    # A second DELETE removes the cancelled job (once its worker has stopped).
    deadline = time.monotonic() + 30
    while (response := server.client.delete(f"/v1/videos/{running['id']}")).status_code == 409:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert response.status_code == 200 and response.json()["deleted"] is True
    assert server.client.delete(f"/v1/videos/{waiting['id']}").json()["deleted"] is True
    for job_id in (running["id"], waiting["id"]):
        error_of(server.client.get(f"/v1/videos/{job_id}"), 404)
        assert not (store / "jobs" / f"{job_id}.json").exists()


@pytest.mark.parametrize("chunk", [1, 7, 70, 65536])
def test_form_parser_handles_any_chunking(tmp_path: Path, chunk: int) -> None:
    """Boundaries split across reads, CRLF and dashes inside the data: the parser still cuts at the boundary."""
    import asyncio

    from starlette.requests import Request

    from entrypoints.server.app import Limits, read_form
    from entrypoints.server.job_records import JobStore

    boundary = "b0undary"
    payload = b"x--b0undary\r\n--b0undar\r\n-b0undary\r\n\r\n" * 40 + bytes(range(256))  # near misses only
    body = (
        f"--{boundary}\r\n".encode()
        + b'Content-Disposition: form-data; name="seed"\r\n\r\n7\r\n'
        + f"--{boundary}\r\n".encode()
        + b'Content-Disposition: form-data; name="video_reference"; filename="../../etc/x"\r\n'
        + b"Content-Type: video/mp4\r\n\r\n"
        + payload
        + b"\r\n"
        + f"--{boundary}\r\n".encode()
        + b'Content-Disposition: form-data; name="sr_target_resolution"\r\n\r\nhd\r\n'
        + f"--{boundary}--\r\nepilogue".encode()
    )
    pieces = [body[i : i + chunk] for i in range(0, len(body), chunk)]

    async def receive() -> dict:
        return {"type": "http.request", "body": pieces.pop(0) if pieces else b"", "more_body": bool(pieces)}

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/videos",
        "headers": [(b"content-type", f'multipart/form-data; boundary="{boundary}"'.encode())],
    }
    store = JobStore(tmp_path, input_quota_bytes=len(payload))
    limits = Limits(
        max_upload_bytes=len(payload),
        max_fields=2,
        max_fields_bytes=1024,
        max_queued=1,
        input_quota_bytes=len(payload),
        max_output_pixels=1,
        retention_s=1.0,
    )
    job_id = "video_" + "a" * 24
    form = asyncio.run(
        read_form(Request(scope, receive), lambda _: store.open_input(job_id, len(payload), AssertionError), limits)
    )
    assert form.fields == {"seed": "7", "sr_target_resolution": "hd"} and form.file_field == "video_reference"
    assert store.input_path(job_id).read_bytes() == payload and store.quota.used == len(payload)
    assert sorted(p.name for p in store.job_dir(job_id).iterdir()) == ["input"]


def test_video_path_is_opened_only_inside_the_allowed_folders(tmp_path: Path) -> None:
    from entrypoints.server.confine import PathRefused, _open_without_links, open_confined

    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    (allowed / "sub").mkdir(parents=True)
    outside.mkdir()
    clip = make_sample_clip(allowed / "sub" / "a.mp4", width=64, height=64, num_frames=1)
    (allowed / "link.mp4").symlink_to(clip)  # a link that stays inside is followed when resolving
    os.mkfifo(allowed / "pipe.mp4")
    roots = (allowed.resolve(),)

    with pytest.raises(PathRefused) as refused:
        open_confined(str(clip), ())
    assert refused.value.forbidden and "--allow-path" in refused.value.message
    for raw in (str(allowed / "x" / ".." / "sub" / "a.mp4"), str(allowed / "link.mp4")):
        opened = open_confined(raw, roots)
        assert opened.relative == "sub/a.mp4" and opened.size == clip.stat().st_size
        assert os.read(opened.fd, 64) == clip.read_bytes()[:64]
        os.close(opened.fd)
    for raw, code in [
        (str(allowed) + "/a\0b", "invalid_path"),
        ("a\0b", "path_not_absolute"),
        ("sub/a.mp4", "path_not_absolute"),  # never resolved against the server's working folder
        (str(allowed / "none.mp4"), "path_not_found"),
        (str(allowed / ("n" * 300)), "invalid_path"),
        (str(allowed / "sub"), "path_not_a_file"),
        (str(allowed / "pipe.mp4"), "path_not_a_file"),
        (str(allowed), "path_not_a_file"),
    ]:
        with pytest.raises(PathRefused) as refused:
            open_confined(raw, roots)
        assert refused.value.code == code and not refused.value.forbidden, (raw, refused.value.message)

    # The race: the path is resolved and checked, then a folder on it, or the file itself, becomes a link to a file
    # outside before the open. The open follows no link, so it fails instead of reading outside.
    resolved = clip.resolve()
    shutil.copytree(allowed / "sub", outside / "sub")
    shutil.rmtree(allowed / "sub")
    (allowed / "sub").symlink_to(outside / "sub")
    with pytest.raises(PathRefused) as refused:
        _open_without_links(resolved, "'sub/a.mp4'")
    assert refused.value.code == "path_changed"
    (allowed / "sub").unlink()
    (allowed / "sub").mkdir()
    (allowed / "sub" / "a.mp4").symlink_to(outside / "sub" / "a.mp4")
    with pytest.raises(PathRefused) as refused:
        _open_without_links(resolved, "'sub/a.mp4'")
    assert refused.value.code == "path_changed"


def test_messages_from_libraries_lose_the_server_paths() -> None:
    from entrypoints.server.confine import scrub_paths

    known = {"/srv/k6vsr/store/jobs/video_x/input": "the clip", "/srv/k6vsr/store": "<store>"}
    message = "[Errno 1094995529] Invalid data found when processing input: '/srv/k6vsr/store/jobs/video_x/input'"
    assert scrub_paths(message, known) == "[Errno 1094995529] Invalid data found when processing input: 'the clip'"
    assert scrub_paths("/srv/k6vsr/store/runs/abc: disk full", known) == "<store>/runs/abc: disk full"
    assert scrub_paths("no /etc/shadow: denied; 1/2 of x2/x4", {}) == "no <path>: denied; 1/2 of x2/x4"


def test_an_hdr10_job_answers_its_colour_depth_and_metadata(
    server: Server, stack: dict[str, Path], tmp_path: Path
) -> None:
    """An HDR10 source runs at 16 bits and its answer says so; a BT.709 8-bit job's answer is as before."""
    done = completed(server, server.post_json(video_path=str(stack["allowed"] / "hdr10.mp4"), codec="hevc"))
    output = done["output"]
    assert (output["colour"], output["pixel_depth"]) == ("bt2020/smpte2084/bt2020nc/tv", 16)
    assert output["hdr_metadata"].startswith("mastering display 0.005-1000 cd/m²")
    response = server.client.get(f"/v1/videos/{done['id']}/content")
    (tmp_path / "out.mp4").write_bytes(response.content)
    written = media.probe(tmp_path / "out.mp4")
    assert (written.pix_fmt, written.hdr is not None) == ("yuv420p10le", True)
    refused = server.post_json(video_path=str(stack["allowed"] / "hdr10.mp4"), pix_fmt="yuv420p")
    error = error_of(refused, 400, [str(stack["root"])])
    assert error["code"] == "unsupported_colour" and "pix_fmt=yuv420p is 8-bit" in error["message"]
    plain = completed(server, server.post_json(video_path=str(stack["allowed"] / "square.mp4"), audio="none"))
    assert not {"colour", "pixel_depth", "hdr_metadata"} & set(plain["output"])


def test_output_controls_as_request_fields(server: Server, stack: dict[str, Path], tmp_path: Path) -> None:
    source = str(stack["allowed"] / "square.mp4")
    done = completed(server, server.post_json(video_path=source, sr_resolution_scale=2, codec="ffv1", audio="none"))
    assert done["params"]["codec"] == "ffv1" and done["params"]["audio"] == "none"
    response = server.client.get(f"/v1/videos/{done['id']}/content")
    assert response.status_code == 200 and response.headers["content-type"] == "video/x-matroska"
    out = tmp_path / "out.mkv"
    out.write_bytes(response.content)
    with av.open(str(out)) as container:
        assert container.streams.video[0].codec_context.name == "ffv1" and not container.streams.audio
    assert "sample_aspect" not in done["output"]  # square pixels: answered as before
    # As ProRes, a tape's 4:3 frame of 16:15 pixels is served as QuickTime, its pixels kept.
    tape = str(stack["allowed"] / "tape.mp4")
    done = completed(server, server.post_json(video_path=tape, sr_resolution_scale=2, codec="prores"))
    assert done["output"]["sample_aspect"] == "16/15" and done["size"] == "180x144"
    response = server.client.get(f"/v1/videos/{done['id']}/content")
    assert response.headers["content-type"] == "video/quicktime"
    (tmp_path / "out.mov").write_bytes(response.content)
    with av.open(str(tmp_path / "out.mov")) as container:
        assert container.streams.video[0].sample_aspect_ratio == Fraction(16, 15)
    jobs = stack["store"] / "jobs"
    before = sorted(p.name for p in jobs.iterdir())
    for fields, param in (
        ({"codec": "ffv1", "crf": 20}, "crf"),
        ({"codec": "vp9"}, "codec"),
        ({"pix_fmt": "rgb48"}, "pix_fmt"),
        ({"audio": "/etc/passwd"}, "audio"),
        ({"fps_mode": "double"}, "fps_mode"),
    ):
        error = error_of(server.post_json(video_path=source, **fields), 400, server_paths(stack))
        assert error["code"] == "invalid_value" and param in error["message"], error
    assert sorted(p.name for p in jobs.iterdir()) == before
