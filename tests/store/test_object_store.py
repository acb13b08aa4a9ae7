"""The run store in an S3 bucket: a real S3 endpoint (moto's server) on loopback, started here, a bucket per test.

The clip flow, the archive and the HTTP API with their store in the bucket write the bytes of a local store; a
failed, killed or cut-off run resumes from the bucket without recomputing anything finished; a record whose checksum
does not match, or an object cut short, is not done; two runs of one key at once write the output object once; and
Dask workers with folders of their own read the source from the store, never from the client's disk.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import fault_harness
import numpy as np
import procs
import pytest

from k6vsr_core import UpscaleParams
from k6vsr_core.errors import StoreError
from service.runs import ModelSpec, prepare_run
from storage import RunStore, StoreUnreachable, collect_garbage, default_store_root
from storage.location import Location, location

PARAMS = UpscaleParams(scale=2)


class Endpoint:
    """moto's S3 server on 127.0.0.1. Its objects live in this process, so a server stopped and started again on the
    same port serves them again: an endpoint that goes away and comes back."""

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.server.start()
        self.host, self.port = self.server.get_host_and_port()
        self.url = f"http://{self.host}:{self.port}"

    def stop(self) -> None:
        self.server.stop()

    def start(self) -> None:
        from moto.server import ThreadedMotoServer

        self.server = ThreadedMotoServer(ip_address=self.host, port=self.port, verbose=False)
        self.server.start()


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[Endpoint]:
    """The endpoint, and the AWS_* settings that point every client (and child process) at it."""
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    endpoint = Endpoint()
    settings = {
        "AWS_ENDPOINT_URL": endpoint.url,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        # The client's attempts per request (botocore's default 5 back off for seconds between them): a test that
        # stops the endpoint waits for the requests in flight to give up.
        "AWS_MAX_ATTEMPTS": "3",
    }
    saved = {key: os.environ.get(key) for key in settings}
    os.environ.update(settings)
    yield endpoint
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    endpoint.stop()


@pytest.fixture
def bucket(s3_endpoint: Endpoint) -> str:
    """A fresh bucket; the store is a prefix in it."""
    import s3fs

    name = f"k6vsr-{uuid.uuid4().hex[:12]}"
    s3fs.S3FileSystem().mkdir(name)
    return f"s3://{name}/store"


def _run(clip: Path, out: Path, bundle_path: Path, store: str):
    from flows.orchestrate import run_clip

    model = ModelSpec(model=str(bundle_path), device="cpu")
    return run_clip(prepare_run(clip, PARAMS, model, store), str(out), model).summary()


def _objects(url: str) -> list[str]:
    where = location(url)
    return sorted(name.removeprefix(where.path + "/") for name in where.fs.find(where.path))


# --------------------------------------------------------------------------------------------------- the store


def test_store_keeps_arrays_and_records_as_objects(bucket: str) -> None:
    store = RunStore(bucket, "k")
    value = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    for key in ((0, 0), (0, 1), (1, 0)):
        store.put_tile("tile_latents", key, (2, 2), value, stage="denoise", seconds=0.5, attempt="a")
    assert np.array_equal(store.get_tile("tile_latents", (0, 1), stage="denoise"), value)
    assert store.records.items("denoise") == ["0-0", "0-1", "1-0"]
    assert store.records.computed("a") == {"denoise": {"0-0", "0-1", "1-0"}}
    objects = _objects(f"{bucket}/runs/k")
    assert "done/denoise/0-1.json" in objects and "data.zarr/tile_latents/c/0/1/0/0/0" in objects
    assert "timeline/denoise-0-1-a.json" in objects  # an object per line: objects cannot be appended to

    store.drop_window(["tile_latents"], 0)
    assert not store.tile_done("tile_latents", (0, 1), stage="denoise")
    assert store.records.read("denoise", "0-1") is not None  # the record stays: the work was done
    assert np.array_equal(store.get_tile("tile_latents", (1, 0), stage="denoise"), value)
    assert not any(name.startswith("data.zarr/tile_latents/c/0/") for name in _objects(f"{bucket}/runs/k"))


def test_record_with_a_wrong_checksum_is_not_done(bucket: str, tmp_path: Path) -> None:
    store = RunStore(bucket, "k")
    value = np.ones((2, 3), dtype=np.float32)
    store.put_tile("tiles", (0, 0), (1, 1), value, stage="decode")
    record = store.records.read("decode", "0-0")
    store.records.location("decode", "0-0").write_bytes(
        record.model_copy(update={"checksum": "0" * 64}).model_dump_json().encode()
    )
    assert store.get_tile("tiles", (0, 0), stage="decode") is None
    assert not store.tile_done("tiles", (0, 0), stage="decode")
    store.records.location("decode", "0-0").write_bytes(b"{torn")
    assert store.records.read("decode", "0-0") is None

    segment = tmp_path / "segment.mp4"
    segment.write_bytes(b"frames")
    store.commit_file(segment, store.segment_path(0), "segment", "0")
    assert store.segment_done(0) and store.segment_path(0).read_bytes() == b"frames"
    store.segment_path(0).write_bytes(b"frames, changed")
    assert not store.segment_done(0)


def test_output_object_is_written_once_whole(bucket: str, tmp_path: Path) -> None:
    """The store's output is a conditional write (If-None-Match): a twin's identical object is accepted, a leftover
    without a valid record is replaced, and nothing but whole objects is ever there."""
    store = RunStore(bucket, "k")
    output = store.output_path
    first, again = tmp_path / "first.mp4", tmp_path / "again.mp4"
    first.write_bytes(b"output")
    again.write_bytes(b"output")
    assert output.put(first, exclusive=True) and not output.put(again, exclusive=True)
    store.commit_file(again, output, "mux", "all", exclusive=True)  # the twin's object, byte for byte
    assert store.output_done()

    store.records.drop("mux", "all")
    output.write_bytes(b"half an outp")  # left by a run that never wrote its record
    again.write_bytes(b"output")
    store.commit_file(again, output, "mux", "all", exclusive=True)
    assert store.output_done() and output.read_bytes() == b"output"
    assert [name for name in _objects(f"{bucket}/runs/k") if "part" in name] == []


def test_store_url_is_taken_from_the_environment(bucket: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("K6VSR_STORE", bucket + "/")
    assert default_store_root() == bucket
    assert str(RunStore(default_store_root(), "k").where) == f"{bucket}/runs/k"


def _put_run(bucket: str, key: str) -> RunStore:
    store = RunStore(bucket, key)
    store.put_tile("tiles", (0, 0), (1, 1), np.ones(4, dtype=np.float32), stage="decode")
    store.output_path.write_bytes(b"output")
    store.records.write("mux", "all", "checksum")
    return store


def test_gc_spares_runs_holding_a_lease_and_reclaims_the_rest(bucket: str) -> None:
    live, _, killed = (_put_run(bucket, key) for key in ("live", "done", "killed"))
    # A run killed outright leaves its lease, which expires since nobody renews it.
    (killed.where / "leases" / "dead-host-1.json").write_bytes(json.dumps({"expires_at": time.time() - 1}).encode())
    assert {r["run_key"]: r["reason"] for r in collect_garbage(bucket, older_than_s=3600)} == dict.fromkeys(
        ("done", "killed", "live"), "recent"
    )
    with live.in_use():
        (lease,) = _objects(f"{bucket}/runs/live/leases")
        report = {
            r["run_key"]: (r["deleted"], r["reason"]) for r in collect_garbage(bucket, keep_finished_outputs=True)
        }
    assert report == {
        "live": (False, "in use by a live run"),
        "done": (True, "intermediates reclaimed, output kept"),
        "killed": (True, "intermediates reclaimed, output kept"),
    }
    assert _objects(f"{bucket}/runs/done") == ["done/decode/0-0.json", "done/mux/all.json", "output.mp4"]
    assert "leases/" + lease not in _objects(f"{bucket}/runs/live")  # released at the end of the run
    collect_garbage(bucket, run_keys=["live"])
    assert _objects(f"{bucket}/runs/live") == [] and _objects(f"{bucket}/runs/done")


def test_lease_is_renewed_and_a_run_waits_for_a_gc_deciding(bucket: str) -> None:
    from storage import leases

    run = RunStore(bucket, "k").where
    (run / leases.GC_MARKER).write_bytes(json.dumps({"expires_at": time.time() + 1.5}).encode())
    started = time.monotonic()
    with leases.held(run, seconds=0.6, poll_s=0.2):
        assert time.monotonic() - started >= 1.0  # it waited for the marker (here one that lapses, as a dead gc's)
        (name,) = (run / "leases").names(".json")
        first = json.loads((run / "leases" / name).read_bytes())["expires_at"]
        time.sleep(0.8)
        assert json.loads((run / "leases" / name).read_bytes())["expires_at"] > first
    assert (run / "leases").names(".json") == []


def test_source_is_uploaded_once_and_read_from_a_checked_download(
    bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store's copy of a source is downloaded once per content into the temporary folder, only the most
    recently used are kept there, and a copy whose bytes do not match its record is refused, then uploaded again."""
    import tempfile

    from storage.manifest import RunManifest, SourceInfo
    from storage.run_store import SOURCES_KEPT

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()

    def kept(key: str, content: bytes) -> tuple[RunStore, RunManifest]:
        source = tmp_path / f"{key}.mp4"
        source.write_bytes(content)
        store = RunStore(bucket, key)
        store.keep_source(source, "a")
        return store, RunManifest.model_construct(source=SourceInfo(path=str(source), sha256="", size=len(content)))

    store, manifest = kept("k", b"frames" * 100)
    assert "source.mp4" in _objects(str(store.where)) and store.attempt_of("ingest", "source") == "a"
    first = store.source_file(manifest)
    assert first.read_bytes() == b"frames" * 100 and first.parent == tmp_path / "tmp" / "k6vsr-sources"
    store.source_copy(manifest.source.path).remove()
    assert store.source_file(manifest) == first  # read again from the download, not the store

    damaged, manifest = kept("damaged", b"other frames" * 100)
    _truncate(damaged.source_copy(manifest.source.path))
    with pytest.raises(StoreError, match="the store's copy of its source is damaged"):
        damaged.source_file(manifest)
    damaged.keep_source(manifest.source.path, "b")
    assert damaged.source_file(manifest).read_bytes() == b"other frames" * 100
    assert damaged.attempt_of("ingest", "source") == "b"

    for index in range(SOURCES_KEPT):
        store, manifest = kept(f"more-{index}", b"more" * (index + 1))
        store.source_file(manifest)
    assert len(list(first.parent.glob("[!.]*"))) == SOURCES_KEPT and not first.exists()


# --------------------------------------------------------------------------------------------------- the flow


def test_flow_in_a_bucket_writes_the_local_bytes_and_resumes_from_it(
    prefect_server: str,
    bucket: str,
    tiny_bundle_path: Path,
    clip_1f: Path,
    reference: bytes,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A run that fails on one tile's decode keeps every finished item in the bucket; the rerun decodes only that
    tile and writes the local store's bytes; a run after that reuses everything, and an output record whose
    checksum does not match makes it mux again (the same bytes, accepted by the conditional write)."""
    from flows.upscale_clip import TileFailure
    from k6vsr_core.errors import UserFacingError
    from k6vsr_core.model import stages

    plain, decoded = stages.decode_tile, []

    def decode_tile(bundle, latent, depth=8):
        decoded.append(latent.shape)
        if len(decoded) == 4:
            raise UserFacingError("a permanent fault in one tile")  # permanent: not retried
        return plain(bundle, latent, depth)

    monkeypatch.setattr(stages, "decode_tile", decode_tile)
    monkeypatch.chdir(tmp_path)  # a store URL read as a folder would land here
    with pytest.raises(TileFailure, match="1 of 6 tiles failed"):
        _run(clip_1f, tmp_path / "a.mp4", tiny_bundle_path, bucket)
    assert len(decoded) == 6 and not (tmp_path / "a.mp4").exists()

    decoded.clear()
    first = _run(clip_1f, tmp_path / "a.mp4", tiny_bundle_path, bucket)
    assert (tmp_path / "a.mp4").read_bytes() == reference
    # The tile is decoded by this run (it counts as computed); it was denoised on the failed run (no DiT call).
    assert len(decoded) == 1 and (first.tiles_computed, first.dit_calls) == (1, 0)
    assert first.store == f"{bucket}/runs/{first.run_key}" and first.log.startswith(f"{bucket}/runs/")
    objects = _objects(first.store)
    assert {"manifest.json", "output.mp4", "audio.f32", "segments/000000.mp4", "done/mux/all.json"} <= set(objects)
    assert len([name for name in objects if name.startswith("logs/")]) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.mp4"]  # nothing of the run on local disk

    store = RunStore(bucket, first.run_key)
    record = store.records.read("mux", "all")
    store.records.location("mux", "all").write_bytes(
        record.model_copy(update={"checksum": "f" * 64}).model_dump_json().encode()
    )
    decoded.clear()
    again = _run(clip_1f, tmp_path / "b.mp4", tiny_bundle_path, bucket)
    assert (tmp_path / "b.mp4").read_bytes() == reference
    assert (again.tiles_computed, again.reused_output, decoded) == (0, False, [])
    assert store.output_done()


def test_endpoint_gone_mid_run_fails_clearly_and_the_run_resumes_when_it_is_back(
    prefect_server: str,
    s3_endpoint: Endpoint,
    bucket: str,
    tiny_bundle_path: Path,
    clip_1f: Path,
    reference: bytes,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from k6vsr_core.model import stages

    plain, stopped = stages.decode_tile, threading.Event()

    def decode_tile(bundle, latent, depth=8):
        if not stopped.is_set():  # at the first decode: some tiles are denoised and stored, perhaps not all
            stopped.set()
            s3_endpoint.stop()
        return plain(bundle, latent, depth)

    monkeypatch.setattr(stages, "decode_tile", decode_tile)
    try:
        with pytest.raises(StoreUnreachable, match=f"^{bucket}/runs/.*: the object store does not answer") as failed:
            _run(clip_1f, tmp_path / "a.mp4", tiny_bundle_path, bucket)
    finally:
        s3_endpoint.start()
    assert "run the same command again once it answers" in str(failed.value)
    monkeypatch.setattr(stages, "decode_tile", plain)
    store = RunStore(bucket, prepare_run(clip_1f, PARAMS, ModelSpec(model=str(tiny_bundle_path)), bucket).run.run_key)
    denoised = len(store.records.items("denoise"))
    assert denoised >= 1 and store.records.items("decode") == []
    again = _run(clip_1f, tmp_path / "a.mp4", tiny_bundle_path, bucket)
    assert (tmp_path / "a.mp4").read_bytes() == reference
    # Every tile is decoded by the rerun (a tile counts as computed where it is decoded); only the tiles the outage
    # left undenoised are denoised again.
    assert again.tiles_computed == again.tiles_total and again.dit_calls == 2 * (again.tiles_total - denoised)


def test_killed_command_resumes_from_the_bucket_recomputing_nothing_finished(
    prefect_server: str, bucket: str, tiny_bundle_path: Path, clip_1f: Path, reference: bytes, tmp_path: Path
) -> None:
    """SIGKILL the command just after its first decoded tile is stored in the bucket; the rerun keeps every record
    the killed one wrote and writes the local store's bytes."""
    argv = [
        "upscale", str(clip_1f), "--scale", "2", "--model", str(tiny_bundle_path), "--device", "cpu",
        "--store", bucket, "-o", str(tmp_path), "--output-file-name", "x.mp4", "--json",
    ]  # fmt: skip
    killed = procs.run(fault_harness.command(*argv, specs=("kill@tile",)))
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    model = ModelSpec(model=str(tiny_bundle_path), device="cpu")
    store = RunStore(bucket, prepare_run(clip_1f, PARAMS, model, bucket).run.run_key)
    finished = {
        (stage, item): store.attempt_of(stage, item)
        for stage in ("denoise", "decode")
        for item in store.records.items(stage)
    }
    # Its two threads decode at once: the other thread's tile may be stored before the kill lands.
    assert 1 <= len(store.records.items("decode")) <= 2 and not (tmp_path / "x.mp4").exists()

    rerun = procs.run(fault_harness.command(*argv))
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    summary = json.loads(rerun.stdout)
    assert (tmp_path / "x.mp4").read_bytes() == reference
    assert {key: store.attempt_of(*key) for key in finished} == finished  # nothing finished was written again
    # A tile counts as reused where this run did not decode it: those the killed run decoded; the chunks it denoised
    # cost no DiT call now.
    assert summary["tiles_reused"] == sum(stage == "decode" for stage, _ in finished) >= 1
    denoised = sum(stage == "denoise" for stage, _ in finished)
    assert summary["dit_calls"] == 2 * (summary["tiles_total"] - denoised)


# --------------------------------------------------------------------------------------------------- URLs


def _upscale_flags(bundle: Path, store: str) -> list[str]:
    return ["--scale", "2", "--model", str(bundle), "--device", "cpu", "--store", store, "--json"]


def test_upscale_reads_a_source_url_and_publishes_to_an_output_url(
    prefect_server: str,
    bucket: str,
    tiny_bundle_path: Path,
    clip_1f: Path,
    reference: bytes,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`k6vsr upscale s3://.../clip.mp4 -o s3://.../out/`: the source is downloaded into a private folder, removed
    at the end, and runs with the key of the same file read from disk; the output is one object of the local bytes,
    and without `-o` it goes beside the source. The run's report reads its still from the store's output."""
    import tempfile

    from entrypoints.cli import main
    from flows import artifacts

    reports: list = []
    monkeypatch.setattr(artifacts, "publish_clip_report", lambda *report: reports.append(report))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    monkeypatch.chdir(tmp_path)
    root = bucket.rsplit("/", 1)[0]
    source = f"{root}/in/clip.mp4"
    location(source).write_bytes(clip_1f.read_bytes())
    argv = ["upscale", source, *_upscale_flags(tiny_bundle_path, bucket)]

    assert main([*argv, "-o", f"{root}/out/", "--output-file-name", "x.mp4"]) == 0
    summary = json.loads(capsys.readouterr().out)
    model = ModelSpec(model=str(tiny_bundle_path), device="cpu")
    assert summary["run_key"] == prepare_run(clip_1f, PARAMS, model, bucket).run.run_key
    assert (summary["source"], summary["output"], summary["tiles_computed"]) == (source, f"{root}/out/x.mp4", 6)
    assert location(f"{root}/out/x.mp4").read_bytes() == reference and _objects(f"{root}/out") == ["x.mp4"]
    ((report, _),) = reports
    assert (report.output, report.output_bytes, report.after.shape[:2]) == (
        summary["output"],
        len(reference),
        (192, 256),
    )

    assert main(argv) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["output"].startswith(f"{root}/in/clip_sr2x_") and again["tiles_computed"] == 0
    assert location(again["output"]).read_bytes() == reference
    # `plan` reads the URL the same way: the run it prints is the run that ran.
    assert main(["plan", source, "--scale", "2", "--model", str(tiny_bundle_path), "--store", bucket, "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)
    assert (planned["source"], planned["run_key"]) == (source, summary["run_key"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tmp"]  # nothing of the run in the working folder
    assert [p.name for p in (tmp_path / "tmp").iterdir() if p.name.startswith("k6vsr-source-")] == []


def test_source_and_output_urls_that_cannot_be_used_are_refused_clearly(
    s3_endpoint: Endpoint, bucket: str, tiny_bundle_path: Path, clip_1f: Path, tmp_path: Path, capsys
) -> None:
    from entrypoints.cli import main

    root = bucket.rsplit("/", 1)[0]

    def refused(*given: str) -> str:
        assert main(["upscale", *given, *_upscale_flags(tiny_bundle_path, str(tmp_path / "store"))]) == 2
        return capsys.readouterr().err

    assert f"{root}/in/missing.mp4: no such object" in refused(f"{root}/in/missing.mp4")
    assert "must name an object" in refused(f"{root}/in/")
    latent = f"{root}/in/missing.safetensors"
    assert f"{latent}: no such object" in refused("--latent", latent, "--fps", "24")
    location(f"{root}/in/clip.mp4").write_bytes(clip_1f.read_bytes())
    missing = f"s3://k6vsr-no-such-bucket-{uuid.uuid4().hex[:8]}/out/"
    assert f"{missing}: the bucket {missing[5:-5]} does not exist" in refused(f"{root}/in/clip.mp4", "-o", missing)
    same = refused(f"{root}/in/clip.mp4", "--output-file-name", "clip.mp4")
    assert f"output {root}/in/clip.mp4 is the input" in same
    assert location(f"{root}/in/clip.mp4").read_bytes() == clip_1f.read_bytes()
    s3_endpoint.stop()
    try:
        assert f"{root}/in/clip.mp4: the object store does not answer" in refused(f"{root}/in/clip.mp4")
    finally:
        s3_endpoint.start()
    assert not (tmp_path / "store").exists()


# --------------------------------------------------------------------------------------------------- the archive


def test_archive_with_its_store_in_a_bucket_writes_the_local_bytes(
    prefect_server: str,
    bucket: str,
    tiny_bundle_path: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`k6vsr archive --store s3://...` of two tiny clips: the outputs of a local-store archive, byte for byte, and
    every run's files in the bucket, none in a local store."""
    from entrypoints.cli import main
    from k6vsr_core.media.sample import make_sample_clip

    monkeypatch.chdir(tmp_path)  # a store URL read as a folder would land here
    folder = tmp_path / "in"
    (folder / "sub").mkdir(parents=True)
    make_sample_clip(folder / "a.mp4", width=64, height=64, num_frames=1)
    make_sample_clip(folder / "sub" / "b.mp4", width=96, height=64, num_frames=1, audio=False)
    argv = ["archive", str(folder), "--model", str(tiny_bundle_path), "--device", "cpu", "--scale", "2", "--json"]

    def archive(out: str, store: str) -> dict:
        assert main([*argv, "-o", str(tmp_path / out), "--store", store]) == 0
        result = json.loads(capsys.readouterr().out)
        assert result["counts"] == {"done": 2}, result
        return {row["relative_path"]: row for row in result["rows"]}

    local = archive("local", str(tmp_path / "store"))
    remote = archive("remote", bucket)
    for relative in ("a.mp4", "sub/b.mp4"):
        name = Path(relative).parent / f"{Path(relative).stem}_sr2x.mp4"
        assert (tmp_path / "remote" / name).read_bytes() == (tmp_path / "local" / name).read_bytes()
        assert remote[relative]["run_key"] == local[relative]["run_key"]
        assert remote[relative]["tiles_computed"] == remote[relative]["tiles"] >= 1
        run = _objects(f"{bucket}/runs/{remote[relative]['run_key']}")
        assert {"manifest.json", "output.mp4", "done/mux/all.json"} <= set(run)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in", "local", "remote", "store"]


# --------------------------------------------------------------------------------------------------- the HTTP API


def test_http_server_runs_its_jobs_in_the_bucket(
    prefect_server: str, bucket: str, tiny_bundle_path: Path, clip_1f: Path, reference: bytes, tmp_path: Path
) -> None:
    """`k6vsr serve --store s3://... --jobs-dir DIR`: a job's run lives in the bucket, its record, input and output
    in DIR, and its output is the local store's bytes."""
    from http_harness import Server, completed

    key = "test-key-0123456789"
    jobs_dir = tmp_path / "jobs"
    args = ["--jobs-dir", str(jobs_dir), "--allow-path", str(clip_1f.parent), "--api-key", key]
    server = Server(tmp_path, bucket, tiny_bundle_path, "server", args, key).start()  # type: ignore[arg-type]
    try:
        done = completed(server, server.post_json(video_path=str(clip_1f), sr_resolution_scale=2))
        assert server.content(done["id"], tmp_path / "out.mp4").read_bytes() == reference
    finally:
        server.stop()
    assert {"manifest.json", "output.mp4", "done/mux/all.json"} <= set(_objects(f"{bucket}/runs/{done['run_key']}"))
    assert (jobs_dir / "jobs" / f"{done['id']}.json").is_file() and not (jobs_dir / "runs").exists()


def test_http_server_with_an_object_store_needs_a_jobs_folder(
    bucket: str, tiny_bundle_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from entrypoints.cli import main

    assert main(["serve", "--store", bucket, "--model", str(tiny_bundle_path), "--device", "cpu"]) != 0
    error = capsys.readouterr().err
    assert f"--store {bucket} is an object store" in error and "--jobs-dir" in error


# --------------------------------------------------------------------------------------------------- faults


def _truncate(where: Location) -> None:
    """Keep the first half of an object's bytes: what a store that published an upload cut short would hold."""
    data = where.read_bytes()
    where.write_bytes(data[: len(data) // 2])


def test_half_uploaded_objects_are_not_done_and_are_computed_again(
    prefect_server: str,
    bucket: str,
    tiny_bundle_path: Path,
    clip_1f: Path,
    reference: bytes,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """After a run that failed on one tile's decode: a decoded tile's chunk cut in half, another tile's decode record
    cut in half and the failed tile's denoised latent cut in half. The rerun denoises the failed tile again, decodes
    those three tiles again, and writes the local store's bytes."""
    from flows.upscale_clip import TileFailure
    from k6vsr_core.errors import UserFacingError
    from k6vsr_core.model import stages

    plain, decoded = stages.decode_tile, []

    def decode_tile(bundle, latent, depth=8):
        decoded.append(latent.shape)
        if len(decoded) == 4:
            raise UserFacingError("a permanent fault in one tile")
        return plain(bundle, latent, depth)

    monkeypatch.setattr(stages, "decode_tile", decode_tile)
    with pytest.raises(TileFailure, match="1 of 6 tiles failed"):
        _run(clip_1f, tmp_path / "a.mp4", tiny_bundle_path, bucket)
    model = ModelSpec(model=str(tiny_bundle_path), device="cpu")
    store = RunStore(bucket, prepare_run(clip_1f, PARAMS, model, bucket).run.run_key)
    done = store.records.items("decode")
    (failed,) = set(store.records.items("denoise")) - set(done)
    cut_tile, cut_record = done[:2]

    def chunk(name: str, item: str) -> Location:
        window, tile = item.split("-")
        prefix = f"data.zarr/{name}/c/{window}/{tile}/"
        (found,) = [name for name in _objects(str(store.where)) if name.startswith(prefix)]
        return store.where / found

    _truncate(chunk("tiles", cut_tile))
    _truncate(store.records.location("decode", cut_record))
    _truncate(chunk("tile_latents", failed))
    decoded.clear()
    again = _run(clip_1f, tmp_path / "a.mp4", tiny_bundle_path, bucket)
    assert (tmp_path / "a.mp4").read_bytes() == reference
    # Three decodes (the cut chunk, the cut record, the failed tile), so three tiles computed; one denoise again.
    assert again.tiles_computed == 3 and len(decoded) == 3 and again.dit_calls == 2
    assert store.attempt_of("denoise", failed) == store.attempt_of("decode", cut_record)  # both of the rerun


def test_two_runs_of_one_key_at_once_publish_the_output_once(
    prefect_server: str, bucket: str, tiny_bundle_path: Path, tmp_path: Path
) -> None:
    """Two runs of one request at once against the bucket (its versioning on, so every write of an object is kept
    as a version): both succeed with the same bytes, and the store's output object was written once."""
    import boto3

    from k6vsr_core.media.sample import make_sample_clip

    clip = make_sample_clip(tmp_path / "square.mp4", width=64, height=64, num_frames=1)
    name = bucket.removeprefix("s3://").split("/")[0]
    s3 = boto3.client("s3")
    s3.put_bucket_versioning(Bucket=name, VersioningConfiguration={"Status": "Enabled"})
    with ThreadPoolExecutor(max_workers=2) as pool:
        runs = list(pool.map(lambda out: _run(clip, tmp_path / out, tiny_bundle_path, bucket), ("a.mp4", "b.mp4")))
    assert runs[0].run_key == runs[1].run_key
    assert (tmp_path / "a.mp4").read_bytes() == (tmp_path / "b.mp4").read_bytes()
    output = f"store/runs/{runs[0].run_key}/output.mp4"
    versions = s3.list_object_versions(Bucket=name, Prefix=output).get("Versions", [])
    assert len(versions) == 1 and RunStore(bucket, runs[0].run_key).output_done()
    assert RunStore(bucket, runs[0].run_key).output_path.read_bytes() == (tmp_path / "a.mp4").read_bytes()


# --------------------------------------------------------------------------------------------------- workers

# Loaded by each Dask worker at start (`--preload`): every path the worker opens for writing, renames or copies to,
# or makes a folder of, one line each in its own audit log (Python's audit hooks see every such call it makes).
AUDIT = """\
import os
import sys

_LOG = open(os.path.join(os.environ["K6VSR_AUDIT_DIR"], "audit-%d.log" % os.getpid()), "a", buffering=1)
_WRITES = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


def _note(path):
    if isinstance(path, (str, bytes, os.PathLike)):
        _LOG.write(os.path.abspath(os.fsdecode(path)) + "\\n")


def _hook(event, args):
    if event == "open":
        path, mode, flags = args
        if (isinstance(mode, str) and any(c in mode for c in "wax+")) or (mode is None and flags & _WRITES):
            _note(path)
    elif event in ("os.rename", "os.replace", "shutil.copyfile"):
        _note(args[1])
    elif event == "os.mkdir":
        _note(args[0])


sys.addaudithook(_hook)
"""

# Appended to the preload of workers told to die mid-tile: the first worker (of all) to store a decoded tile kills
# itself by SIGKILL after the tile's chunk is written and before its record. The workers agree on which one through a
# conditional write of the marker object, which holds the records there were at that moment: the finished work.
KILL_MID_TILE = """\
import json
import signal

from storage.location import location
from storage.records import RecordBook

# Dask may run a preload file more than once in one process: wrap the plain method only.
_plain_write = getattr(RecordBook.write, "plain", RecordBook.write)


def _write_or_die(self, stage, item, *args, **kwargs):
    if stage == "decode":
        finished = {
            name: {done: record.model_dump() for done in self.items(name) if (record := self.read(name, done))}
            for name in self.root.names("")
        }
        if location(os.environ["K6VSR_KILL_MARK"]).create(json.dumps(finished).encode()):
            os.kill(os.getpid(), signal.SIGKILL)
    return _plain_write(self, stage, item, *args, **kwargs)


_write_or_die.plain = _plain_write
RecordBook.write = _write_or_die
"""


def _dask_worker(address: str, folder: Path, preload: Path, kill_mark: str) -> subprocess.Popen:
    """A `dask worker` process whose working folder, temporary folder, home and caches are all under `folder`."""
    for name in ("tmp", "home", "cache", "dask"):
        (folder / name).mkdir(parents=True)
    # Another host's environment: none of the caches torch pointed this process at (it exports their paths).
    inherited = {key: value for key, value in os.environ.items() if not key.startswith(("TORCHINDUCTOR_", "TRITON_"))}
    env = {
        **inherited,
        "TMPDIR": str(folder / "tmp"),
        "HOME": str(folder / "home"),
        "XDG_CACHE_HOME": str(folder / "cache"),
        "PREFECT_HOME": str(folder / "home" / ".prefect"),
        "PYTHONDONTWRITEBYTECODE": "1",
        "K6VSR_AUDIT_DIR": str(folder),
        "K6VSR_KILL_MARK": kill_mark,
    }
    argv = [sys.executable, "-m", "distributed.cli.dask_worker", address, "--nthreads", "1", "--no-nanny"]
    argv += ["--local-directory", str(folder / "dask"), "--preload", str(preload)]
    return subprocess.Popen(argv, cwd=folder, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _timeline(run: str) -> list[tuple[str, str]]:
    """(stage, item) of every line of a run's timeline in an object store: one per item computed, by any attempt."""
    folder = location(run) / "timeline"
    lines = [json.loads((folder / name).read_bytes()) for name in folder.names(".json")]
    return sorted((line["stage"], line["item"]) for line in lines)


def test_workers_killed_mid_tile_read_the_source_from_the_store_and_write_only_in_their_own_folders(
    prefect_server: str,
    bucket: str,
    tiny_bundle_path: Path,
    clip_1f: Path,
    reference: bytes,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two Dask worker processes with folders of their own run every tile, blend and segment of a run whose store is
    in the bucket. The source is moved away once ingest has read it, so a worker that opened the client's path would
    fail; the workers' writes all land in their own folders, and the client's folder holds only its clip and the
    output.

    The first worker to store a decoded tile dies by SIGKILL before the tile's record (nobody restarts it): Dask
    reruns that decode on the other worker, within the same flow run, which writes the local store's bytes. Nothing
    finished was computed again: the timeline holds one line per (stage, item), and every record there was at the
    kill is the one written then."""
    from distributed import Client, LocalCluster
    from prefect import task

    import tasks.ingest as ingest_tasks
    from flows.orchestrate import run_clip, tile_runner

    client_dir, workers_dir = tmp_path / "client", tmp_path / "workers"
    client_dir.mkdir()
    workers_dir.mkdir()
    clip, hidden = client_dir / "clip.mp4", client_dir / "moved-away.mp4"
    shutil.copyfile(clip_1f, clip)
    original = ingest_tasks.ingest

    @task(name="ingest")
    def ingest_then_move_the_source(prepared, attempt):
        result = original.fn(prepared, attempt)
        Path(prepared.source).rename(hidden)
        return result

    monkeypatch.setattr(ingest_tasks, "ingest", ingest_then_move_the_source)
    monkeypatch.chdir(client_dir)
    preload = workers_dir / "k6vsr_audit.py"
    preload.write_text(AUDIT + KILL_MID_TILE)
    kill_mark = bucket.rsplit("/", 1)[0] + "/killed-mid-tile.json"  # beside the store, not in it
    model = ModelSpec(model=str(tiny_bundle_path), device="cpu")
    scheduler = {"protocol": "tcp", "host": "127.0.0.1", "dashboard_address": None}  # in this process, on loopback
    with LocalCluster(n_workers=0, processes=False, **scheduler) as cluster:
        folders = [workers_dir / f"w{i}" for i in range(2)]
        workers = [_dask_worker(cluster.scheduler_address, folder, preload, kill_mark) for folder in folders]
        try:
            with Client(cluster.scheduler_address) as client:
                client.wait_for_workers(2, timeout=120)
                prepared = prepare_run(clip, PARAMS, model, bucket)
                runner = tile_runner(model, prepared, dask_address=cluster.scheduler_address)
                summary = run_clip(prepared, str(client_dir / "out.mp4"), model, runner).summary()
                survivors = client.run(os.getpid)
        finally:
            exits = [worker.poll() for worker in workers]
            for worker in workers:
                worker.kill()
                worker.wait(timeout=30)
    assert sorted(exits, key=str) == [-signal.SIGKILL, None] and len(survivors) == 1
    assert summary.tiles_computed == 6
    assert (client_dir / "out.mp4").read_bytes() == reference
    assert sorted(p.name for p in client_dir.iterdir()) == ["moved-away.mp4", "out.mp4"]

    store = RunStore(bucket, summary.run_key)
    finished = json.loads(location(kill_mark).read_bytes())
    assert len(finished["denoise"]) >= 1 and "decode" not in finished  # killed at its first decoded tile
    assert {(stage, item): record for stage in finished for item, record in finished[stage].items()} == {
        (stage, item): store.records.read(stage, item).model_dump() for stage in finished for item in finished[stage]
    }  # not one of them written again
    computed = _timeline(summary.store)
    assert len(computed) == len(set(computed)) and ("decode", "0-5") in computed
    stages = {"ingest", "encode", "denoise", "decode", "blend", "segment", "mux", "quality"}
    assert {stage for stage, _ in computed} == stages

    sources = []
    for folder in folders:
        for log in folder.glob("audit-*.log"):
            for line in log.read_text().splitlines():
                written = Path(line)
                assert written.is_relative_to(folder) or line.startswith(("/dev/", "/proc/")), line
                sources += [written] if written.parent.name == "k6vsr-sources" else []
    assert sources  # the workers read the source from the store's copy
