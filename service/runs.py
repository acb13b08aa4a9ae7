"""Planning a run without loading a model: the model's identity and traits, the clip's plan and its run key.

Planning needs no weights: the model's identity, trained tile sizes and sampler come from the bundle's configs and
weight headers. Every entry point plans a run here before any work starts, so a bad file, value or model is refused
before a server starts or a model loads.
"""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from k6vsr_core import media
from k6vsr_core.contract.latent import plan_latent, read_latent
from k6vsr_core.contract.params import ParameterError, UpscaleParams
from k6vsr_core.contract.plan import ClipPlan, select_kept_frames
from k6vsr_core.contract.source import pixel_path, plan_probed
from k6vsr_core.device.memory_modes import MemoryMode
from k6vsr_core.errors import BundleError, MediaError
from k6vsr_core.model.bundle import DEFAULT_MODEL, BundleInfo, locate_bundle, model_traits
from storage import RunRef, run_key, source_info

__all__ = ["RunRef"]  # the run's handle lives with the store; the runs planned here carry it


class ModelSpec(BaseModel):
    """Which model a worker loads, and how it runs it: none of these change a computed value, so none enter run keys.

    `device` "auto" means the worker's first GPU if it has one, else the CPU. `compile` (on CUDA only) compiles the
    DiT blocks and the KVAE decoder; off, they run eagerly (NABLA's flex attention is compiled either way).
    `memory` is the GPU memory budget (`k6vsr_core.model.memory`); "auto" takes the fastest that fits the clip on the
    worker's kind of card (its memory, not what is free), the same choice in every process.
    """

    model_config = ConfigDict(frozen=True)

    model: str = DEFAULT_MODEL
    revision: str | None = None
    model_id: str | None = None
    device: str = "auto"
    compile: bool = True
    memory: MemoryMode = "auto"


class PreparedRun(BaseModel):
    run: RunRef
    source: str  # the video, or the safetensors file of a latent run
    model_info: BundleInfo
    probe: media.VideoProbe | None  # None for a latent: it has no streams
    plan: ClipPlan  # from the probe; ingest re-plans on the frames actually decoded
    finished: bool
    latent_fps: str | None = None  # a latent run: the latent's exact frame rate (`24`, `30000/1001`)


def model_info(spec: ModelSpec, weights: bool = True, tensors: bool = True) -> BundleInfo:
    """The model's identity and traits, from its configs and weight headers only; from its configs alone when not
    `weights` (a local bundle's identity then covers the configs only, so its run keys are not those of the full
    bundle). Without `tensors`, the weights are not checked against the architecture, which imports torch: the
    warm workers that load the model check them (`k6vsr_core.model.bundle.inspect_bundle`)."""
    return locate_bundle(spec.model, spec.revision, spec.model_id, weights, tensors).info


def prepare_run(
    source: str | Path,
    params: UpscaleParams,
    spec: ModelSpec,
    store_root: str | Path,
    latent_fps: str | float | Fraction | None = None,
    weights: bool = True,
    tensors: bool = True,
    find_cuts: bool = True,
) -> PreparedRun:
    """Everything `k6vsr plan` prints, and the run key: no model is loaded and nothing is written.

    Without `find_cuts`, scene windows' cuts are left to the clip's ingest (`ClipPlan.cuts_pending`): an archive
    plans every clip before the first computes, and looking for cuts decodes each source once more.

    With `latent_fps` (a number or `a/b`), `source` is a safetensors file holding one unscaled KVAE latent
    `[T, C, H, W]` (`k6vsr_core.contract.latent`) played at that rate, instead of a video. Without `weights`, the
    model's
    configs are enough (`model_info`); without `tensors`, the weights are not checked against the architecture.
    """
    if latent_fps is not None:
        return prepare_latent_run(source, params, spec, store_root, latent_fps, weights, tensors)
    probe = media.probe(source)
    pixels = pixel_path(str(source), probe, params)
    if params.audio_file is not None:
        media.check_audio_file(params.audio_file)
    try:
        select_kept_frames(probe.num_frames, probe.fps, params)
    except ValueError as err:  # too few frames for the rate: a property of the file
        raise MediaError(source, str(err)) from None
    info = model_info(spec, weights, tensors)
    fields = media.probe_fields(source)
    try:
        plan = plan_probed(str(source), probe, probe.num_frames, params, model_traits(info), pixels, fields, find_cuts)
    except ParameterError:
        raise
    except ValueError as err:  # e.g. an `exact` target above this clip's result: the request, for this file
        raise ParameterError(f"{source}: {err}") from None
    key = run_key(
        source_info(source).sha256,
        params,
        info.identity,
        deinterlace=plan.deinterlace,
        on_timestamps=plan.kept is not None,
        depth=plan.depth,
    )
    return _prepared(source, store_root, key, info, plan, probe)


def latent_channels(info: BundleInfo) -> int:
    if info.latent_channels is None:  # only records written before it was recorded lack it; `model_info` never
        raise BundleError(f"{info.identity}: the KVAE's latent channel count is unknown")
    return info.latent_channels


def prepare_latent_run(
    source: str | Path,
    params: UpscaleParams,
    spec: ModelSpec,
    store_root: str | Path,
    fps: str | float | Fraction,
    weights: bool = True,
    tensors: bool = True,
) -> PreparedRun:
    """`prepare_run` of a latent file: loaded on the CPU and checked (shape, dtype, channels, frames, rate) before
    anything is written. The run key holds the file's content and the rate."""
    if params.audio_file is not None:
        media.check_audio_file(params.audio_file)
    info = model_info(spec, weights, tensors)
    latent, rate = read_latent(source, latent_channels(info), params, fps)
    plan = plan_latent(latent.shape, rate, params, model_traits(info))
    key = run_key(source_info(source).sha256, plan.params, info.identity, str(rate))
    return _prepared(source, store_root, key, info, plan, None, str(rate))


def _prepared(
    source: str | Path,
    store_root: str | Path,
    key: str,
    info: BundleInfo,
    plan: ClipPlan,
    probe: media.VideoProbe | None,
    latent_fps: str | None = None,
) -> PreparedRun:
    """The prepared run of `key` in `store_root`: finished if its store already holds the output."""
    run = RunRef(store_root=str(store_root), run_key=key)
    return PreparedRun(
        run=run,
        source=str(Path(source).resolve()),
        model_info=info,
        probe=probe,
        plan=plan,
        finished=run.open().output_done(),
        latent_fps=latent_fps,
    )
