"""The HTTP API's limits and ownership, on a server with small limits and several keys, and a fuzz test against it.

The module server has two client keys (from a key file) and an admin key, a 1 MB upload cap, a 2 MB input quota,
3 queued jobs, 8 fields of 8 KB in all, 2 megapixels of output a job and a retention of 7.2 s.
"""

from __future__ import annotations

import json
import os
import random
import string
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest
from http_harness import Server, completed, error_of

from k6vsr_core.media.sample import make_sample_clip

KEY_A, KEY_B, ADMIN = "key-a-0123456789abcdef", "key-b-0123456789abcdef", "admin-0123456789abcdef"
QUOTA = 2 << 20
MAX_QUEUED = 3
RETENTION_S = 7.2


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, tiny_bundle_path: Path, prefect_server: str) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("limits")
    allowed, outside = root / "allowed", root / "outside"
    allowed.mkdir()
    outside.mkdir()
    make_sample_clip(allowed / "square.mp4", width=64, height=64, num_frames=1)
    make_sample_clip(allowed / "slow.mp4", width=96, height=64, num_frames=9)  # x4: 9 frames of 384x256
    make_sample_clip(outside / "secret.mp4", width=112, height=64, num_frames=1)
    (allowed / "escape.mp4").symlink_to(outside / "secret.mp4")
    (allowed / "broken.mp4").write_bytes(b"this is not a video" * 100)
    os.mkfifo(allowed / "pipe.mp4")
    (root / "keys.txt").write_text(f"# clients\n{KEY_A}\n\n{KEY_B}\n")
    return {"root": root, "allowed": allowed, "outside": outside, "store": root / "store", "bundle": tiny_bundle_path}


@pytest.fixture(scope="module")
def server(stack: dict[str, Path]):
    args = [
        "--allow-path",
        str(stack["allowed"]),
        "--api-key-file",
        str(stack["root"] / "keys.txt"),
        "--admin-key",
        ADMIN,
        "--max-upload-mb",
        "1",
        "--input-quota-mb",
        str(QUOTA >> 20),
        "--max-queued",
        str(MAX_QUEUED),
        "--max-fields",
        "8",
        "--max-fields-kb",
        "8",
        "--max-output-mpx",
        "2",
        "--retention-hours",
        str(RETENTION_S / 3600),
    ]
    running = Server(stack["root"], stack["store"], stack["bundle"], "limits", args, KEY_A).start()
    yield running
    running.stop()


def server_paths(stack: dict[str, Path]) -> list[str]:
    return [str(stack["root"]), str(stack["root"].resolve()), "/proc/", os.path.expanduser("~")]


def usage(store: Path) -> tuple[int, int]:
    """(jobs queued, bytes of job inputs on disk), read from the store."""
    queued = inputs = 0
    for record in (store / "jobs").glob("video_*.json"):
        try:
            queued += json.loads(record.read_text())["status"] == "queued"
        except (OSError, ValueError):
            continue
    for source in (store / "jobs").glob("video_*/input"):
        try:
            inputs += source.stat().st_size
        except OSError:
            continue
    return queued, inputs


def delete_all(server: Server) -> None:
    admin = server.as_key(ADMIN)
    for job in admin.get("/v1/videos").json()["data"]:
        deadline = time.monotonic() + 30
        while (response := admin.delete(f"/v1/videos/{job['id']}")).status_code != 404:
            if response.status_code == 200 and response.json().get("deleted"):
                break
            assert time.monotonic() < deadline, response.text
            time.sleep(0.2)
    admin.close()


def test_each_job_belongs_to_its_key(server: Server, stack: dict[str, Path]) -> None:
    a, b, admin, nobody = server.as_key(KEY_A), server.as_key(KEY_B), server.as_key(ADMIN), server.as_key(None)
    square = stack["allowed"] / "square.mp4"
    by_path = a.post("/v1/videos", json={"video_path": str(square), "sr_resolution_scale": 2, "seed": 61}).json()
    upload = server.post_upload(square, client=a, sr_resolution_scale=2, seed=62).json()
    assert by_path["source"] == {"type": "path", "video_path": "square.mp4"}
    mine = {job["id"]: job for job in a.get("/v1/videos").json()["data"]}
    assert {by_path["id"], upload["id"]} <= set(mine) and mine[by_path["id"]]["source"]["video_path"] == "square.mp4"

    # Another key neither lists, reads, downloads nor deletes them: to it they do not exist.
    assert not {by_path["id"], upload["id"]} & {job["id"] for job in b.get("/v1/videos").json()["data"]}
    for job_id in (by_path["id"], upload["id"]):
        for response in (
            b.get(f"/v1/videos/{job_id}"),
            b.get(f"/v1/videos/{job_id}/content"),
            b.delete(f"/v1/videos/{job_id}"),
        ):
            assert error_of(response, 404)["code"] == "job_not_found"
        assert a.get(f"/v1/videos/{job_id}").json()["status"] != "cancelled"
    error_of(nobody.get("/v1/videos"), 401)

    # The admin key sees every job, without the owner's paths.
    seen = {job["id"]: job for job in admin.get("/v1/videos").json()["data"]}
    assert seen[by_path["id"]]["source"] == {"type": "path"} and seen[upload["id"]]["source"] == {"type": "upload"}
    assert admin.get(f"/v1/videos/{by_path['id']}").json()["source"] == {"type": "path"}
    for client in (a, b, admin, nobody):
        client.close()
    for job_id in (by_path["id"], upload["id"]):  # finished, not cancelled: the worker stays warm for the next test
        server.wait(job_id)
    delete_all(server)


def test_runs_are_reclaimed_and_finished_jobs_expire(server: Server, stack: dict[str, Path]) -> None:
    store = stack["store"]
    square = str(stack["allowed"] / "square.mp4")
    kept = completed(server, server.post_json(video_path=square, sr_resolution_scale=2, seed=81))
    assert (store / "runs" / kept["run_key"]).is_dir() and (store / "jobs" / kept["id"] / "output.mp4").is_file()
    assert kept["expires_at"] == int(kept["completed_at"] + RETENTION_S)
    record = json.loads((store / "jobs" / f"{kept['id']}.json").read_text())  # what the disk budget counts
    assert record["disk_bytes"] > kept["output"]["bytes"] > 0 and "prepared" not in record

    deleted = completed(server, server.post_json(video_path=square, sr_resolution_scale=2, seed=82))
    assert server.client.delete(f"/v1/videos/{deleted['id']}").json()["deleted"] is True
    assert not (store / "runs" / deleted["run_key"]).exists()  # a deleted job's run goes with it

    deadline = time.monotonic() + RETENTION_S + 30
    while server.client.get(f"/v1/videos/{kept['id']}").status_code != 404:
        assert time.monotonic() < deadline, "the finished job outlived its retention time"
        time.sleep(0.5)
    assert not (store / "runs" / kept["run_key"]).exists() and not (store / "jobs" / kept["id"]).exists()


def test_input_quota_counts_every_byte_and_is_freed_on_cancel(server: Server, stack: dict[str, Path]) -> None:
    """Uploads with junk after a valid clip are taken, and the junk counts: the third 0.9 MB upload does not fit in
    the 2 MB quota while two wait; cancelling one frees its input at once."""
    store = stack["store"]
    slow = server.post_json(video_path=str(stack["allowed"] / "slow.mp4"), sr_resolution_scale=4, seed=70).json()
    server.wait(slow["id"], until=("in_progress", "completed"))
    clip = (stack["allowed"] / "square.mp4").read_bytes()
    padded = clip + os.urandom(900_000 - len(clip))
    first = server.post_upload(padded, sr_resolution_scale=2, seed=71)
    second = server.post_upload(padded, sr_resolution_scale=2, seed=72)
    assert first.status_code == second.status_code == 200, (first.text, second.text)
    upload = store / "jobs" / second.json()["id"] / "input"  # waiting behind the slow job
    assert upload.stat().st_size == len(padded) and upload.stat().st_mode & 0o777 == 0o600
    third = server.post_upload(padded, sr_resolution_scale=2, seed=73)
    assert error_of(third, 429)["code"] == "input_quota_full" and third.headers["Retry-After"].isdigit()
    assert usage(store)[1] <= QUOTA

    assert server.client.delete(f"/v1/videos/{first.json()['id']}").json()["status"] == "cancelled"
    assert not (store / "jobs" / first.json()["id"]).exists()
    third = server.post_upload(padded, sr_resolution_scale=2, seed=73)
    assert third.status_code == 200, third.text
    assert usage(store)[1] <= QUOTA
    delete_all(server)
    assert usage(store) == (0, 0)


def test_listing_needs_keys_or_list_jobs(tmp_path: Path) -> None:
    from fastapi.testclient import TestClient

    from entrypoints.server.app import Limits, ServerConfig, create_app
    from service.runs import ModelSpec

    limits = Limits(
        max_upload_bytes=1 << 20,
        max_fields=8,
        max_fields_bytes=8 << 10,
        max_queued=1,
        input_quota_bytes=1 << 20,
        max_output_pixels=10**6,
        retention_s=60.0,
    )
    config = ServerConfig(store_root=tmp_path, limits=limits)
    # No `with`: the job runner of the app's lifespan does not start; the routes answer all the same.
    closed = TestClient(create_app(config, ModelSpec(model="unused")))
    assert error_of(closed.get("/v1/videos"), 403)["code"] == "listing_disabled"
    opened = TestClient(create_app(replace(config, list_jobs=True), ModelSpec(model="unused")))
    listed = opened.get("/v1/videos").json()
    assert listed == {"object": "list", "data": [], "first_id": None, "last_id": None, "has_more": False}


# ---------------------------------------------------------------------------------------------- fuzz

FUZZ_REQUESTS = 300
FIELD_NAMES = [
    "sr_resolution_scale",
    "sr_tiles_batch_size",
    "sr_tile_min_overlap",
    "sr_target_resolution",
    "sr_target_resize_mode",
    "seed",
    "num_inference_steps",
    "model",
    "prompt",
    "video_path",
    "video_reference",
    "latent_reference",
    "fps",
    "fps_mode",
    "extra_body",
]


def _text(rng: random.Random, size: int) -> str:
    alphabet = string.printable + "\u00fc\u2202\u202e\ufffd\x00/.."
    return "".join(rng.choice(alphabet) for _ in range(size))


def _value(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(9 if depth < 4 else 6)
    if kind == 0:
        return rng.choice([0, 1, 2, 4, -1, 2**63, 2.25, 1e308, float("inf")])
    if kind == 1:
        return rng.choice(["2", "4", "2.25", "hd", "fit", "exact", "1920x1080", "99999x99999", "", "nan"])
    if kind == 2:
        return _text(rng, rng.choice([0, 3, 40, 3000]))
    if kind in (3, 4):
        return rng.choice([None, True, False])
    if kind == 5:
        return rng.random()
    if kind == 6:
        return [_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {rng.choice(FIELD_NAMES + ["x"]): _value(rng, depth + 1) for _ in range(rng.randrange(4))}


def _paths(stack: dict[str, Path]) -> list[Any]:
    allowed, outside = stack["allowed"], stack["outside"]
    return [
        str(allowed / "square.mp4"),
        str(allowed / "broken.mp4"),
        str(allowed / "escape.mp4"),
        str(allowed / "pipe.mp4"),
        str(allowed),
        str(allowed / "sub" / ".." / "square.mp4"),
        str(outside / "secret.mp4"),
        str(allowed / ".." / "outside" / "secret.mp4"),
        "/etc/passwd",
        "/proc/self/environ",
        "/dev/zero",
        "",
        "square.mp4",
        "~",
        str(allowed / ("x" * 300)),
        "a" * 5000,
        str(allowed) + "\x00/square.mp4",
        str(allowed / "\u00fc\u2202.mp4"),
        7,
        None,
        [str(allowed / "square.mp4")],
    ]


def _multipart(rng: random.Random, stack: dict[str, Path]) -> tuple[bytes, str]:
    boundary = rng.choice(["b0undary", "x" * 70, "--", "a;b", ""]) if rng.random() < 0.1 else "fuzz" + str(rng.random())
    clip = (stack["allowed"] / "square.mp4").read_bytes()
    body = b""
    for _ in range(rng.choice([0, 1, 2, 3, 6, 12])):
        name = rng.choice(FIELD_NAMES + [_text(rng, rng.choice([1, 30, 300]))])
        disposition = f'form-data; name="{name}"'
        if rng.random() < 0.3 or name in ("video_reference", "latent_reference"):
            disposition += '; filename="../../x.mp4"'
        kind = rng.randrange(5)
        if kind == 0:
            data = clip
        elif kind == 1:
            data = clip[: rng.randrange(len(clip))] + rng.randbytes(rng.choice([0, 100, 600_000]))
        elif kind == 2:
            data = rng.randbytes(rng.choice([0, 10, 9000, 1_100_000]))
        else:
            data = str(_value(rng)).encode("utf-8", "surrogatepass")
        header = f"Content-Disposition: {disposition}\r\n" if rng.random() < 0.95 else "X-Nothing: 1\r\n"
        body += f"--{boundary}\r\n{header}\r\n".encode("utf-8", "replace") + data + b"\r\n"
    if rng.random() < 0.85:
        body += f"--{boundary}--\r\n".encode("utf-8", "replace")
    return body, boundary


VALID = {
    "sr_resolution_scale": [2, "4", 2.25],
    "seed": [0, 5, "7"],
    "sr_target_resolution": ["hd", "64x64"],
    "sr_target_resize_mode": ["fit", "exact"],
    "sr_tiles_batch_size": [1, 2],
}


def _valid_fields(rng: random.Random) -> dict[str, Any]:
    return {name: rng.choice(VALID[name]) for name in rng.sample(sorted(VALID), rng.randrange(3))}


def fuzz_requests(rng: random.Random, stack: dict[str, Path]) -> Iterator[tuple[str, str, dict[str, Any]]]:
    """(method, url, httpx arguments) of random requests: JSON, raw bodies, multipart, ids and routes; some of them
    well formed, so that paths are opened, jobs queued and the quota filled."""
    paths = _paths(stack)
    clip = (stack["allowed"] / "square.mp4").read_bytes()
    for _ in range(FUZZ_REQUESTS):
        kind = rng.randrange(7)
        if kind == 0:
            body = {rng.choice(FIELD_NAMES + [_text(rng, 8)]): _value(rng) for _ in range(rng.randrange(12))}
            if rng.random() < 0.8:
                body["video_path"] = rng.choice(paths)
            yield (
                "POST",
                "/v1/videos",
                {"content": json.dumps(body).encode(), "headers": {"Content-Type": "application/json"}},
            )
        elif kind == 1:
            yield "POST", "/v1/videos", {"json": {"video_path": rng.choice(paths), **_valid_fields(rng)}}
        elif kind == 2:
            raw = rng.choice(
                [
                    rng.randbytes(rng.randrange(200)),
                    b"[" * 50_000,
                    b'{"seed": 1e99999}',
                    b"null",
                    b'{"video_path": "' + b"\\ud800" * 10 + b'"}',
                    b"{" * 5000 + b"}" * 5000,
                    json.dumps({"extra_body": {"seed": _value(rng)}}).encode(),
                ]
            )
            yield (
                "POST",
                "/v1/videos",
                {
                    "content": raw,
                    "headers": {
                        "Content-Type": rng.choice(
                            [
                                "application/json",
                                "",
                                "text/plain",
                                "multipart/form-data",
                                "application/json; charset=latin-1",
                            ]
                        )
                    },
                },
            )
        elif kind == 3:
            body, boundary = _multipart(rng, stack)
            yield (
                "POST",
                "/v1/videos",
                {"content": body, "headers": {"Content-Type": f"multipart/form-data; boundary={boundary}"}},
            )
        elif kind == 4:
            upload = clip + rng.randbytes(rng.choice([0, 0, 300_000, 900_000, 1_100_000]))
            fields = {name: str(value) for name, value in _valid_fields(rng).items()}
            yield "POST", "/v1/videos", {"files": {"video_reference": ("x.mp4", upload)}, "data": fields}
        elif kind == 5:
            unknown = "video_" + "".join(rng.choice(string.ascii_letters + string.digits + "-_") for _ in range(24))
            job_id = rng.choice(
                [
                    unknown,
                    _text(rng, rng.choice([1, 20, 3000])),
                    "..%2F..%2Fetc%2Fpasswd",
                    "video_" + "A" * 64,
                    "video_../../jobs",
                ]
            )
            route = "/v1/videos/" + urllib.parse.quote(job_id, safe="%") + rng.choice(["", "/content", "/x"])
            yield rng.choice(["GET", "DELETE"]), route, {}
        else:
            yield (
                rng.choice(["GET", "PUT", "PATCH", "POST", "OPTIONS"]),
                rng.choice(["/v1/videos", "/", "/v1", "/health", "/v1/videos/", "/docs"]),
                {},
            )


def _snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p): (p.lstat().st_size, p.lstat().st_mtime_ns) for p in folder.rglob("*")}


def test_fuzz_finds_no_500_no_hang_no_escape_and_no_growth(server: Server, stack: dict[str, Path]) -> None:
    seed = int(os.environ.get("K6VSR_FUZZ_SEED", "20260101"))
    rng = random.Random(seed)
    from storage import source_info

    secret = source_info(stack["outside"] / "secret.mp4").sha256
    before = {name: _snapshot(stack[name]) for name in ("allowed", "outside")}
    root_entries = {p.name for p in stack["root"].iterdir()}
    hidden = server_paths(stack)
    client = httpx.Client(base_url=server.client.base_url, headers=server.client.headers, timeout=20)
    admin = server.as_key(ADMIN)
    started = time.monotonic()
    statuses: dict[int, int] = {}
    for index, (method, url, arguments) in enumerate(fuzz_requests(rng, stack)):
        where = f"request {index} of seed {seed}: {method} {url[:80]} {str(arguments)[:200]}"
        response = client.request(method, url, **arguments)  # a hang fails here, after 20 s
        assert response.status_code < 500, (where, response.text)
        for secret_path in hidden:
            assert secret_path not in response.text, (where, response.text)
        if response.status_code >= 400:
            error_of(response, response.status_code)
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        if index % 10 == 0:
            queued, inputs = usage(stack["store"])
            assert queued <= MAX_QUEUED and inputs <= QUOTA, (where, queued, inputs)
            for job in admin.get("/v1/videos").json()["data"]:  # cancel the waiting ones: the rest is read again
                if job["status"] == "queued":
                    admin.delete(f"/v1/videos/{job['id']}")
    client.close()
    admin.close()
    elapsed = time.monotonic() - started

    assert {name: _snapshot(stack[name]) for name in ("allowed", "outside")} == before
    assert {p.name for p in stack["root"].iterdir()} == root_entries
    for manifest in (stack["store"] / "runs").glob("*/manifest.json"):
        assert json.loads(manifest.read_text())["source"]["sha256"] != secret
    delete_all(server)
    assert elapsed < 120, elapsed
    assert {200, 400, 403, 404, 413} <= set(statuses), statuses  # jobs queued, and every kind of refusal
