"""`k6vsr demo`: what its terminal shows, in order."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

from entrypoints import demo
from k6vsr_core import UpscaleParams


def test_the_demo_starts_the_server_before_its_bar(tmp_path: Path, monkeypatch) -> None:
    """The bar would say `ingest` for the 10-30 s the local server takes to start: it shows once the server is up."""
    entered: list[str] = []

    def context(name: str):
        @contextmanager
        def enter(*args, **kwargs):
            entered.append(name)
            yield

        return enter

    class Summary:
        def model_dump(self, mode: str) -> dict:
            return {}

        def summary(self) -> Summary:  # the ended run's (`ClipRun.summary`)
            return self

    monkeypatch.setattr(demo, "prefect_api", context("server"))
    monkeypatch.setattr(demo, "run_progress", context("bar"))
    monkeypatch.setattr(demo, "run_clip", lambda *args, **kwargs: entered.append("run") or Summary())
    monkeypatch.setattr(demo, "prepare_run", lambda *args, **kwargs: None)
    monkeypatch.setattr(demo, "make_tiny_bundle", lambda path: None)
    monkeypatch.setattr(demo, "make_sample_clip", lambda path, **kwargs: None)
    demo.run_demo(tmp_path, UpscaleParams(scale=2), quiet=True)
    assert entered == ["server", "bar", "run"]
