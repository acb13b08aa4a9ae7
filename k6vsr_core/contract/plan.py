"""The plan of one clip: everything a run will do, decided before any model work.

A plan is pure data computed from the source's size, frame count and rate, the request and the model's trained
tile sizes and sampler: which frames are kept (the 24-fps rule), the time windows they are computed in, the tile
grid every window shares and the seeds. The in-memory runner, the orchestrated flow, `k6vsr plan` and the run
manifest all use the same plan, which is what makes their outputs comparable byte for byte.
"""

from __future__ import annotations

import warnings
from fractions import Fraction
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict

from k6vsr_core import media
from k6vsr_core.contract.params import UpscaleParams
from k6vsr_core.contract.scenes import source_cuts
from k6vsr_core.contract.tiling import (
    RESOLUTIONS,
    Size,
    TileGrid,
    pre_upscale_size,
    target_size,
    tile_chunks,
    tile_grid,
)
from k6vsr_core.contract.windows import Window, plan_scene_windows, plan_windows, segment_range
from k6vsr_core.errors import ParameterError
from k6vsr_core.media.encoding import VideoEncoding
from k6vsr_core.media.fields import bwdif_args

TEMPORAL_FACTOR = 4
BWDIF_MIN_SIDE = 3  # bwdif refuses smaller frames


class ModelTraits(BaseModel):
    """What the plan needs to know of the model, without loading it."""

    model_config = ConfigDict(frozen=True)

    tile_sizes: tuple[tuple[int, int], ...] = RESOLUTIONS
    scheduler: str = "PiflowScheduler"
    trained_steps: int = 2


class TileChunk(BaseModel):
    model_config = ConfigDict(frozen=True)

    index: int
    tiles: tuple[int, ...]
    seed: int  # request seed + the chunk's first tile index (official seeding), in every window


class ClipPlan(BaseModel):
    model_config = ConfigDict(frozen=True)

    source_size: Size  # (H, W) of the decoded source frames
    source_frames: int  # frames in the source
    source_fps: float
    num_frames: int  # kept frames: the output's length
    fps: int  # the output's rate, rounded (exact unless `fps_mode='source'` keeps a fractional one)
    source_rate: str | None = None  # with `fps_mode='source'`: the exact rate written, e.g. "30000/1001"
    # The source's non-square pixels' shape (SAR), e.g. "16/15"; None where they are square.
    source_aspect: str | None = None
    # What the source says and shows of its fields (None: not looked at, e.g. a latent), and the field order its
    # frames are deinterlaced with before the model (None: read as they are).
    fields: media.FieldInfo | None = None
    deinterlace: media.FieldOrder | None = None
    # The shape of the source's frame times (None: not read, e.g. a latent), and, for a variable rate, the source
    # frames kept, chosen on their timestamps (`media.frames_on_times`); None: kept by the 24-fps rule's indices.
    timing: media.FrameTiming | None = None
    kept: tuple[int, ...] | None = None
    # With `fps_mode='source'` on a variable rate: every kept frame's own time, written as it is (`clock`).
    timeline: media.Timeline | None = None
    windows: tuple[Window, ...]
    # With `windows='scenes'`: the kept frames that start a shot (k6vsr_core.contract.scenes); no window spans one.
    cuts: tuple[int, ...] = ()
    # Scene windows planned before the cuts were looked for (an archive's plan: the cuts are found as its clip is
    # ingested, beside an earlier clip's model work); ingest plans the clip again with them.
    cuts_pending: bool = False
    # Frames the longest window computes (1 + 8k; the one window of a short clip, or a short shot's, is padded to it)
    window_frames: int
    latent_frames: int  # latent frames of the longest window
    params: UpscaleParams
    steps: int
    grid: TileGrid
    chunks: tuple[TileChunk, ...]
    sr_size: Size  # (H, W) after blending and cropping
    delivery_size: Size  # (H, W) of the written video
    # The tags the output is written with: the source's where the path carries them faithfully (media.output_colour)
    colour: media.ColourTags = media.BT709_TV
    # Bits a sample of every stage's frames, from the source's decode to the encoder: 16 (uint16) for a source of more
    # than 8 bits to an output of more than 8, else 8 (`k6vsr_core.contract.source.pixel_path`); and the source's
    # HDR metadata, written with the output.
    depth: Literal[8, 16] = 8
    hdr: media.HdrMetadata | None = None

    @property
    def encoding(self) -> VideoEncoding:
        """How the output is encoded: the request's encoding, in its codec's 10-bit pixel format on the 16-bit path
        where the request left the format to the default (`VideoEncoding.for_deep_source`)."""
        encoding = self.params.encoding
        return encoding.for_deep_source() if self.depth == 16 else encoding

    @property
    def frame_rate(self) -> int | Fraction:
        """The rate the output plays at, exact."""
        if self.source_rate is None:
            return self.fps
        rate = Fraction(self.source_rate)
        return rate.numerator if rate.denominator == 1 else rate

    @property
    def clock(self) -> media.FrameRate:
        """What the writers time the output's frames by: the frames' own times where kept, else the rate."""
        return self.timeline if self.timeline is not None else self.frame_rate

    @property
    def sample_aspect(self) -> Fraction | None:
        """The output's pixel shape (SAR): the source's display aspect ratio kept over the delivered size, so a 4:3
        source with non-square pixels plays 4:3 again, its pixels as the model made them (not resampled to square);
        None where the source's pixels are square (nothing is written, as before)."""
        if self.source_aspect is None:
            return None
        (src_h, src_w), (out_h, out_w) = self.source_size, self.delivery_size
        display = Fraction(self.source_aspect) * src_w / src_h
        # H.264's and HEVC's headers hold each term in 16 bits.
        sar = (display * out_h / out_w).limit_denominator(65535)
        return None if sar == 1 else sar

    def aspect(self) -> dict[str, object]:
        """The source's and the output's pixel shape and display aspect ratio, for `k6vsr plan`."""
        src_h, src_w = self.source_size
        out_h, out_w = self.delivery_size
        source_sar = Fraction(self.source_aspect or 1)
        sar = self.sample_aspect or Fraction(1)
        return {
            "source_sample_aspect": str(source_sar),
            "source_display_aspect": str(source_sar * src_w / src_h),
            "sample_aspect": str(sar),
            "display_aspect": str(sar * out_w / out_h),
            "pixels": "square" if sar == 1 else "non-square, as the source's: the ratio is written, not resampled",
        }

    def interlacing(self) -> dict[str, object] | None:
        """What `k6vsr plan` says of the source's fields and what is done with them; None when not looked at."""
        if self.fields is None:
            return None
        found = self.fields
        return {
            "interlaced": found.order is not None,
            "field_order": found.order,
            "found_by": found.found_by,
            "stream": found.stream,
            "picture": {
                "analysed": found.analysed,
                "tff": found.picture_tff,
                "bff": found.picture_bff,
                "progressive": found.picture_progressive,
                "undetermined": found.picture_undetermined,
            },
            "deinterlace": self.params.deinterlace,
            "filter": None if self.deinterlace is None else f"bwdif={bwdif_args(self.deinterlace)}",
            "summary": found.describe(),
        }

    def frame_timing(self) -> dict[str, object] | None:
        """What `k6vsr plan` says of the source's frame times and how frames are kept; None when not read."""
        if self.timing is None:
            return None
        return {
            **self.timing.model_dump(),
            "kept_on_timestamps": self.kept is not None,
            "output_fps": self.fps if self.source_rate is None else self.source_rate,
            "times_kept": self.timeline is not None,
        }

    def output_format(self) -> dict[str, object]:
        """What the output file holds: codec, quality, pixel format, container, audio and exact rate."""
        return {
            **self.encoding.describe(),
            "audio": self.params.audio,
            "fps_mode": self.params.fps_mode,
            "frame_rate": str(self.frame_rate if self.timeline is None else round(float(self.timeline.mean_rate), 3)),
            "variable_rate": self.timeline is not None,
            "colour": (media.UNTAGGED if self.encoding.is_rgb else self.colour).describe(),
            "pixel_depth": self.depth,
            "hdr_metadata": None if self.hdr is None else self.hdr.describe(),
        }

    @property
    def num_tiles(self) -> int:
        return self.grid.num_tiles

    @property
    def num_windows(self) -> int:
        return len(self.windows)

    def chunk_of(self, tile: int) -> TileChunk:
        return next(chunk for chunk in self.chunks if tile in chunk.tiles)

    def source_indices(self, window: Window | None = None) -> list[int]:
        """The source frames kept (those of `window` only, if given): recomputed from the rule, so a plan stays small,
        except a variable rate's, chosen on timestamps the plan does not hold (`kept`)."""
        if self.kept is not None:
            return list(self.kept) if window is None else list(self.kept[window.start : window.stop])
        indices = select_kept_frames(self.source_frames, self.source_fps, self.params)[0]
        return indices if window is None else indices[window.start : window.stop]

    def segment_range(self, window: int) -> tuple[int, int]:
        return segment_range(self.windows, window)


def representative_windows(plan: ClipPlan, count: int) -> tuple[int, ...]:
    """`count` windows that show the clip: spread evenly over it, or, with scene cuts, the first window of each shot
    (spread evenly over the shots when there are more). Fewer when the plan has fewer windows."""
    if count < 1:
        raise ValueError(f"a preview needs at least one window, got {count}")
    starts = set(plan.cuts)
    candidates = [w.index for w in plan.windows if w.index == 0 or w.start in starts] if plan.cuts else []
    if len(candidates) < count:
        candidates = [w.index for w in plan.windows]
    if len(candidates) <= count:
        return tuple(candidates)
    if count == 1:
        return (candidates[len(candidates) // 2],)
    return tuple(sorted({candidates[round(i * (len(candidates) - 1) / (count - 1))] for i in range(count)}))


def select_kept_frames(source_frames: int, source_fps: float, params: UpscaleParams) -> tuple[list[int], int]:
    """The source frames a request keeps and their rate: every one (`all`, up to `max_frames`) or the contract's.

    With `fps_mode='source'` no frame is dropped to reach 24 fps: every source frame is kept (the contract's
    window still caps `frames='contract'` at the first 121, floored to 1 + 8k).
    """
    if params.fps_mode == "source":
        limit = source_frames if params.max_frames is None else min(source_frames, params.max_frames)
        if params.frames == "contract":
            limit = media.aligned_frame_count(min(source_frames, media.MAX_NUM_FRAMES))
        return list(range(limit)), max(1, round(source_fps))
    if params.frames == "contract":
        return media.select_frames(source_frames, source_fps)
    return media.select_all_frames(source_frames, source_fps, params.max_frames)


FrameTimes = tuple[np.ndarray, float]  # every frame's time in seconds from the first, and the stream's tick


def frames_on_timestamps(
    source_frames: int, params: UpscaleParams, frame_times: FrameTimes | None
) -> tuple[list[int], int, media.FrameTiming] | None:
    """For a variable-rate source: the frames kept, chosen on their timestamps, the constant rate they play at and the
    timing found; None for a constant rate (or unknown times), which the 24-fps rule's indices keep exactly.

    The rate is the contract's 24 fps for a source that averages near it or faster, else its rounded mean (no motion
    interpolation: slower sources keep their pace). None too under `fps_mode='source'`, which keeps every frame
    with its own time (`source_timeline`).
    """
    if frame_times is None:
        return None
    times, tick = frame_times
    times = times[:source_frames]  # the frames that decode, when fewer than the packets
    timing = media.timing_of(times, tick)
    if not timing.variable:
        return None
    if params.fps_mode == "source":
        return None
    near = timing.mean_fps > media.TARGET_FPS - media.RESAMPLE_FPS_TOLERANCE
    rate = media.TARGET_FPS if near else max(1, round(timing.mean_fps))
    cap = media.MAX_NUM_FRAMES if params.frames == "contract" else params.max_frames
    indices = media.frames_on_times(times, timing.duration_s, rate, cap)
    if params.frames == "contract":
        indices = indices[: media.aligned_frame_count(len(indices))]
    return indices, rate, timing


def source_timeline(num_frames: int, params: UpscaleParams, frame_times: FrameTimes | None) -> media.Timeline | None:
    """Under `fps_mode='source'`, a variable-rate source's first `num_frames` frames' own times, which the output
    keeps; None for a constant rate (written at its exact rate) or another mode."""
    if params.fps_mode != "source" or frame_times is None:
        return None
    times, tick = frame_times
    if not media.timing_of(times[:num_frames], tick).variable:
        return None
    return media.timeline_of(times, tick, num_frames)


def kept_frames(
    source_frames: int, source_fps: float, params: UpscaleParams, frame_times: FrameTimes | None = None
) -> tuple[list[int], int]:
    """The source frames a request keeps and their rate: on their timestamps for a variable rate, else by the rule
    (`select_kept_frames`)."""
    timed = frames_on_timestamps(source_frames, params, frame_times)
    return timed[:2] if timed is not None else select_kept_frames(source_frames, source_fps, params)


def scene_cuts(
    path: str, source_frames: int, source_fps: float, params: UpscaleParams, frame_times: FrameTimes | None = None
) -> tuple[int, ...]:
    """The scene cuts `make_plan` needs for `params`: detected in the kept frames of `path` with `windows='scenes'`
    (which decodes the whole source), none otherwise."""
    if params.windows != "scenes":
        return ()
    return source_cuts(path, kept_frames(source_frames, source_fps, params, frame_times)[0])


def deinterlace_order(params: UpscaleParams, fields: media.FieldInfo | None) -> media.FieldOrder | None:
    """The field order the request deinterlaces this source with: the source's own under `auto` (None when it is
    progressive), always one under `bwdif` (the stream's or the picture's, else top first), none under `off`.
    None when `fields` is (the source was not looked at: a latent has no fields)."""
    if params.deinterlace == "off" or fields is None:
        return None
    if fields.picture_disagrees:
        warnings.warn(
            f"the stream declares {fields.stream} fields but the picture shows the other order: deinterlaced as "
            "declared; check the source, or its flags, if the output judders",
            stacklevel=3,
        )
    if params.deinterlace == "auto" or fields.order is not None:
        return fields.order
    return "bff" if fields.picture_bff > fields.picture_tff else "tff"


def resolve_steps(params: UpscaleParams, traits: ModelTraits) -> int:
    """DiT evaluations per tile: the trained count for PiFlow (warns if asked otherwise), else as asked (4)."""
    if traits.scheduler == "PiflowScheduler":
        if params.num_inference_steps not in (None, traits.trained_steps):
            warnings.warn(
                f"num_inference_steps={params.num_inference_steps} is ignored: this distilled checkpoint runs the "
                f"{traits.trained_steps} PiFlow evaluations it was trained for",
                stacklevel=2,
            )
        return traits.trained_steps
    return params.num_inference_steps or 4


def make_plan(
    source_size: Size,
    source_frames: int,
    source_fps: float,
    params: UpscaleParams,
    traits: ModelTraits | None = None,
    source_rate: Fraction | str | None = None,
    cuts: tuple[int, ...] | None = (),
    colour: media.ColourTags = media.BT709_TV,
    source_aspect: Fraction | str | None = None,
    fields: media.FieldInfo | None = None,
    frame_times: FrameTimes | None = None,
    depth: Literal[8, 16] = 8,
    hdr: media.HdrMetadata | None = None,
) -> ClipPlan:
    """Plan a source of `source_frames` frames of `source_size` at `source_fps`; with `windows='scenes'`, its kept
    frames cut into shots before each of `cuts` (positions among the kept frames, `scene_cuts`); `cuts=None` when
    they are not looked for yet (the plan is then `cuts_pending`, its windows as if there were none); deinterlaced as
    `fields` (`media.probe_fields`) and the request say; a variable rate (`frame_times`, `media.frame_times`)
    resampled on its timestamps; its frames `depth` bits a sample, its output written with `hdr`
    (`k6vsr_core.contract.source.pixel_path`).

    Raises ValueError when the selection keeps no frame, ParameterError when the request does not fit this clip.
    """
    traits = traits or ModelTraits()
    timed = frames_on_timestamps(source_frames, params, frame_times)
    indices, fps = timed[:2] if timed is not None else select_kept_frames(source_frames, source_fps, params)
    exact = None
    timeline = source_timeline(len(indices), params, frame_times)
    if timeline is not None:
        fps = max(1, round(timeline.mean_rate))
        warnings.warn(
            f"fps_mode='source' keeps every frame at its own time (a variable rate, {float(timeline.mean_rate):.3g} "
            "fps on average): outside the trained contract (24 fps), the output may differ in quality from the "
            "official pipeline's",
            stacklevel=2,
        )
    elif params.fps_mode == "source":
        # The stream's own fraction when known; a float rate is turned back into the fraction it came from.
        exact = Fraction(source_rate) if source_rate is not None else Fraction(source_fps).limit_denominator(100_000)
        warnings.warn(
            f"fps_mode='source' keeps every frame at {exact} fps: outside the trained contract (24 fps), the "
            "output may differ in quality from the official pipeline's",
            stacklevel=2,
        )
    pending = params.windows == "scenes" and cuts is None
    cuts = cuts or ()
    if params.windows == "scenes":
        windows = plan_scene_windows(len(indices), params.window_overlap, cuts)
    else:
        cuts = ()
        windows = plan_windows(len(indices), params.window_overlap)
    longest = max(window.padded for window in windows)
    height, width = source_size
    if params.pre_upscale:
        height, width = pre_upscale_size(height, width)
    grid = tile_grid(height, width, params.tiling_scale, params.min_overlap, traits.tile_sizes)
    chunks = tuple(
        TileChunk(index=i, tiles=tuple(chunk), seed=params.seed + chunk.start)
        for i, chunk in enumerate(tile_chunks(grid.num_tiles, params.tiles_batch_size))
    )
    if params.tiles_batch_size > 1 and grid.num_tiles > 1:
        warnings.warn(
            f"tiles_batch_size={params.tiles_batch_size} is not lossless: under the official seeding every tile that "
            "is not first in its chunk gets other noise, so the output differs from tiles_batch_size=1",
            stacklevel=2,
        )
    deinterlace = deinterlace_order(params, fields)
    if deinterlace is not None and min(source_size) < BWDIF_MIN_SIDE:
        raise ParameterError(
            f"deinterlace={params.deinterlace} needs frames of at least {BWDIF_MIN_SIDE} lines and columns (bwdif's "
            f"least); this source is {source_size[1]}x{source_size[0]}: use deinterlace=off"
        )
    sr_size = grid.output_size
    delivery = target_size(*sr_size, params.target_resolution, params.target_resize_mode) or sr_size
    plan = ClipPlan(
        source_size=source_size,
        source_frames=source_frames,
        source_fps=source_fps,
        num_frames=len(indices),
        fps=fps,
        source_rate=None if exact is None else str(exact),
        source_aspect=None if source_aspect is None or Fraction(source_aspect) == 1 else str(Fraction(source_aspect)),
        fields=fields,
        deinterlace=deinterlace,
        timing=None if frame_times is None else media.timing_of(frame_times[0][:source_frames], frame_times[1]),
        kept=None if timed is None else tuple(indices),
        timeline=timeline,
        windows=windows,
        cuts=tuple(cuts),
        cuts_pending=pending,
        window_frames=longest,
        latent_frames=1 + (longest - 1) // TEMPORAL_FACTOR,
        params=params,
        steps=resolve_steps(params, traits),
        grid=grid,
        chunks=chunks,
        sr_size=sr_size,
        delivery_size=delivery,
        colour=colour,
        depth=depth,
        hdr=hdr,
    )
    if (problem := plan.encoding.size_problem(*delivery, what="an output")) is not None:
        raise ParameterError(f"{problem}: use h264 or ffv1")
    _check_aspect_fits(plan)
    _check_times_fit(plan)
    return plan


def _check_times_fit(plan: ClipPlan) -> None:
    """Matroska keeps a frame's time to the millisecond: frames of a kept variable rate that would fall on one
    millisecond cannot be told apart there, so such a source is refused rather than written with frames merged."""
    timeline = plan.timeline
    if timeline is None or plan.encoding.container != "matroska":
        return
    clock = media.MATROSKA_TICK
    rounded = [round(stamp * timeline.tick / clock) for stamp in timeline.stamps]
    if any(later <= earlier for earlier, later in zip(rounded, rounded[1:], strict=False)):
        raise ParameterError(
            f"codec={plan.params.codec} writes Matroska, which keeps a frame's time to the millisecond, and this "
            f"source's frames come as close as {float(timeline.shortest_s()) * 1000:.3g} ms apart: its timing "
            "cannot be kept there; use fps_mode='contract', or a codec written in MP4 or QuickTime (h264, hevc, "
            "av1, prores, dnxhr)"
        )


def _check_aspect_fits(plan: ClipPlan) -> None:
    """Matroska keeps a pixel shape only in the stream's header fields that PyAV cannot set: an FFV1 output of
    non-square pixels would play stretched, so it is refused rather than written wrong."""
    sar = plan.sample_aspect
    if sar is not None and plan.encoding.container == "matroska":
        shape = plan.aspect()
        raise ParameterError(
            f"codec={plan.params.codec} writes Matroska, which cannot be given this output's pixel shape ({sar}, for "
            f"a {shape['display_aspect']} picture): use --codec prores --pix-fmt yuv444p10le for a mezzanine, or "
            "h264/hevc/av1"
        )
