"""The clips of an archive: the files of a folder tree matching its globs, or a list of paths."""

from __future__ import annotations

import fnmatch
import os
from pathlib import Path

from k6vsr_core.errors import UserFacingError

VIDEO_GLOBS = (
    "*.mp4",
    "*.m4v",
    "*.mov",
    "*.mkv",
    "*.webm",
    "*.avi",
    "*.wmv",
    "*.flv",
    "*.mpg",
    "*.mpeg",
    "*.m2v",
    "*.ts",
    "*.mts",
    "*.m2ts",
    "*.mxf",
    "*.3gp",
    "*.ogv",
    "*.y4m",
)


def find_sources(
    input_dir: str | None, paths: list[str] | None, output_dir: Path, include: list[str], exclude: list[str]
) -> tuple[Path, list[Path]]:
    """The base folder the output tree mirrors, and the sources in order."""
    if paths:
        sources = [Path(p).expanduser().resolve() for p in paths]
        if input_dir:
            base = Path(input_dir).expanduser().resolve()
        else:
            base = Path(os.path.commonpath([str(s.parent) for s in sources]))
        return base, sources
    if not input_dir:
        raise UserFacingError("give input_dir (a folder or a file listing paths) or paths")
    base = Path(input_dir).expanduser().resolve()
    if base.is_file():
        return find_sources(None, read_path_list(base), output_dir, include, exclude)
    if not base.is_dir():
        raise UserFacingError(f"input folder {input_dir} does not exist")
    if output_dir == base:
        raise UserFacingError(
            f"the output folder {output_dir} is the input folder: outputs would be read as inputs "
            "by the next run; choose another folder (a subfolder of the input is fine)"
        )
    return base, scan_folder(base, include, exclude, skip=output_dir)


def scan_folder(
    input_dir: Path, include: list[str] | tuple[str, ...], exclude: list[str] | tuple[str, ...], skip: Path | None
) -> list[Path]:
    """Files under `input_dir` matching `include` and not `exclude`, sorted; hidden entries and `skip` left out."""
    found = []
    for folder, dirs, files in os.walk(input_dir):
        here = Path(folder)
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and (skip is None or here / d != skip))
        for name in sorted(files):
            if name.startswith("."):
                continue
            relative = (here / name).relative_to(input_dir).as_posix()
            if _matches(relative, include) and not _matches(relative, exclude):
                found.append(here / name)
    return found


def _matches(relative: str, globs: list[str] | tuple[str, ...]) -> bool:
    """Case-insensitive match of a glob against the relative path or the file name."""
    name = relative.rsplit("/", 1)[-1].lower()
    lowered = relative.lower()
    return any(fnmatch.fnmatchcase(lowered, g.lower()) or fnmatch.fnmatchcase(name, g.lower()) for g in globs)


def read_path_list(list_file: Path) -> list[str]:
    """One path per line; blank lines and `#` comments ignored; relative paths are relative to the list file."""
    paths = []
    for line in list_file.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            path = Path(line).expanduser()
            paths.append(str(path if path.is_absolute() else list_file.parent / path))
    return paths
