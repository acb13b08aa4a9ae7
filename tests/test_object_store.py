"""The run store in an S3 bucket: a real S3 endpoint (moto's server) on loopback, started here, a bucket per test.

The clip flow with its store in the bucket writes the bytes of the in-memory runner, resumes a failed run from the
bucket without recomputing anything finished, and treats a record whose checksum does not match as not done.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import fault_harness
import numpy as np
import procs
import pytest

from k6vsr_core import UpscaleParams, upscale
from k6vsr_core.bundle import ModelBundle
from service.runs import ModelSpec, prepare_run
from storage import RunStore, StoreUnreachable, collect_garbage, default_store_root
from storage.location import location

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


@pytest.fixture(scope="module")
def reference(tiny_bundle: ModelBundle, clip_1f: Path, tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """The in-memory runner's output, which a local store's run writes byte for byte (tests/test_flow.py)."""
    out = tmp_path_factory.mktemp("reference") / "ref.mp4"
    upscale(clip_1f, out, tiny_bundle, PARAMS)
    return out.read_bytes()


def _run(clip: Path, out: Path, bundle_path: Path, store: str):
    from flows.orchestrate import run_clip

    model = ModelSpec(model=str(bundle_path), device="cpu")
    return run_clip(prepare_run(clip, PARAMS, model, store), str(out), model)


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
    assert store.records.items("denoise") == ["0-0", "0-1", "1-0"] and store.tiles_computed("a") == 3
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
    from k6vsr_core import stages
    from k6vsr_core.errors import UserFacingError

    plain, decoded = stages.decode_tile, []

    def decode_tile(bundle, latent):
        decoded.append(latent.shape)
        if len(decoded) == 4:
            raise UserFacingError("a permanent fault in one tile")  # permanent: not retried
        return plain(bundle, latent)

    monkeypatch.setattr(stages, "decode_tile", decode_tile)
    monkeypatch.chdir(tmp_path)  # a store URL read as a folder would land here
    with pytest.raises(TileFailure, match="1 of 6 tiles failed"):
        _run(clip_1f, tmp_path / "a.mp4", tiny_bundle_path, bucket)
    assert len(decoded) == 6 and not (tmp_path / "a.mp4").exists()

    decoded.clear()
    first = _run(clip_1f, tmp_path / "a.mp4", tiny_bundle_path, bucket)
    assert (tmp_path / "a.mp4").read_bytes() == reference
    assert len(decoded) == 1 and (first.tiles_computed, first.dit_calls) == (0, 0)  # denoised on the failed run
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
    from k6vsr_core import stages

    plain, stopped = stages.decode_tile, threading.Event()

    def decode_tile(bundle, latent):
        if not stopped.is_set():  # at the first decode: some tiles are denoised and stored, perhaps not all
            stopped.set()
            s3_endpoint.stop()
        return plain(bundle, latent)

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
    assert again.tiles_computed == again.tiles_total - denoised and again.dit_calls == 2 * again.tiles_computed


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
    assert len(store.records.items("decode")) == 1 and not (tmp_path / "x.mp4").exists()

    rerun = procs.run(fault_harness.command(*argv))
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    summary = json.loads(rerun.stdout)
    assert (tmp_path / "x.mp4").read_bytes() == reference
    assert {key: store.attempt_of(*key) for key in finished} == finished  # nothing finished was written again
    assert summary["tiles_reused"] == sum(stage == "denoise" for stage, _ in finished) >= 1
    assert summary["dit_calls"] == 2 * summary["tiles_computed"]
