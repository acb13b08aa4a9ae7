"""`k6vsr demo`: the whole pipeline on a synthetic clip with a tiny random model, for machines without the weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from entrypoints.progress_bars import run_progress
from flows.orchestrate import prefect_api, run_clip
from k6vsr_core.contract.params import UpscaleParams, output_name
from k6vsr_core.media.sample import make_sample_clip
from k6vsr_core.model.tiny_bundle import make_tiny_bundle
from service.runs import ModelSpec, prepare_run

NOTE = (
    "The model weights are RANDOM (a tiny stand-in bundle): the output is noise-like. Every stage ran as it does "
    "with the real model; pass --model to `k6vsr upscale` to use the released weights."
)


def next_step(bundle: Path) -> str:
    """The demo's closing line: its tiny model is what every other command runs on a machine without a GPU or the
    hub (the default model is the released checkpoint, gigabytes fetched from the hub)."""
    return (
        f"next: without a GPU or the hub, give any command the demo's tiny model, e.g. "
        f"`k6vsr upscale CLIP --model {bundle} --device cpu` (random weights: noise-like output)"
    )


def run_demo(out_dir: Path, params: UpscaleParams, quiet: bool = False) -> dict[str, Any]:
    out_dir.mkdir(parents=True, exist_ok=True)
    bundle = out_dir / "tiny-bundle"
    if not (bundle / "model_index.json").is_file():
        make_tiny_bundle(bundle)
    clip = out_dir / "sample.mp4"
    if not clip.is_file():
        # 9 frames at 24 fps with a tone: the smallest clip with real motion, decoded fast on a CPU.
        make_sample_clip(clip, width=128, height=96, num_frames=9, fps=24, audio=True)
    if not quiet:
        print(NOTE)
    model = ModelSpec(model=str(bundle), device="cpu")
    prepared = prepare_run(clip, params, model, out_dir / "store")
    # The local server first (10-30 s, said by a line of its own): a bar shown while it starts said `ingest`.
    with prefect_api(), run_progress(prepared, enabled=not quiet):
        summary = run_clip(prepared, str(out_dir / output_name(clip, params)), model).summary()
    return {**summary.model_dump(mode="json"), "note": NOTE, "next": next_step(bundle)}
