"""The run manifest and the run key: what a run is, and the name that identifies it.

The key is derived from the source's content hash, every parameter that changes the output, the model identity
(repo and revision, or a content fingerprint of a local bundle) and the stage-format version; so the same clip with
the same parameters always maps to the same run, and a change to any of them starts a fresh one.
"""

from __future__ import annotations

import functools
import hashlib
import json
import time
from importlib import metadata
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from k6vsr_core.contract.params import UpscaleParams
from k6vsr_core.contract.plan import ClipPlan
from k6vsr_core.device.compute import ComputeProfile
from k6vsr_core.model.bundle import BundleInfo
from k6vsr_core.model.networks import identity_mark

# Bump whenever what a stage stores, or how, changes: old runs then stop matching instead of being misread.
STAGE_FORMAT_VERSION = 4


class SourceInfo(BaseModel):
    path: str
    sha256: str
    size: int


class RunManifest(BaseModel):
    run_key: str
    format_version: int = STAGE_FORMAT_VERSION
    source: SourceInfo
    params: UpscaleParams
    model: BundleInfo
    plan: ClipPlan
    seeds: list[int]
    has_audio: bool
    rotation: int = 0  # the source's display rotation, written into the output
    # A latent run: the exact frame rate of the latent (`24`, `30000/1001`); the source is then its safetensors file.
    latent_fps: str | None = None
    versions: dict[str, str]
    compute: ComputeProfile  # how every process computes this run's stages
    created_at: float = Field(default_factory=time.time)


def source_info(path: str | Path) -> SourceInfo:
    """The source's identity. Hashed once per process and file version: planning, the flow and the CLI all ask."""
    path = Path(path).resolve()
    stat = path.stat()
    digest = _sha256(str(path), stat.st_size, stat.st_mtime_ns, stat.st_ino)
    return SourceInfo(path=str(path), sha256=digest, size=stat.st_size)


@functools.lru_cache(maxsize=256)
def _sha256(path: str, size: int, mtime_ns: int, inode: int, block: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(block):
            digest.update(chunk)
    return digest.hexdigest()


# Output controls added after runs were first keyed: left out of the key while at the value runs were keyed
# without (their default then), so the runs of the contract's file keep their keys.
_LATER_FIELDS = ("codec", "crf", "preset", "pix_fmt", "audio", "fps_mode", "windows", "precision")
# Where that value is no longer the default: scene windows became the default after runs of even windows were keyed
# without the field, so even windows keep those keys and scene windows keep theirs (`"windows": "scenes"`).
_KEYED_WITHOUT = {"windows": "even"}


def output_params(params: UpscaleParams) -> dict[str, Any]:
    """The request fields that change the output bytes (all of them), and the content of a separate audio file."""
    values = params.model_dump(mode="json")
    defaults = {**UpscaleParams().model_dump(mode="json"), **_KEYED_WITHOUT}
    for name in _LATER_FIELDS:
        if values[name] == defaults[name]:
            del values[name]
    # What deinterlacing does to the frames is keyed instead (`run_key`'s `deinterlace`): the words asked say nothing
    # of it until the source's fields are known, and `auto` and `off` read a progressive source's frames alike.
    del values["deinterlace"]
    if params.audio_file is not None:
        values["audio_sha256"] = source_info(params.audio_file).sha256
    return values


def run_key(
    source_sha256: str,
    params: UpscaleParams,
    model_identity: str,
    latent_fps: str | None = None,
    deinterlace: str | None = None,
    on_timestamps: bool = False,
    depth: int = 8,
) -> str:
    """The run's name, the one recipe of it: the source's content, the request's output fields, the model's identity
    (with the mark of other network calls while they are injected, `k6vsr_core.model.networks`, so their runs never
    share
    a store's items with the model's) and the store's format. `latent_fps` (a latent source's frame rate) and
    `deinterlace` (the field order a plan deinterlaces its frames with, `ClipPlan.deinterlace`) are keyed only when
    given, so the runs of progressive videos keep their keys; so is `on_timestamps`, a variable-rate source's frames
    chosen on their timestamps (`ClipPlan.kept`), which are other frames than the constant-rate rule's; and `depth`
    16, the 16-bit path's frames (`ClipPlan.depth`), which a 10-bit source's runs before it read at 8 bits."""
    fields: dict[str, Any] = {
        "source": source_sha256,
        "params": output_params(params),
        "model": model_identity + identity_mark(),
        "format": STAGE_FORMAT_VERSION,
    }
    if latent_fps is not None:
        fields["latent_fps"] = latent_fps
    if deinterlace is not None:
        fields["deinterlace"] = deinterlace
    if on_timestamps:
        fields["frames_on"] = "timestamps"
    if depth != 8:
        fields["depth"] = depth
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:24]


def library_versions() -> dict[str, str]:
    versions = {}
    for name in ("k6vsr", "torch", "diffusers", "zarr", "av", "prefect", "numpy"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "absent"
    return versions
