"""GPU memory budgets: how much of the card a run may use, and how the stages keep within it.

A budget settles three things, none of which changes a computed value:

- where each component's weights live: resident on the GPU; streamed in block by block from pinned host memory
  while it runs (diffusers' group offloading); or swapped whole with its partner so that only one of the two is on
  the GPU at a time (accelerate's `cpu_offload_with_hook`);
- how many latent frames the KVAE encodes or decodes per call through its causal cache (`k6vsr_core.model.kvae`), the
  largest that keeps the stage within the budget: activation memory follows that chunk, not the clip;
- whether the stages of one process take turns on the GPU (a decode then no longer overlaps the next denoise).

A process runs up to two model tasks at once (`runtime.slots`), and an archive's clips share a warm worker's. Whatever
runs together, each stage's call first takes its share of the card from the bundle's `MemoryGate`
(`k6vsr_core.device.gate`): its activations as estimated here (all of the room when stages take turns). Calls run
together
only while their shares fit beside the resident weights under the budget's limit, so the budget covers every pairing
the scheduler allows (two denoise chunks, two decodes, an encode beside a decode), not only the decode beside a
denoise that the KVAE chunk is chosen for. A call that waits keeps its place: a large decode is not overtaken by a
stream of small denoise chunks.

Where stages may overlap, every process budgets for a decode beside a denoise, also one that happens to run one
stage at a time (a one-thread worker, the in-memory runner): the KVAE chunk decides how the decode's sums are split,
and a GPU gives other bits for another split, so the chunk must not depend on how a process runs.

| budget | ceiling | latent upscaler | DiT and KVAE | stages |
|---|---|---|---|---|
| `fast` | 32 GiB | resident | resident | overlap |
| `24g` | 24 GiB | streamed | resident | take turns |
| `16g` | 16 GiB | streamed | swapped | take turns |

`choose_budget` is a pure function of the asked mode, the card's memory and the clip's plan: `auto` takes the first
of these that fits the card, an explicit budget must fit it, and the answer says why. The card's memory is its total
times the process's memory fraction (`card_bytes`): what the card is, never what is free at the moment, so the
in-memory runner, a command, warm and Dask workers and the HTTP server's jobs choose the same budget and KVAE chunks
for the same clip on the same kind of card (`budget_for`, the one call they all make). The sizes it reasons with
are `RELEASED_FOOTPRINT`, the released model's, measured on an H200 where noted.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict

from k6vsr_core.contract.plan import TEMPORAL_FACTOR, ClipPlan
from k6vsr_core.contract.stage_names import Stage
from k6vsr_core.contract.tiling import SPATIAL_FACTOR, Size
from k6vsr_core.device.memory_modes import MEMORY_MODES, BudgetName, MemoryMode
from k6vsr_core.errors import UserFacingError

if TYPE_CHECKING:
    import torch

    from k6vsr_core.model.bundle import ModelBundle

GIB = 1 << 30
MIB = 1 << 20
# Latent frames per KVAE call, largest first; None is the KVAE's own segmentation (1 + 16 pixel frames a call).
CHUNKS: tuple[int | None, ...] = (None, 3, 2, 1)
KVAE_SEGMENT_FRAMES = 17


class MemoryBudgetError(UserFacingError, ValueError):
    """No budget fits: the message says how much memory the card has and how much the smallest budget needs."""


class Footprint(BaseModel):
    """What a model needs on a GPU, in bytes. Activations are per pixel, frame or token of the work in flight."""

    model_config = ConfigDict(frozen=True)

    weights: dict[str, int]  # per component, as loaded on a GPU
    streamed_group: int  # the largest block a streamed latent upscaler brings in at once
    encode_per_pixel_frame: float  # per source pixel and pixel frame of one KVAE encode call
    decode_per_pixel_frame: float  # per output pixel and pixel frame of one KVAE decode call
    denoise_per_token: float  # per latent token of a denoise chunk (upscaler or DiT, whichever needs more)
    runtime: int  # workspaces of cuBLAS, cuDNN and the compiled kernels
    reserved_factor: float  # what the caching allocator reserves over the allocated peak


BF16 = 2
# The released model in bf16. Decode: the compiled KVAE decode of a 512x768 tile, 1 latent frame (4 pixel frames) a
# call, peaked at 20.32 GiB allocated on an H200 with 12.68 GiB of weights (bench/RESULTS.md, 2026-12-01): 7.64 GiB
# of activations, counted as 5 frames plus one frame's worth of causal caches. (The KVAE's own 17-frame segments
# took 27.0 GiB, 1.5 GiB a frame against 1.27 here: this estimate is for the chunked calls a budget makes.)
# Encode: the eager encoder needs 0.18 of the eager decoder's bytes per pixel-frame (measured on a CPU). Denoise:
# an estimate from the DiT's widths. bench/memory_bench.py measures all three per stage. The reserved factor is the
# largest seen (36.9 GiB reserved over 30.3 GiB allocated).
RELEASED_FOOTPRINT = Footprint(
    weights={"transformer": 1_414_263_936 * BF16, "vae": 1_738_878_243 * BF16, "latent_upscaler": 3_654_021_952 * BF16},
    streamed_group=2_208_391_360 * BF16,  # the x2 model of the upscaler bank
    encode_per_pixel_frame=768.0,
    decode_per_pixel_frame=7.64 * GIB / (6 * 512 * 768),
    denoise_per_token=64 * 1024.0,
    runtime=GIB // 2,
    reserved_factor=1.2,
)


@dataclass(frozen=True)
class Layout:
    ceiling: int
    streamed: tuple[str, ...]  # group-offloaded, block by block, from pinned host memory
    swapped: tuple[str, ...]  # one of them on the GPU at a time, moved whole
    take_turns: bool
    summary: str


BUDGETS: dict[BudgetName, Layout] = {
    "fast": Layout(32 * GIB, (), (), False, "everything resident"),
    "24g": Layout(24 * GIB, ("latent_upscaler",), (), True, "latent upscaler streamed from host memory"),
    "16g": Layout(
        16 * GIB,
        ("latent_upscaler",),
        ("transformer", "vae"),
        True,
        "latent upscaler streamed from host memory, DiT and KVAE swapped",
    ),
}


class Workload(BaseModel):
    """What one clip asks of the GPU: the source the KVAE encodes, the tiles it decodes, the chunks it denoises."""

    model_config = ConfigDict(frozen=True)

    source: Size  # (H, W) of the padded encoder input
    tile: Size  # (H, W) of one decoded tile, in output pixels
    frames: int  # pixel frames
    tiles_per_chunk: int

    @property
    def tokens(self) -> int:
        return _tokens(self.tile, self.frames) * self.tiles_per_chunk

    def describe(self) -> str:
        return f"{self.tile[1]}x{self.tile[0]} tiles of {self.frames} frames"


def workload_of(plan: ClipPlan) -> Workload:
    return Workload(
        source=plan.grid.padded_size,
        tile=plan.grid.base,
        frames=plan.window_frames,  # a stage never holds more than one window
        tiles_per_chunk=max(len(chunk.tiles) for chunk in plan.chunks),
    )


def frames_per_call(chunk: int | None, frames: int) -> int:
    """Pixel frames in one KVAE call: the first frame goes alone, then `chunk` latent frames (4 pixel frames each)."""
    if chunk is None:
        return min(KVAE_SEGMENT_FRAMES, frames)
    return max(1, min(TEMPORAL_FACTOR * chunk, frames - 1))


class MemoryBudget(BaseModel):
    """The budget a worker runs under, what it estimates for the clip it was chosen for, and why."""

    model_config = ConfigDict(frozen=True)

    mode: MemoryMode  # what was asked
    budget: BudgetName | None  # None: no GPU, nothing to budget
    limit: int | None = None  # bytes the run stays under: the ceiling, or the card's memory when that is less
    encode_chunk: int | None = None
    decode_chunk: int | None = None
    estimate: int | None = None  # reserved bytes at the peak, for the clip it was chosen for
    reason: str
    footprint: Footprint = RELEASED_FOOTPRINT

    @property
    def layout(self) -> Layout | None:
        return BUDGETS[self.budget] if self.budget is not None else None

    @property
    def take_turns(self) -> bool:
        return self.layout is not None and self.layout.take_turns

    @property
    def overlap(self) -> bool:
        """Whether a decode may run beside a denoise, and so is budgeted with one: wherever stages do not take turns."""
        return self.layout is not None and not self.layout.take_turns

    def kvae_chunk(self, stage: Literal[Stage.ENCODE, Stage.DECODE], size: Size, frames: int) -> int | None:
        """Latent frames per KVAE call for an encode of a `size` source or a decode of a `size` tile."""
        if self.layout is None or self.limit is None:
            return None
        peak = _encode_peak if stage == Stage.ENCODE else _decode_peak
        return _largest_chunk(self.layout, self.footprint, peak, size, frames, self.limit)[0]

    @property
    def room(self) -> int | None:
        """Allocated bytes the stages' activations may take together: the limit, less the allocator's reserve, the
        runtime's workspaces and the resident weights (None: nothing to budget)."""
        if self.layout is None or self.limit is None:
            return None
        fixed = _resident(self.layout, self.footprint) + self.footprint.runtime
        return max(0, int(self.limit / self.footprint.reserved_factor) - fixed)

    def share(self, stage: Stage, size: Size, frames: int, tiles: int = 1) -> int:
        """What one call of `stage` takes of `room`: an encode of a `size` source, a denoise of `tiles` tiles of
        `size`, or a decode of a `size` tile, all of `frames` pixel frames; all of it when stages take turns."""
        room = self.room
        if room is None or self.layout is None:
            return 0
        if self.layout.take_turns:
            return room
        if stage == Stage.DENOISE:
            return int(_denoise_activations(self.layout, self.footprint, _tokens(size, frames) * tiles))
        kvae: Literal[Stage.ENCODE, Stage.DECODE] = Stage.ENCODE if stage == Stage.ENCODE else Stage.DECODE
        activations = _encode_activations if kvae == Stage.ENCODE else _decode_activations
        return int(activations(self.footprint, size, frames, self.kvae_chunk(kvae, size, frames)))

    def summary(self) -> str:
        """One line for plans and logs."""
        if self.layout is None or self.estimate is None:
            return self.reason
        return (
            f"{self.budget} ({self.layout.summary}; KVAE {_chunk_words(self.encode_chunk)} to encode, "
            f"{_chunk_words(self.decode_chunk)} to decode; about {self.estimate / GIB:.1f} GiB): {self.reason}"
        )


def _chunk_words(chunk: int | None) -> str:
    if chunk is None:
        return "whole"
    return f"{chunk} latent frame{'s' if chunk > 1 else ''} a call"


# ---------------------------------------------------------------------------------------------------- estimates

# Allocated bytes at a KVAE stage's peak: (layout, footprint, source or tile size, pixel frames, chunk).
Peak = Callable[[Layout, Footprint, Size, int, "int | None"], float]


def _resident(layout: Layout, footprint: Footprint) -> int:
    fixed = sum(size for name, size in footprint.weights.items() if name not in (*layout.streamed, *layout.swapped))
    return fixed + max((footprint.weights[name] for name in layout.swapped), default=0)


def _streamed(layout: Layout, footprint: Footprint) -> int:
    return footprint.streamed_group if layout.streamed else 0


def _tokens(tile: Size, frames: int) -> int:
    latent_frames = 1 + (frames - 1) // TEMPORAL_FACTOR
    return (tile[0] // SPATIAL_FACTOR) * (tile[1] // SPATIAL_FACTOR) * latent_frames


def _encode_activations(footprint: Footprint, source: Size, frames: int, chunk: int | None) -> float:
    # The causal caches count as one more frame.
    return footprint.encode_per_pixel_frame * source[0] * source[1] * (frames_per_call(chunk, frames) + 1)


def _decode_activations(footprint: Footprint, tile: Size, frames: int, chunk: int | None) -> float:
    return footprint.decode_per_pixel_frame * tile[0] * tile[1] * (frames_per_call(chunk, frames) + 1)


def _encode_peak(layout: Layout, footprint: Footprint, source: Size, frames: int, chunk: int | None) -> float:
    return _resident(layout, footprint) + _encode_activations(footprint, source, frames, chunk)


def _denoise_activations(layout: Layout, footprint: Footprint, tokens: int) -> float:
    return _streamed(layout, footprint) + footprint.denoise_per_token * tokens


def _decode_peak(layout: Layout, footprint: Footprint, tile: Size, frames: int, chunk: int | None) -> float:
    peak = _resident(layout, footprint) + _decode_activations(footprint, tile, frames, chunk)
    if not layout.take_turns:
        # The chunk is chosen so that a decode fits beside the next chunk's denoise, the pairing a stream keeps the
        # GPU busy with, in every process (see the module's docstring; other pairings wait at the gate). The chunk's
        # tokens are not known here: this assumes one tile of the same size.
        peak += _denoise_activations(layout, footprint, _tokens(tile, frames))
    return peak


def _reserved(footprint: Footprint, allocated: float) -> int:
    return int((allocated + footprint.runtime) * footprint.reserved_factor)


@dataclass(frozen=True)
class _Fit:
    budget: BudgetName
    encode_chunk: int | None
    decode_chunk: int | None
    estimate: int  # reserved bytes at the peak
    fits: bool


def _largest_chunk(
    layout: Layout, footprint: Footprint, peak: Peak, size: Size, frames: int, limit: int
) -> tuple[int | None, int]:
    """The largest KVAE chunk whose stage stays under `limit` (else the smallest), with its reserved estimate."""
    estimates = [(chunk, _reserved(footprint, peak(layout, footprint, size, frames, chunk))) for chunk in CHUNKS]
    return next(((chunk, estimate) for chunk, estimate in estimates if estimate <= limit), estimates[-1])


def _fit(budget: BudgetName, footprint: Footprint, work: Workload, limit: int) -> _Fit:
    """The largest KVAE chunks that keep each stage under `limit`, and the resulting peak."""
    layout = BUDGETS[budget]
    encode_chunk, encode = _largest_chunk(layout, footprint, _encode_peak, work.source, work.frames, limit)
    decode_chunk, decode = _largest_chunk(layout, footprint, _decode_peak, work.tile, work.frames, limit)
    denoise = _reserved(footprint, _resident(layout, footprint) + _denoise_activations(layout, footprint, work.tokens))
    estimate = max(encode, decode, denoise)
    return _Fit(budget, encode_chunk, decode_chunk, estimate, estimate <= limit)


# ---------------------------------------------------------------------------------------------------- the choice


def choose_budget(
    mode: MemoryMode,
    card: int | None,
    plan: ClipPlan,
    footprint: Footprint = RELEASED_FOOTPRINT,
    device: str = "the GPU",
) -> MemoryBudget:
    """The budget `plan` runs under on a card whose process may use `card` bytes (None: no GPU), with its reason.

    Raises `MemoryBudgetError` when the asked budget, or for `auto` every budget, needs more than the card has: a
    run refuses to start rather than run out of memory halfway.
    """
    if mode not in MEMORY_MODES:
        raise MemoryBudgetError(f"memory={mode!r} is not a memory mode; allowed: {', '.join(MEMORY_MODES)}")
    if card is None:
        return MemoryBudget(mode=mode, budget=None, reason="no GPU: the memory mode applies to GPU runs only")
    work = workload_of(plan)
    has = f"{card / GIB:.1f} GiB on {device}"
    if mode != "auto":
        limit = min(BUDGETS[mode].ceiling, card)
        fit = _fit(mode, footprint, work, limit)
        if not fit.fits:
            raise MemoryBudgetError(
                f"memory={mode}: {work.describe()} need about {fit.estimate / GIB:.1f} GiB, {has}; "
                + ("use a smaller budget or auto" if mode != "16g" else "use a GPU with more memory")
            )
        return _budget(mode, fit, limit, footprint, f"asked for; {has}")
    tried: list[str] = []
    for name in BUDGETS:
        limit = min(BUDGETS[name].ceiling, card)
        fit = _fit(name, footprint, work, limit)
        if fit.fits:
            needs = f"; {', '.join(tried)}" if tried else ""
            return _budget(mode, fit, limit, footprint, f"auto: {has}{needs}")
        tried.append(f"{name} needs about {fit.estimate / GIB:.1f} GiB")
    raise MemoryBudgetError(f"memory=auto: {has}, too little for {work.describe()}: {'; '.join(tried)}")


def _budget(mode: MemoryMode, fit: _Fit, limit: int, footprint: Footprint, reason: str) -> MemoryBudget:
    return MemoryBudget(
        mode=mode,
        budget=fit.budget,
        limit=limit,
        encode_chunk=fit.encode_chunk,
        decode_chunk=fit.decode_chunk,
        estimate=fit.estimate,
        reason=reason,
        footprint=footprint,
    )


def card_bytes(device: torch.device) -> int | None:
    """The memory a process may use on `device`'s card (None off CUDA): the card's total, times the process's memory
    fraction (`torch.cuda.set_per_process_memory_fraction`, which is how a smaller card is simulated), in whole MiB.
    A property of the card and of how the process was configured, never of what is in use at the moment."""
    if device.type != "cuda":
        return None
    import torch  # here, not above: budgets are chosen while planning, before torch is needed

    # torch 2.11's per-process fraction calls want an index: a bare "cuda" device is refused.
    index = device.index if device.index is not None else torch.cuda.current_device()
    total = torch.cuda.get_device_properties(index).total_memory
    get_fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)  # torch 2.8 and later
    fraction = get_fraction(index) if get_fraction is not None else 1.0
    return int(fraction * total) // MIB * MIB


def budget_for(mode: MemoryMode, device: torch.device, plan: ClipPlan) -> MemoryBudget:
    """The budget and KVAE chunks `plan` runs under on `device`'s card: the one choice every path makes, so that a
    clip's bytes never depend on which process, role or thread count computed it."""
    return choose_budget(mode, card_bytes(device), plan, device=str(device))


def free_gpu_bytes(device: torch.device) -> int | None:
    """Free memory this process may still take on `device`: the driver's figure, capped by a per-process fraction.
    Only for warnings and benchmarks: no choice depends on it."""
    if device.type != "cuda":
        return None
    import torch

    index = device.index if device.index is not None else torch.cuda.current_device()
    free, total = torch.cuda.mem_get_info(index)
    get_fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    fraction = get_fraction(index) if get_fraction is not None else 1.0
    return int(min(free, fraction * total - torch.cuda.memory_reserved(index)))


# ---------------------------------------------------------------------------------------------------- applying


def apply_budget(bundle: ModelBundle, budget: MemoryBudget) -> None:
    """Place the bundle's weights as `budget` says, with diffusers' and accelerate's offload hooks; once per bundle."""
    if bundle.memory is not None:
        if bundle.memory.budget == budget.budget:
            return
        raise ValueError(
            f"bundle already runs under memory budget {bundle.memory.budget}; load it again for {budget.budget}"
        )
    layout = budget.layout
    device = bundle.device
    if layout is not None:
        components = {"transformer": bundle.transformer, "vae": bundle.vae, "latent_upscaler": bundle.latent_upscaler}
        for name in layout.streamed:
            # One block group at a time (for the upscaler bank: one scale's model), prefetched on a side stream.
            components[name].enable_group_offload(
                onload_device=device,
                offload_type="block_level",
                num_blocks_per_group=1,
                use_stream=device.type == "cuda",
            )
        if layout.swapped:
            from accelerate import cpu_offload_with_hook

            first, second = (components[name] for name in layout.swapped)
            _, first_hook = cpu_offload_with_hook(first, device)
            _, second_hook = cpu_offload_with_hook(second, device, prev_module_hook=first_hook)
            # Close the ring: each moves the other out before it runs. accelerate chains hooks one way only, and
            # takes the previous hook only as an argument of `cpu_offload_with_hook`: no public call sets it after,
            # so the attribute that argument is stored in (CpuOffload.prev_module_hook) is set here.
            first_hook.hook.prev_module_hook = second_hook
        if device.type == "cuda":
            import torch

            torch.cuda.empty_cache()
    bundle.memory = budget
