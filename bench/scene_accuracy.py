"""Recall and precision of the scene-cut detector on the labelled synthetic set (tests/scene_set.py).

A true cut counts as found when the detector names a kept frame at most one frame from it; every other cut it names
(in a fade, a dissolve, a flash, a pan, or a second one near a true cut) is a false one. Prints one line per
category and the whole set, and with `--timing` the detection time per frame.

    PYTHONPATH=$PWD python bench/scene_accuracy.py [--work DIR] [--verbose]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import scene_set  # noqa: E402

from k6vsr_core.contract.scenes import source_cuts  # noqa: E402


def measure(folder: Path, verbose: bool = False) -> dict[str, tuple[int, int, int]]:
    """(hits, misses, false cuts) per category, and under 'all' for the whole set."""
    totals: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    for item in scene_set.write_set(folder):
        found = source_cuts(item.path, list(range(item.clip.num_frames)))
        counts = scene_set.match(item.clip.cuts, found)
        if verbose:
            print(f"{item.path.name:32s} truth {list(item.clip.cuts)} found {list(found)}")
        for key in (item.clip.category, "all"):
            totals[key] = [a + b for a, b in zip(totals[key], counts, strict=True)]
    return {key: (h, m, f) for key, (h, m, f) in totals.items()}


def rates(hits: int, misses: int, false: int) -> tuple[float, float]:
    recall = hits / (hits + misses) if hits + misses else 1.0
    precision = hits / (hits + false) if hits + false else 1.0
    return recall, precision


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, help="where the clips are written (kept; default: a temporary folder)")
    parser.add_argument("--verbose", action="store_true", help="print each clip's true and found cuts")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as temporary:
        folder = args.work or Path(temporary)
        started = time.perf_counter()
        totals = measure(folder, args.verbose)
        print(f"{'category':20s} {'cuts':>5s} {'found':>6s} {'false':>6s} {'recall':>7s} {'precision':>9s}")
        for key in sorted(totals, key=lambda k: (k == "all", k)):
            hits, misses, false = totals[key]
            recall, precision = rates(hits, misses, false)
            print(f"{key:20s} {hits + misses:5d} {hits:6d} {false:6d} {recall:7.3f} {precision:9.3f}")
        print(f"({time.perf_counter() - started:.1f} s, writing the clips included)")


if __name__ == "__main__":
    main()
