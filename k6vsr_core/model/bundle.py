"""Loading the released model bundle (tiny random ones in the same layout: `k6vsr_core.model.tiny_bundle`).

The released checkpoints are Diffusers bundles (`model_index.json`, `transformer/`, `vae/`, `latent_upscaler/`,
`scheduler/`) whose component `config.json` files use the official repository's own key names. Diffusers 0.42.1
ignores those names (with a warning) and falls back to class defaults that equal the released architecture (contract
§H). Instead of relying on that coincidence, we translate the native names into the Diffusers constructor arguments
ourselves and pass them explicitly, so a bundle of another size (our tiny test bundles, a future release) loads as
what it says it is, and the ignored-keys warning is expected rather than alarming.

Everything is validated before any weight is read: the component folders, safetensors only (pickled weights can run
code on load), every tensor name and shape against the architecture, and the DiT head width against the scheduler.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import logging
import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict
from safetensors import safe_open

from k6vsr_core.contract.plan import ModelTraits
from k6vsr_core.contract.release_config import DEFAULT_MODEL, DEFAULT_REVISION
from k6vsr_core.contract.stage_names import Stage
from k6vsr_core.contract.tiling import RESOLUTIONS, Size
from k6vsr_core.device.gate import MemoryGate
from k6vsr_core.errors import BundleError

if TYPE_CHECKING:
    import torch


MODEL_INDEX = "model_index.json"
WEIGHTS = "diffusion_pytorch_model.safetensors"
COMPONENTS = ("transformer", "vae", "latent_upscaler")
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
PIFLOW = "PiflowScheduler"
FLOW_EULER = "FlowMatchEulerDiscreteScheduler"
# Settings of the released DiT (`transformer/config.json` `sr_params`), used when a bundle omits them.
DEFAULT_LQ_NOISE_SCALE = 0.7
# The KVAE class's default latent width, which the released config omits: a plan reads it here and imports no
# diffusers (tests check it, and `tiling.RESOLUTIONS`, against the classes' signatures).
DEFAULT_LATENT_CHANNELS = 64


DIFFUSERS_LOCK = threading.RLock()


@functools.cache
def _classes() -> dict[str, Any]:
    """The model and scheduler classes by component and scheduler name, imported on first use: diffusers loads torch,
    which takes seconds that `k6vsr --help` and the pure modules must not pay. Imported under a lock: diffusers' lazy
    module attributes are not safe to resolve from several threads at the same time (seen as spurious ImportErrors
    when clips are planned in parallel)."""
    with DIFFUSERS_LOCK:
        from diffusers import (
            FlowMatchEulerDiscreteScheduler,
            Kandinsky6SRLatentUpscalerBank,
            Kandinsky6SRTransformer3DModel,
            Kandinsky6SRVAE,
            PiflowScheduler,
        )
    return {
        "transformer": Kandinsky6SRTransformer3DModel,
        "vae": Kandinsky6SRVAE,
        "latent_upscaler": Kandinsky6SRLatentUpscalerBank,
        PIFLOW: PiflowScheduler,
        FLOW_EULER: FlowMatchEulerDiscreteScheduler,
    }


def diffusers_class(name: str) -> Any:
    """A class of `_classes` by component or scheduler name, imported under its lock: every import of diffusers'
    top-level names goes through here (a model worker's preload and its first task import it at the same time)."""
    return _classes()[name]


class BundleInfo(BaseModel):
    """What the run store and the manifest record about the model."""

    model_config = ConfigDict(frozen=True)

    model_id: str  # hub repo id, explicit id, or "local:<fingerprint>"
    revision: str | None
    path: str
    scheduler: str  # PiflowScheduler | FlowMatchEulerDiscreteScheduler
    trained_steps: int  # PiFlow nfe; flow-Euler default
    lq_noise_scale: float
    tile_sizes: tuple[tuple[int, int], ...]
    fingerprint: str
    # Channels of the KVAE latent, so a `[T, C, H, W]` latent input is checked without loading weights. None in
    # records written before it was recorded.
    latent_channels: int | None = None

    @property
    def identity(self) -> str:
        """A string that changes whenever the weights may: used in run keys."""
        return f"{self.model_id}@{self.revision or self.fingerprint}"


class ModelBundle:
    """The loaded components. Holds no per-request state: schedulers are copied per use.

    `device` is where the stages compute, wherever a memory budget keeps some weights meanwhile; `memory` is that
    budget (`k6vsr_core.model.memory.apply_budget`), None until one is applied.
    """

    def __init__(
        self,
        transformer: Any,
        vae: Any,
        latent_upscaler: Any,
        scheduler: Any,
        info: BundleInfo,
        device: torch.device,
    ) -> None:
        self.transformer = transformer
        self.vae = vae
        self.latent_upscaler = latent_upscaler
        self.scheduler = scheduler
        self.info = info
        self.device = device
        self.memory: Any = None  # the k6vsr_core.model.memory.MemoryBudget applied to this bundle, if any
        self.gate = MemoryGate()  # the stages' shares of the card under `memory` (k6vsr_core.model.memory)

    def on_gpu(self, stage: Stage, size: Size, frames: int, tiles: int = 1) -> AbstractContextManager[None]:
        """Hold the card for one call of `stage` (its share under the memory budget; nothing to hold without one)."""
        if self.memory is None or self.memory.room is None:
            return nullcontext()
        return self.gate.hold(self.memory.share(stage, size, frames, tiles), self.memory.room)

    def new_scheduler(self) -> Any:
        """A fresh scheduler: they carry a step index, so concurrent tiles must not share one."""
        return _scheduler_from_config(type(self.scheduler), dict(self.scheduler.config))


# ---------------------------------------------------------------------------------------------------- resolving


def is_local(model: str) -> bool:
    """Whether `model` names a local folder (an existing path, or one written as a path) rather than a hub repo."""
    return Path(model).expanduser().exists() or model.startswith((".", "/", "~"))


def resolve_bundle_path(model: str, revision: str | None = None, weights: bool = True) -> Path:
    """A local folder as is; otherwise a Hugging Face repo id, from the local cache or downloaded (without its
    weight files unless `weights`: planning reads the configs only)."""
    path = Path(model).expanduser()
    if is_local(model):
        if not path.is_dir():
            raise BundleError(f"model folder {path} does not exist or is not a directory")
        return path.resolve()
    from huggingface_hub import snapshot_download

    patterns = [MODEL_INDEX, "*/config.json", "*/scheduler_config.json", *([f"*/{WEIGHTS}"] if weights else [])]
    try:
        return Path(snapshot_download(model, revision=revision, allow_patterns=patterns, local_files_only=True))
    except Exception:  # noqa: BLE001 - not cached: try the network next
        pass
    try:
        if not _hub_resolvable():
            raise ConnectionError("the hub's host name does not resolve (no network)")
        with _quiet("huggingface_hub"):
            return Path(snapshot_download(model, revision=revision, allow_patterns=patterns))
    except Exception as err:  # noqa: BLE001 - every hub failure means the same thing to the user
        raise BundleError(
            f"model {model!r} at revision {revision or 'main'} is neither in the local Hugging Face cache nor "
            f"downloadable here ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else 'no detail'}). "
            f"Download it where the hub is reachable (`hf download {model} --revision {revision or 'main'} "
            f"--local-dir DIR`), copy DIR here and pass `--model DIR` (with `--model-id {model}` to keep its "
            "run keys)"
        ) from None


def _hub_resolvable() -> bool:
    """Without DNS the hub client would retry with backoff for ~25 s before saying the same thing."""
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants

    try:
        socket.getaddrinfo(urlparse(constants.ENDPOINT).hostname, 443)
    except OSError:
        return False
    return True


# ---------------------------------------------------------------------------------------------------- configs


def _read_json(path: Path, component: str) -> dict[str, Any]:
    if not path.is_file():
        raise BundleError(f"{component}: {path} is missing")
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise BundleError(f"{component}: {path} is not valid JSON ({err})") from None


def _public(config: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in config.items() if not key.startswith("_")}


def transformer_kwargs(config: dict[str, Any]) -> dict[str, Any]:
    """Diffusers constructor arguments from a transformer config in the native or the Diffusers spelling."""
    names = ("in_visual_dim", "out_visual_dim", "time_dim", "model_dim", "ff_dim", "num_visual_blocks")
    kwargs: dict[str, Any] = {name: int(config[name]) for name in names if name in config}
    for name in ("patch_size", "axes_dims", "nabla_window", "scale_factor"):
        if name in config:
            kwargs[name] = tuple(config[name])
    if "nabla_threshold" in config:
        kwargs["nabla_threshold"] = float(config["nabla_threshold"])
    if "tile_sizes" in config:
        kwargs["tile_sizes"] = tuple(tuple(int(v) for v in hw) for hw in config["tile_sizes"])
    sr_params = config.get("sr_params") or {}
    scale_factor = (sr_params.get("scale_factor") or {}).get("512")
    if scale_factor is not None and "scale_factor" not in kwargs:
        kwargs["scale_factor"] = tuple(float(v) for v in scale_factor)
    nabla = (config.get("attention_params") or {}).get("512") or {}
    if nabla.get("type") == "nabla":
        kwargs.setdefault("nabla_threshold", float(nabla.get("P", 0.8)))
        if all(key in nabla for key in ("wT", "wH", "wW")):
            kwargs.setdefault("nabla_window", (int(nabla["wT"]), int(nabla["wH"]), int(nabla["wW"])))
    return kwargs


def vae_kwargs(config: dict[str, Any]) -> dict[str, Any]:
    """Diffusers constructor arguments from a KVAE config: nested (`encoder_config`), flat, or Diffusers names."""
    if "encoder_block_out_channels" in config:
        return _public(config)
    if "encoder_config" in config and "decoder_config" in config:
        enc, dec = config["encoder_config"], config["decoder_config"]
        dec_ch, dec_mult = dec["ch"], dec["ch_mult"]
    elif "ch" in config and "decoder_ch" in config:
        enc = config
        dec_ch, dec_mult = config["decoder_ch"], config["decoder_ch_mult"]
    else:
        raise KeyError("neither encoder_config/decoder_config nor the flat ch/decoder_ch fields")
    return {
        "latent_channels": int(enc["z_channels"]),
        "encoder_block_out_channels": tuple(int(enc["ch"] * m) for m in enc["ch_mult"]),
        "decoder_block_out_channels": tuple(int(dec_ch * m) for m in dec_mult),
        "layers_per_block": int(enc["num_res_blocks"]),
        "temporal_compression_ratio": int(enc.get("temporal_compress_times", 4)),
        "temporal_compression_start_level": int(enc.get("temporal_compress_start_level", 1)),
        "scaling_factor": float(config["scaling_factor"]),
    }


def latent_upscaler_kwargs(config: dict[str, Any]) -> dict[str, Any]:
    """Diffusers constructor arguments from the bank config (a `models` list with a 4x and a 2x entry)."""
    if "models" not in config:
        return _public(config)
    entries = {}
    for entry in config["models"]:
        model = entry.get("model", entry)
        scale = entry.get("target_scale") or ("2x" if model.get("enable_x2_entry") else "4x")
        entries[str(scale)] = model
    if set(entries) != {"2x", "4x"}:
        raise KeyError(f"models must hold a 2x and a 4x entry, found {sorted(entries)}")
    x4, x2 = entries["4x"], entries["2x"]
    kwargs = {
        "in_channels": int(x4["in_channels"]),
        "stage_channels": tuple(int(c) for c in x4["stage_channels"]),
        "num_pre_blocks": int(x4["num_pre_blocks"]),
        "num_mid_blocks": int(x4["num_mid_blocks"]),
        "num_post_blocks": int(x4["num_post_blocks"]),
        "num_x2_adapter_blocks": int(x2.get("x2_adapter_blocks", 2)),
        # The released bank stores the 2x model at index 0 and the 4x model at index 1.
        "scales": (2, 4),
    }
    if "scaling_factor" in config:
        kwargs["scaling_factor"] = float(config["scaling_factor"])
    return kwargs


# ---------------------------------------------------------------------------------------------------- validation


def _check_weights_file(folder: Path, component: str, required: bool = True) -> Path | None:
    """The component's safetensors file; None when it is absent and not `required` (a bundle of configs only)."""
    if not folder.is_dir():
        raise BundleError(f"{component}: component folder {folder} is missing")
    pickled = sorted(p.name for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickled:
        raise BundleError(
            f"{component}: refusing pickled weights {pickled} in {folder}; only {WEIGHTS} (safetensors) is loaded, "
            "since unpickling can run arbitrary code"
        )
    weights = folder / WEIGHTS
    if not weights.is_file():
        if not required:
            return None
        raise BundleError(f"{component}: {weights} is missing")
    return weights


def weights_present(path: Path) -> bool:
    """Whether every component of the bundle folder has its weight file (a plan needs none of them)."""
    return all((path / component / WEIGHTS).is_file() for component in COMPONENTS)


def _check_tensors(component: str, model_cls: Any, kwargs: dict[str, Any], weights: Path) -> None:
    """Every tensor of the file must exist in the architecture with the same shape, and vice versa."""
    import torch

    with torch.device("meta"):
        model = model_cls(**kwargs)
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    try:
        with safe_open(str(weights), framework="pt") as handle:
            found = {name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()}
    except Exception as err:  # noqa: BLE001 - a corrupt header shows up as many error types
        raise BundleError(f"{component}: {weights} is not a readable safetensors file ({err})") from None
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    mismatched = sorted(n for n in set(expected) & set(found) if expected[n] != found[n])
    if missing or unexpected or mismatched:
        details = []
        if missing:
            details.append(f"{len(missing)} missing (e.g. {missing[0]})")
        if unexpected:
            details.append(f"{len(unexpected)} unexpected (e.g. {unexpected[0]})")
        if mismatched:
            name = mismatched[0]
            details.append(f"{len(mismatched)} of another shape (e.g. {name}: {found[name]} vs {expected[name]})")
        raise BundleError(
            f"{component}: weights do not match the architecture in its config.json: {'; '.join(details)}"
        )


def _check_head(out_visual_dim: int, in_visual_dim: int, scheduler: dict[str, Any]) -> None:
    scheduler_class = scheduler.get("_class_name")
    if scheduler_class == PIFLOW:
        n_grid = int(scheduler.get("n_grid", 10))
        if out_visual_dim != n_grid * in_visual_dim:
            raise BundleError(
                f"transformer: a PiFlow scheduler needs a {n_grid * in_visual_dim}-wide head "
                f"(n_grid {n_grid} x {in_visual_dim}), the transformer has {out_visual_dim}"
            )
    elif scheduler_class == FLOW_EULER:
        if out_visual_dim != in_visual_dim:
            raise BundleError(
                f"transformer: its head is {out_visual_dim} wide (a PiFlow-distilled head) but the bundle's scheduler "
                f"is {FLOW_EULER}; this is a known broken revision of the non-distilled repository. Use the distilled "
                f"model ({DEFAULT_MODEL}) instead"
            )
    else:
        raise BundleError(
            f"scheduler: unsupported scheduler class {scheduler_class!r}; expected {PIFLOW} or {FLOW_EULER}"
        )


FINGERPRINT_SAMPLES = 64
FINGERPRINT_BLOCK = 64 << 10


_FINGERPRINTED = [MODEL_INDEX, "scheduler/scheduler_config.json", *(f"{c}/config.json" for c in COMPONENTS)]


def fingerprint(path: Path) -> str:
    """Content identity of a local bundle, so renames keep it and new weights change it.

    Hashes the configs, each weights file's header and size, and 64 evenly spaced 64 KiB blocks of its tensor data
    (4 MiB a file): retrained or edited weights change bytes everywhere, and reading all 7 GB on every plan would
    cost a minute. Hashed once per process and version of the files (as `storage.source_info` hashes a source): an
    archive or the HTTP server plans every clip with the same bundle.
    """
    return _fingerprint(path, _file_versions(path))


def _file_versions(path: Path) -> tuple[tuple[str, int, int, int] | None, ...]:
    """Size, modification time and inode of each file the fingerprint reads: another version of any changes these."""
    versions: list[tuple[str, int, int, int] | None] = []
    for name in [*_FINGERPRINTED, *(f"{c}/{WEIGHTS}" for c in COMPONENTS)]:
        try:
            stat = (path / name).stat()
        except OSError:
            versions.append(None)
            continue
        versions.append((name, stat.st_size, stat.st_mtime_ns, stat.st_ino))
    return tuple(versions)


@functools.lru_cache(maxsize=32)
def _fingerprint(path: Path, versions: tuple[tuple[str, int, int, int] | None, ...]) -> str:
    return _hash_bundle(path)


def _hash_bundle(path: Path) -> str:
    digest = hashlib.sha256()
    for name in _FINGERPRINTED:
        file = path / name
        digest.update(name.encode() + (file.read_bytes() if file.is_file() else b"-"))
    for component in COMPONENTS:
        weights = path / component / WEIGHTS
        if not weights.is_file():
            continue
        size = weights.stat().st_size
        digest.update(f"{component}:{size}".encode())
        with weights.open("rb") as handle:
            header_len = int.from_bytes(handle.read(8), "little")
            digest.update(handle.read(min(header_len, 64 << 20)))
            data_start = 8 + header_len
            span = max(0, size - data_start - FINGERPRINT_BLOCK)
            for i in range(FINGERPRINT_SAMPLES):
                handle.seek(data_start + span * i // max(1, FINGERPRINT_SAMPLES - 1))
                digest.update(handle.read(FINGERPRINT_BLOCK))
    return digest.hexdigest()[:16]


class _PlannedBundle(BaseModel):
    model_config = ConfigDict(arbitrary_types_allowed=True)

    path: Path
    component_kwargs: dict[str, dict[str, Any]]  # each component's `from_pretrained` arguments
    scheduler_config: dict[str, Any]
    info: BundleInfo


def locate_bundle(
    model: str, revision: str | None = None, model_id: str | None = None, weights: bool = True, tensors: bool = True
) -> _PlannedBundle:
    """Find and validate a bundle by repo id or folder, without reading any weight data.

    The released repo defaults to its pinned revision. A repo keeps its id as identity; a local copy is identified by
    its content fingerprint unless `model_id` gives it the identity of its origin. Without `weights`, the configs
    are enough (a plan): weight files are neither downloaded nor required, and those present are still checked.
    Without `tensors`, the weight files' tensors are not checked against the architecture (`inspect_bundle`).
    """
    local = is_local(model)
    if revision is None and not local and model == DEFAULT_MODEL:
        revision = DEFAULT_REVISION
    path = resolve_bundle_path(model, revision, weights)
    model_id = model_id or (None if local else model)
    return inspect_bundle(path, model_id=model_id, revision=revision, weights=weights, tensors=tensors)


def model_traits(info: BundleInfo) -> ModelTraits:
    """What planning needs to know of the model."""
    return ModelTraits(tile_sizes=info.tile_sizes, scheduler=info.scheduler, trained_steps=info.trained_steps)


# (folder, fingerprint, component) whose weights were found to match the architecture: building the three models on
# the meta device and reading their headers takes seconds, and its answer changes only with the bundle's content.
_MATCHING_WEIGHTS: set[tuple[Path, str, str]] = set()


def inspect_bundle(
    path: Path, model_id: str | None = None, revision: str | None = None, weights: bool = True, tensors: bool = True
) -> _PlannedBundle:
    """Validate a bundle folder without reading any weight data; the weights against the architecture once per
    content (`fingerprint`) in a process. Without `weights`, a component may lack its weight file.

    Checking the tensors builds each model on the meta device, which imports torch and diffusers (seconds). Without
    `tensors`, they are left to the process that loads the model (a warm worker), so that a client that only plans
    and submits imports neither; everything else, and the identity, is the same."""
    print_fp = fingerprint(path)
    index = _read_json(path / MODEL_INDEX, "model_index")
    for component in (*COMPONENTS, "scheduler"):
        if component not in index:
            raise BundleError(f"{component}: not listed in {path / MODEL_INDEX}")
    scheduler = _read_json(path / "scheduler" / "scheduler_config.json", "scheduler")
    translators = {"transformer": transformer_kwargs, "vae": vae_kwargs, "latent_upscaler": latent_upscaler_kwargs}
    kwargs: dict[str, dict[str, Any]] = {}
    raw: dict[str, dict[str, Any]] = {}
    for component in COMPONENTS:
        weights_file = _check_weights_file(path / component, component, required=weights)
        raw[component] = _read_json(path / component / "config.json", component)
        try:
            kwargs[component] = translators[component](raw[component])
        except (KeyError, TypeError, ValueError) as err:
            raise BundleError(f"{component}: config.json cannot be read as this model ({err})") from None
        if not tensors or weights_file is None or (path, print_fp, component) in _MATCHING_WEIGHTS:
            continue
        try:
            _check_tensors(component, _classes()[component], kwargs[component], weights_file)
        except TypeError as err:
            raise BundleError(f"{component}: config.json has arguments this model does not take ({err})") from None
        _MATCHING_WEIGHTS.add((path, print_fp, component))
    dit = kwargs["transformer"]
    _check_head(dit.get("out_visual_dim", 640), dit.get("in_visual_dim", 64), scheduler)
    is_piflow = scheduler["_class_name"] == PIFLOW
    # The released config has no `tile_sizes`: the class default, the release's tiles, applies.
    tile_sizes = dit.get("tile_sizes") or RESOLUTIONS
    sr_params = raw["transformer"].get("sr_params") or {}
    info = BundleInfo(
        model_id=model_id or f"local:{print_fp}",
        revision=revision,
        path=str(path),
        scheduler=scheduler["_class_name"],
        trained_steps=int(scheduler.get("nfe", 2)) if is_piflow else 4,
        lq_noise_scale=float(sr_params.get("lq_noise_scale", DEFAULT_LQ_NOISE_SCALE)),
        tile_sizes=tuple(tuple(int(v) for v in hw) for hw in tile_sizes),
        fingerprint=print_fp,
        latent_channels=int(kwargs["vae"].get("latent_channels", DEFAULT_LATENT_CHANNELS)),
    )
    return _PlannedBundle(path=path, component_kwargs=kwargs, scheduler_config=scheduler, info=info)


def _scheduler_from_config(cls: Any, config: dict[str, Any]) -> Any:
    """Build a scheduler from the keys its class takes; `nfe` and friends are read into `BundleInfo` instead."""
    accepted = set(inspect.signature(cls.__init__).parameters) - {"self"}
    return cls.from_config({k: v for k, v in config.items() if k in accepted or k.startswith("_")})


@contextmanager
def _quiet(logger_name: str) -> Iterator[None]:
    """Silence a library's warnings for a call whose failure we report ourselves: the hub logs every retry, and
    diffusers warns about the released configs' native key names, which are translated above."""
    logger = logging.getLogger(logger_name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def compute_device(device: torch.device) -> torch.device:
    """`cuda` as the GPU it means (`cuda:N`), so that device comparisons in offload hooks hold."""
    import torch

    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def default_dtype(device: torch.device) -> torch.dtype:
    """bf16 on GPUs, as the official pipeline runs; fp32 on CPUs, where bf16 convolutions are slow."""
    import torch

    return torch.bfloat16 if device.type == "cuda" else torch.float32


def load_bundle(
    model: str = DEFAULT_MODEL,
    revision: str | None = None,
    *,
    model_id: str | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
) -> ModelBundle:
    """Load and validate a bundle from a Hugging Face repo id (with revision) or a local folder."""
    import torch

    from k6vsr_core.device.determinism import apply_kernel_settings

    # Every process that computes loads its model here, before the model's first kernel (k6vsr_core.device.determinism).
    apply_kernel_settings()
    planned = locate_bundle(model, revision, model_id)
    path = planned.path
    device = torch.device(device)
    dtype = dtype or default_dtype(device)
    classes = _classes()
    loaded = {}
    with _quiet("diffusers"):
        for component in COMPONENTS:
            cls = classes[component]
            try:
                # fp32 is the checkpoint's own precision: asking for it would only force diffusers' accelerate path.
                dtype_arg = {} if dtype == torch.float32 else {"torch_dtype": dtype}
                module = cls.from_pretrained(
                    str(path),
                    subfolder=component,
                    use_safetensors=True,
                    **dtype_arg,
                    **planned.component_kwargs[component],
                )
            except Exception as err:  # noqa: BLE001 - name the component whatever diffusers raised
                raise BundleError(f"{component}: loading failed ({type(err).__name__}: {err})") from None
            loaded[component] = module.to(device).eval().requires_grad_(False)
        scheduler = _scheduler_from_config(classes[planned.info.scheduler], planned.scheduler_config)
    return ModelBundle(
        loaded["transformer"], loaded["vae"], loaded["latent_upscaler"], scheduler, planned.info, compute_device(device)
    )
