"""The store's checks on read: a damaged chunk or completion record reads as not done, with a warning naming it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from storage import RunStore
from storage.records import CompletionRecord

VALUE = np.arange(24, dtype=np.float32).reshape(2, 3, 4)


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "k6vsr.store"]


@pytest.fixture
def store(tmp_path: Path) -> RunStore:
    store = RunStore(tmp_path, "k")
    store.put_tile("tile_latents", (0, 1), (2, 3), VALUE, stage="denoise", seconds=0.5, attempt="a")
    return store


def _chunk_file(store: RunStore) -> Path:
    (chunk,) = [p for p in (store.path / "data.zarr" / "tile_latents" / "c" / "0" / "1").rglob("*") if p.is_file()]
    return chunk


@pytest.mark.parametrize("damage", ["truncated", "flipped"])
def test_a_damaged_chunk_is_not_done_and_named(store: RunStore, damage: str, caplog: pytest.LogCaptureFixture) -> None:
    chunk = _chunk_file(store)
    data = bytearray(chunk.read_bytes())
    if damage == "truncated":
        del data[len(data) // 2 :]
    else:
        data[7] ^= 0x10
    chunk.write_bytes(bytes(data))
    with caplog.at_level("WARNING", logger="k6vsr.store"):
        assert store.get_tile("tile_latents", (0, 1), stage="denoise") is None
    (warning,) = _warnings(caplog)
    assert warning.startswith(f"{store.path / 'data.zarr' / 'tile_latents' / 'c' / '0' / '1'}: ")
    assert "denoise 0-1" in warning and "computing it again" in warning


@pytest.mark.parametrize("damage", ["truncated", "flipped"])
def test_a_damaged_record_is_not_done_and_named(store: RunStore, damage: str, caplog: pytest.LogCaptureFixture) -> None:
    path = store.records.path("denoise", "0-1")
    data = bytearray(path.read_bytes())
    if damage == "truncated":
        del data[len(data) // 2 :]
    else:
        # One bit of a digit of `seconds`: still a valid record, whose seal no longer matches.
        at = data.index(b'"seconds": 0.5') + len(b'"seconds": 0.')
        data[at] ^= 0x01
        assert json.loads(data)["seconds"] == 0.4
    path.write_bytes(bytes(data))
    with caplog.at_level("WARNING", logger="k6vsr.store"):
        assert store.records.read("denoise", "0-1") is None
        assert not store.tile_done("tile_latents", (0, 1), stage="denoise")
    assert any(w.startswith(f"{path}: the completion record of denoise 0-1 is damaged") for w in _warnings(caplog))


def test_a_record_moved_to_another_item_is_not_taken_for_it(store: RunStore, caplog: pytest.LogCaptureFixture) -> None:
    other = store.records.path("denoise", "0-2")
    other.write_bytes(store.records.path("denoise", "0-1").read_bytes())
    with caplog.at_level("WARNING", logger="k6vsr.store"):
        assert store.records.read("denoise", "0-2") is None
    assert len(_warnings(caplog)) == 1


def test_records_of_older_stores_without_a_seal_are_read(store: RunStore, caplog: pytest.LogCaptureFixture) -> None:
    path = store.records.path("denoise", "0-1")
    payload = json.loads(path.read_bytes())
    assert payload.pop("seal")
    path.write_text(json.dumps(payload))
    with caplog.at_level("WARNING", logger="k6vsr.store"):
        assert np.array_equal(store.get_tile("tile_latents", (0, 1), stage="denoise"), VALUE)
    assert _warnings(caplog) == []
    assert CompletionRecord.model_validate(payload).intact()


def test_missing_records_and_deleted_windows_are_not_warned_of(
    store: RunStore, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level("WARNING", logger="k6vsr.store"):
        assert store.records.read("denoise", "5-0") is None
        store.drop_window(["tile_latents"], 0)
        assert store.get_tile("tile_latents", (0, 1), stage="denoise") is None
        assert store.records.read("denoise", "0-1") is not None
    assert _warnings(caplog) == []


def test_a_damaged_whole_array_and_file_are_named(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = RunStore(tmp_path, "k")
    store.put("frame_pts", np.arange(5, dtype=np.int64), stage="ingest")
    (chunk,) = [p for p in (store.path / "data.zarr" / "frame_pts" / "c").rglob("*") if p.is_file()]
    chunk.write_bytes(chunk.read_bytes()[:-3])
    segment = store.segment_path(0).local()
    tmp = store.temp_file(store.segment_path(0), ".mp4")
    tmp.write_bytes(b"segment bytes")
    store.commit_file(tmp, store.segment_path(0), "segment", "0")
    segment.write_bytes(b"segment bytez")
    with caplog.at_level("WARNING", logger="k6vsr.store"):
        assert store.get("frame_pts", stage="ingest") is None
        assert not store.segment_done(0)
    first, second = _warnings(caplog)
    assert first.startswith(f"{store.path / 'data.zarr' / 'frame_pts' / 'c'}: the stored frame_pts of ingest all")
    assert second == f"{segment}: segment 0 does not match its checksum; computing it again"
