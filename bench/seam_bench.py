"""How visible are the joins between windows? Frame-to-frame change at the joins against inside the windows.

    python bench/seam_bench.py [--bundle DIR] [--frames 250] [--overlap 16] [--size 64] [--out FILE]

Renders every window of a synthetic clip (moving shapes) with the stage functions the runner uses, then joins them
two ways: as k6vsr does (raised-cosine cross-fade over the overlap) and by a hard cut at the start of each segment.
For each, the mean absolute change between consecutive output frames is measured; a join is invisible when the
change across it is no larger than the change between frames inside a window. Reported: the median change inside
windows, the largest change at a join, and their ratio ("join jump"), for both ways of joining.

Without `--bundle` it runs the tiny random bundle on the CPU (minutes); the joins' mechanics, not the model's
quality, are what a random bundle measures. With the released weights on a GPU it measures the model.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from k6vsr_core import UpscaleParams  # noqa: E402
from k6vsr_core.contract.windows import segment_frames, segment_range  # noqa: E402
from k6vsr_core.media.sample import make_sample_clip  # noqa: E402
from k6vsr_core.model import stages  # noqa: E402
from k6vsr_core.model.bundle import load_bundle, model_traits  # noqa: E402
from k6vsr_core.model.runner import read_source, read_window  # noqa: E402
from k6vsr_core.model.tiny_bundle import make_tiny_bundle  # noqa: E402


def render_windows(
    source: Path, bundle: object, params: UpscaleParams, independent_noise: bool = False
) -> tuple[object, list[np.ndarray]]:
    """Every window's delivered frames; with `independent_noise`, each window draws other noise (the alternative
    policy: seed + 1000 x window + first tile) instead of k6vsr's same noise in every window."""
    clip = read_source(source, params, model_traits(bundle.info))  # type: ignore[attr-defined]
    plan = clip.plan
    renders = []
    for window in plan.windows:
        latent = stages.encode_clip(bundle, stages.prepare_window(read_window(clip, window), plan, window))
        tiles = []
        for chunk in plan.chunks:
            if independent_noise:
                chunk = chunk.model_copy(update={"seed": chunk.seed + 1000 * window.index})
            denoised = stages.denoise_chunk(bundle, stages.cut_tiles(latent, plan, chunk.tiles), chunk, plan)
            tiles += [
                (tile, stages.decode_tile(bundle, value)) for tile, value in zip(chunk.tiles, denoised, strict=True)
            ]
        renders.append(stages.tensor_to_frames(stages.deliver(stages.blend(plan, tiles, window), plan)))
    return plan, renders


def _repeat_first_frame(source: Path, path: Path, frames: int) -> Path:
    """A clip of `frames` copies of `source`'s first frame (losslessly the same picture in every frame)."""
    import av

    from k6vsr_core import media

    picture = media.read_frames(source, [0])[0]
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264rgb", rate=24, options={"qp": "0"})
        stream.width, stream.height, stream.pix_fmt = picture.shape[1], picture.shape[0], "rgb24"
        for _ in range(frames):
            container.mux(stream.encode(av.VideoFrame.from_ndarray(picture, format="rgb24")))
        container.mux(stream.encode(None))
    return path


def changes(frames: np.ndarray) -> np.ndarray:
    """Mean absolute change from each frame to the next, in 8-bit levels."""
    return np.abs(np.diff(frames.astype(np.int16), axis=0)).mean(axis=(1, 2, 3))


def join_report(plan: object, video: np.ndarray) -> dict[str, float]:
    step = changes(video)
    joins = [segment_range(plan.windows, i)[0] - 1 for i in range(1, plan.num_windows)]  # type: ignore[attr-defined]
    inside = np.delete(step, joins)
    worst = float(max(step[j] for j in joins)) if joins else 0.0
    median = float(np.median(inside))
    jump = round(worst / median, 2) if median else (0.0 if worst == 0 else float("inf"))
    return {"inside_median": round(median, 3), "worst_join": round(worst, 3), "join_jump": jump}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bundle", type=Path)
    parser.add_argument("--frames", type=int, default=250)
    parser.add_argument("--overlap", type=int, default=16)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--static", action="store_true", help="a clip whose every frame is the same picture")
    parser.add_argument("--independent-noise", action="store_true", help="other noise in every window")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        path = args.bundle or make_tiny_bundle(Path(folder) / "tiny")
        bundle = load_bundle(str(path))
        source = make_sample_clip(
            Path(folder) / "clip.mp4", width=args.size, height=args.size, num_frames=1 if args.static else args.frames
        )
        if args.static:
            source = _repeat_first_frame(source, Path(folder) / "static.mp4", args.frames)
        params = UpscaleParams(scale=2, window_overlap=args.overlap)
        plan, renders = render_windows(source, bundle, params, args.independent_noise)
    faded = np.concatenate(
        [segment_frames(plan.windows, i, renders[i], renders[i - 1] if i else None) for i in range(plan.num_windows)]
    )
    cut = np.concatenate(
        [renders[i][: segment_range(plan.windows, i)[1] - w.start] for i, w in enumerate(plan.windows)]
    )
    report = {
        "frames": args.frames,
        "overlap": args.overlap,
        "static": args.static,
        "noise": "independent per window" if args.independent_noise else "the same in every window (k6vsr)",
        "windows": [[w.start, w.stop] for w in plan.windows],
        "cross_fade": join_report(plan, faded),
        "hard_cut": join_report(plan, cut),
    }
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
