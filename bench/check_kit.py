"""What the device check's run sets share (`device_check.py` runs them, `same_bytes.py`, `streaming.py` and
`two_gpus.py` define them): the README's command as a run or an archive, the runs' rough costs, the output's md5,
the store's timeline lines, and `Check`, what a run set may ask of the check that runs it. The sets import this and
not `device_check`, so that no module of `bench/` imports itself back. The CPU benches of one run take their work
folder, tiny bundle and clip from here too (`tiny_inputs`).
"""

from __future__ import annotations

import hashlib
import json
import re
import shlex
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

ROOT = Path(__file__).resolve().parents[1]

# Rough seconds each run takes on an H200 with a warm compile cache (cold for oneshot-cold), at the speeds measured
# for the streaming issue, to skip what cannot finish in time (a run still going at the deadline is cut: exit 124);
# inmemory: the child's start, load, first and hot run (about 3 minutes more on a cold cache); archive-clip: per clip.
COST = {
    "oneshot-cold": 260,
    "oneshot": 140,  # 138.3 s warm cache (2026-12-03, 26f52be)
    "W2": 60,
    "workers-start": 90,  # with --model it also warms a default run's shapes: 72.5 s warm cache (2026-12-03)
    "workers-run": 90,  # 84.0 / 81.1 s (2026-12-03)
    "workers-stop": 10,  # 4.6 s
    "inmemory": 170,
    "multiwindow": 260,  # 249.9 s one-shot (2026-12-03)
    # A one-window preview one-shot of the three-window clip (about a warm one-shot W1 less its segments and mux),
    # then the whole run on its store (the multi-window run less one window's GPU work, about 46 s): not measured yet.
    "preview": 340,
    "archive-clip": 75,  # 98.6 s a clip at 2 clips (2026-12-03); the cross-clip queue aims at a clip's GPU work
    "memory": 560,  # bench/memory_bench.py's MEMORY_MODES, one process each
    # bench/two_gpus.py, on warm workers (start 48 s and a first W1 on them 130-164 s on the H200, 2026-12-01/02): gpu1
    # on one GPU, gpus on two (about 0.6x one: the 0.55x and the tiles a GPU waits for); W1: the mean of a
    # first and a hot run; kill: W1 with a tile computed again.
    "gpus-start": 60,
    "gpus-stop": 15,
    "gpu1-W1": 100,
    "gpus-W1": 60,
    "gpu1-multiwindow": 200,
    "gpus-multiwindow": 120,
    "gpu1-archive-clip": 60,
    "gpus-archive-clip": 35,
    "gpus-kill": 70,
}


def tiny_inputs(work: Path | None, prefix: str, frames: int, size: int) -> tuple[Path, Path, Path]:
    """A work folder (`work`, else a new one named with `prefix`), the tiny random bundle and a `size`-square
    synthetic clip of `frames` frames in it: each made once, and reused by a later run on the same folder."""
    from k6vsr_core.media.sample import make_sample_clip
    from k6vsr_core.model.tiny_bundle import make_tiny_bundle

    work = (work or Path(tempfile.mkdtemp(prefix=prefix))).resolve()
    work.mkdir(parents=True, exist_ok=True)
    bundle = work / "tiny-bundle"
    if not (bundle / "model_index.json").is_file():
        make_tiny_bundle(bundle)
    clip = work / f"clip-{frames}.mp4"
    if not clip.is_file():
        make_sample_clip(clip, width=size, height=size, num_frames=frames, fps=24)
    return work, bundle, clip


def readme_gpu_command() -> list[str]:
    """The command in the README's block after "With the released weights", split as a shell would."""
    text = (ROOT / "README.md").read_text()
    match = re.search(r"With the released weights.*?```bash\n(.+?)\n```", text, re.S)
    if match is None:
        raise SystemExit("README.md has no GPU command after 'With the released weights'")
    return shlex.split(match.group(1).strip())


def as_run(command: list[str], clip: Path, out_dir: Path) -> list[str]:
    """The README's command with its program run from this checkout and its clip and output folder substituted."""
    args = []
    for word in command[1:]:
        args.append(str(clip) if word == "clip.mp4" else str(out_dir) + "/" if word == "out/" else word)
    return [sys.executable, "-m", "entrypoints.cli", *args]


def as_archive(command: list[str], input_dir: Path, out_dir: Path) -> list[str]:
    """The README's command as an archive: `archive INPUT_DIR -o OUTPUT_DIR` with the same request flags."""
    argv = as_run(command, input_dir, out_dir)
    if argv[3] != "upscale":
        raise SystemExit(f"the README's GPU command is not `k6vsr upscale ...`: {shlex.join(command)}")
    return [*argv[:3], "archive", *argv[4:]]


def md5(path: Path) -> str:
    digest = hashlib.md5()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def timeline_lines(store: Path) -> Iterator[dict[str, Any]]:
    """Every line of every run's `timeline.jsonl` in `store`: stage, item, start, end (epoch seconds), process, peak."""
    for path in store.glob("runs/*/timeline.jsonl"):
        for line in path.read_text().splitlines():
            yield json.loads(line)


class Check(Protocol):
    """What a run set uses of `device_check.Check`: its arguments, folders and environment, the deadline, running
    and measuring commands, and the table's rows."""

    args: Any
    work: Path
    env: dict[str, str]
    rows: list[dict[str, Any]]

    def fits(self, key: str, times: int = 1) -> bool: ...

    def log(self, text: str) -> None: ...

    def left(self) -> float: ...

    def command(self, label: str, argv: list[str], env: dict[str, str] | None = None) -> dict[str, Any]: ...

    def upscale(
        self,
        label: str,
        workload: str,
        note: str,
        *,
        extra_env: dict[str, str] | None = None,
        extra_args: tuple[str, ...] = (),
        run: str | None = None,
        fresh: bool = True,
        wrap: Callable[[list[str]], list[str]] | None = None,
        group: str | None = None,
    ) -> dict[str, Any]: ...

    def measure(
        self,
        label: str,
        workload: str,
        note: str,
        argv: list[str],
        extra_env: dict[str, str],
        store: Path,
        out_dir: Path,
        group: str | None = None,
        add: bool = True,
    ) -> dict[str, Any]: ...

    def add_row(self, row: dict[str, Any]) -> None: ...

    @property
    def workloads(self) -> dict[str, tuple[int, int, int]]: ...

    def clip(self, workload: str) -> Path: ...

    def cli(self, label: str, *args: str) -> dict[str, Any]: ...

    def save(self) -> None: ...
