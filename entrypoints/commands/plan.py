"""`k6vsr plan`: what a run would do, without loading a model."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from entrypoints.command_inputs import local_input, model_from, store_from
from entrypoints.request_inputs import input_from, params_from
from k6vsr_core.contract.stage_names import Stage
from k6vsr_core.contract.windows import WINDOW_FRAMES, plan_shots
from k6vsr_core.model.bundle import weights_present
from service.runs import prepare_run
from storage.estimate import run_estimate, store_estimate


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Its request was checked (`entrypoints.request_inputs.check_request`) before this module was imported."""
    with local_input(args) as (local, url):
        planned = _plan(local)
    return {**planned, "source": url} if url else planned


def _plan(args: argparse.Namespace) -> dict[str, Any]:
    source, latent_fps = input_from(args)
    # From the model's configs alone: a plan loads no model, so it needs no weight files (nor their download).
    prepared = prepare_run(source, params_from(args), model_from(args), store_from(args), latent_fps, weights=False)
    plan = prepared.plan
    grid = plan.grid
    return {
        "source": prepared.source,
        **_source_facts(prepared),
        "frames_kept": plan.num_frames,
        "fps": plan.fps,
        "interlacing": plan.interlacing(),
        "timing": plan.frame_timing(),
        "output_format": plan.output_format(),
        "window_mode": plan.params.windows,
        "cuts": list(plan.cuts),
        "windows": _windows_of(plan),
        "shots": _shots_of(plan),
        "tiles_per_window": plan.num_tiles,
        "items": progress_of(prepared),
        "store_estimate": store_estimate(plan).model_dump(),
        "run_estimate": _run_estimate(prepared),
        "padding": {"bottom": grid.padding[0], "right": grid.padding[1]},
        "tile": {"base": list(grid.base), "lr": list(grid.tile), "tops": list(grid.tops), "lefts": list(grid.lefts)},
        "tiles": plan.num_tiles,
        "chunks": [{"tiles": list(c.tiles), "seed": c.seed} for c in plan.chunks],
        "dit_steps_per_tile": plan.steps,
        "sr_size": {"width": plan.sr_size[1], "height": plan.sr_size[0]},
        "output_size": {"width": plan.delivery_size[1], "height": plan.delivery_size[0]},
        "aspect": plan.aspect(),
        "model": prepared.model_info.identity,
        "model_weights_present": weights_present(Path(prepared.model_info.path)),
        "run_key": prepared.run.run_key,
        "finished_run_exists": prepared.finished,
    }


def _windows_of(plan: Any) -> list[dict[str, Any]]:
    return [
        {
            "window": w.index,
            "frames": [w.start, w.stop],
            "computed_as": w.padded,
            "overlap_before": plan.windows[w.index - 1].stop - w.start if w.index else 0,
            "segment": list(plan.segment_range(w.index)),
            "seeds": [c.seed for c in plan.chunks],
        }
        for w in plan.windows
    ]


def _shots_of(plan: Any) -> list[dict[str, Any]]:
    """What happens to each shot: a shot shorter than a window is one window of its own, padded as a short clip is
    (`computed_as` frames, cropped back); every shot meets the next at a hard cut, never a cross-fade."""
    shots = []
    for shot in plan_shots(plan.windows, plan.cuts):
        short = shot.frames < WINDOW_FRAMES
        shots.append(
            {
                "shot": shot.index,
                "frames": [shot.start, shot.stop],
                "windows": list(shot.windows),
                "short": short,
                "computed_as": plan.windows[shot.windows[0]].padded if short else None,
                "joined_by": None if shot.index == 0 else "hard cut",
            }
        )
    return shots


def _run_estimate(prepared: Any) -> dict[str, Any] | None:
    """The whole run's time and disk from the rates a preview of this run measured (`k6vsr preview`); None
    without one."""
    estimate = run_estimate(prepared.run.open(), prepared.plan)
    return None if estimate is None else estimate.model_dump()


def _source_facts(prepared: Any) -> dict[str, Any]:
    """What the input is: a video's probe, or a latent's pixel size, frames and rate (as its plan reads them)."""
    if prepared.probe is None:
        plan = prepared.plan
        return {
            "source_size": {"width": plan.source_size[1], "height": plan.source_size[0]},
            "source_frames": plan.source_frames,
            "source_fps": plan.source_fps,
            "latent_fps": prepared.latent_fps,
        }
    probe = prepared.probe
    return {
        "source_size": {"width": probe.width, "height": probe.height},
        "source_frames": probe.num_frames,
        "source_fps": probe.fps,
        "source_colour": f"{probe.colour.describe()}, {probe.bit_depth}-bit",
    }


def progress_of(prepared: Any) -> dict[str, int]:
    """The (window, tile) items a run of this plan has already finished, from the run store."""
    plan = prepared.plan
    store = prepared.run.open()
    return {
        "total": plan.num_windows * plan.num_tiles,
        "denoised": len(store.records.items(Stage.DENOISE)),
        "decoded": store.tiles_decoded(),
        "windows_blended": len(store.records.items(Stage.BLEND)),
        "segments": len(store.records.items(Stage.SEGMENT)),
        "output": int(store.output_done()),
    }
