"""How much disk a run's store takes: an estimate `k6vsr plan` prints before any work.

A window's intermediates (its latent, the denoised tile latents, the decoded tiles and the blended frames) are
deleted once its segments are written, so the store holds a few windows of them at a time whatever the length;
what grows with length is only the encoded video (the segments, then the output).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from pydantic import BaseModel

from k6vsr_core.contract.plan import ClipPlan
from k6vsr_core.contract.stage_names import Stage
from k6vsr_core.contract.tiling import SPATIAL_FACTOR
from storage.run_store import RunStore

# Windows whose intermediates coexist: the one being blended, the one on the GPU and the one being encoded.
WINDOWS_IN_FLIGHT = 3
# H.264 at CRF 18 of upscaled footage; an upper guess (see docs/store.md).
ENCODED_BYTES_PER_PIXEL = 0.05
LATENT_CHANNELS = 64
FLOAT32 = 4


class StoreEstimate(BaseModel):
    window_bytes: int  # the intermediates of one window
    encoded_bytes: int  # the segments of the whole video (the output is as large, once joined)
    peak_bytes: int  # a few windows' intermediates, the segments and the output
    bytes_per_output_minute: int  # the encoded part, which is what grows with length


def store_estimate(plan: ClipPlan) -> StoreEstimate:
    grid = plan.grid
    frames = plan.window_frames
    padded = (grid.padded_size[0] // SPATIAL_FACTOR) * (grid.padded_size[1] // SPATIAL_FACTOR)
    tile = (grid.base[0] // SPATIAL_FACTOR) * (grid.base[1] // SPATIAL_FACTOR)
    latent = LATENT_CHANNELS * plan.latent_frames * padded * FLOAT32
    tile_latents = plan.num_tiles * LATENT_CHANNELS * plan.latent_frames * tile * FLOAT32
    sample = plan.depth // 8  # bytes a pixel's sample: uint8, or uint16 on the 16-bit path
    tiles = plan.num_tiles * 3 * frames * grid.base[0] * grid.base[1] * sample
    height, width = plan.delivery_size
    blended = frames * height * width * 3 * sample
    window = latent + tile_latents + tiles + blended
    encoded = round(plan.num_frames * height * width * ENCODED_BYTES_PER_PIXEL)
    per_minute = round(60 * plan.fps * height * width * ENCODED_BYTES_PER_PIXEL)
    in_flight = min(WINDOWS_IN_FLIGHT, plan.num_windows)
    return StoreEstimate(
        window_bytes=window,
        encoded_bytes=encoded,
        peak_bytes=in_flight * window + 2 * encoded,
        bytes_per_output_minute=per_minute,
    )


RATES = "preview.json"  # in a run's folder: the rates its last preview measured (flows.preview)


class StageRates(BaseModel):
    """What a preview measured on this machine, per unit of work: what a run's time and disk are estimated from."""

    # The command's head before its flow's work (imports, the Prefect server, the workers' start, the flow run):
    # every command that runs the clip pays it again. 0 where no command's start was known (an HTTP job).
    command_head_s: float = 0.0
    ingest_s: float  # the whole ingest (a scan of the source: about the same for any part of it)
    # A window's encode, denoise, decode and blend, per frame it computes (padded): wall seconds from the end of the
    # window before it, computed as a run schedules them (flows.preview), so work a run overlaps counts once.
    model_s_per_frame: float
    # What a process's first window costs beyond that, once a run: 0 from a preview now (its rate spreads it over
    # the frames it measured, flows.preview.model_rate); kept for the rates an earlier preview wrote.
    first_window_extra_s: float = 0.0
    segment_s_per_frame: float  # cross-fade and encoding, per output frame
    encoded_bytes_per_frame: float  # the encoded output, per frame
    windows_measured: int


class RunEstimate(BaseModel):
    seconds: float  # the whole run from nothing, on the machine and with the workers the preview ran on
    seconds_left: float  # what is left after the windows already done in the store
    output_bytes: int
    peak_store_bytes: int
    windows_measured: int


def estimate_run(plan: ClipPlan, rates: StageRates, done: Mapping[Stage, Collection[str]] | None = None) -> RunEstimate:
    """A run's time and disk from measured rates: the command's head, then its stages, one after another (a worker's
    CPU or GPU does them in turn), so an upper bound where stages overlap on separate devices, plus what a process's
    first window costs once; the mux copies streams and costs little. What is left leaves out the work `done` (the
    items recorded done, by stage: `done_items`) holds: the ingest, each window's model work (whole once it is
    blended, else by its tiles decoded) and the segments written."""
    done_sets = {stage: set(items) for stage, items in (done or {}).items()}
    computed = [window.padded for window in plan.windows]
    model = rates.model_s_per_frame * sum(computed)
    segments = rates.segment_s_per_frame * plan.num_frames
    total = rates.command_head_s + rates.ingest_s + rates.first_window_extra_s + model + segments
    # What is done is not computed again; a new command still pays its head, a new process its first window.
    saved = rates.ingest_s if "all" in done_sets.get(Stage.INGEST, ()) else 0.0
    for window in plan.windows:
        if {str(window.index)} & (done_sets.get(Stage.BLEND, set()) | done_sets.get(Stage.SEGMENT, set())):
            share = 1.0
        else:
            decoded = {f"{window.index}-{tile}" for tile in range(plan.num_tiles)} & done_sets.get(Stage.DECODE, set())
            share = len(decoded) / plan.num_tiles
        saved += share * rates.model_s_per_frame * window.padded
        if str(window.index) in done_sets.get(Stage.SEGMENT, ()):
            start, stop = plan.segment_range(window.index)
            saved += rates.segment_s_per_frame * (stop - start)
    encoded = round(rates.encoded_bytes_per_frame * plan.num_frames)
    store = store_estimate(plan)
    return RunEstimate(
        seconds=round(total, 1),
        seconds_left=round(max(0.0, total - saved), 1),
        output_bytes=encoded,
        peak_store_bytes=min(WINDOWS_IN_FLIGHT, plan.num_windows) * store.window_bytes + 2 * encoded,
        windows_measured=rates.windows_measured,
    )


def done_items(store: RunStore) -> dict[Stage, list[str]]:
    """The items the store's records say are done, by stage: what a run of it will not compute again."""
    return {stage: store.records.items(stage) for stage in (Stage.INGEST, Stage.DECODE, Stage.BLEND, Stage.SEGMENT)}


def run_estimate(store: RunStore, plan: ClipPlan) -> RunEstimate | None:
    """The one answer to "how long will this run take, and how long is left": from the rates the last preview of
    it kept and the work its store holds, as `k6vsr plan` and `k6vsr preview` both say it. None without a preview."""
    rates = read_rates(store)
    return None if rates is None else estimate_run(plan, rates, done_items(store))


def read_rates(store: RunStore) -> StageRates | None:
    """The rates the last preview of this run measured, if any."""
    path = store.where / RATES
    try:
        return (
            StageRates.model_validate_json(path.read_bytes()) if store.file_done(path, Stage.PREVIEW, "all") else None
        )
    except (OSError, ValueError):
        return None
