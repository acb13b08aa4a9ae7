"""What a command's flags ask for, turned into the run's inputs: the source (fetched where it is a URL), the model,
the store and the output folder, each checked before any work (the request: `entrypoints.request_inputs`)."""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from k6vsr_core.errors import UserFacingError
from service.runs import ModelSpec
from storage import default_store_root, parse_store_root
from storage.urls import fetch_source, is_url


def model_from(args: argparse.Namespace) -> ModelSpec:
    return ModelSpec(
        model=_absolute_if_local(args.model),
        revision=args.revision,
        model_id=args.model_id,
        device=getattr(args, "device", "auto"),
        compile=getattr(args, "compile", True),
        memory=args.memory,
    )


def _absolute_if_local(model: str) -> str:
    """An existing local folder as an absolute path, as every path leaving the command: warm workers and job
    processes resolve paths in their own working folder. A hub repo id stays as it is."""
    path = Path(model).expanduser()
    return str(path.resolve()) if path.exists() else model


def store_from(args: argparse.Namespace) -> str | Path:
    """`--store`: a folder (made absolute) or an object-store URL (`s3://bucket/prefix`); else K6VSR_STORE or the
    cache folder."""

    if not getattr(args, "store", None):
        return default_store_root()
    root = parse_store_root(args.store)
    return root.resolve() if isinstance(root, Path) else root


# Refuse an output folder with less free space than this plus a generous guess of the output's size.
MIN_FREE_BYTES = 1 << 20


def check_output_dir(path: Path, needed_bytes: int = 0) -> None:
    if path.exists() and not path.is_dir():
        raise UserFacingError(f"output directory {path} is a file")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UserFacingError(f"output directory {path} cannot be created: {err.strerror}") from None
    if not os.access(path, os.W_OK):
        raise UserFacingError(f"output directory {path} is not writable")
    try:
        free = shutil.disk_usage(path).free
    except OSError:
        return
    if free < needed_bytes + MIN_FREE_BYTES:
        raise UserFacingError(
            f"output directory {path} is on a full disk: {free} bytes free, about "
            f"{needed_bytes + MIN_FREE_BYTES} needed; free some space and rerun"
        )


def check_output_file(destination: Path, source: Path) -> None:
    if destination.is_dir():
        raise UserFacingError(f"output file {destination} is a directory")
    if destination.exists() and source.exists() and os.path.samefile(destination, source):
        raise UserFacingError(f"output file {destination} is the input file; pick another name or folder")


def estimated_output_bytes(plan: Any) -> int:
    """An upper guess of the MP4's size: an eighth of the raw RGB frames (H.264 at CRF 18 stays far below)."""
    height, width = plan.delivery_size
    return plan.num_frames * height * width * 3 // 8


@contextmanager
def local_input(args: argparse.Namespace) -> Iterator[tuple[argparse.Namespace, str | None]]:
    """The arguments with a source URL (video or `--latent`) replaced by a download of it, and the URL: the object is
    fetched once into a private folder, removed when the block ends, and read as that file (same bytes, same run
    key)."""

    url = next((given for given in (args.input, getattr(args, "latent", None)) if given and is_url(given)), None)
    if url is None:
        yield args, None
        return
    with tempfile.TemporaryDirectory(prefix="k6vsr-source-") as folder:
        local = str(fetch_source(url, Path(folder)))
        field = "input" if args.input == url else "latent"
        yield argparse.Namespace(**{**vars(args), field: local}), url
