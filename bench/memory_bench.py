"""k6vsr memory benchmark: W1 under each memory budget, and the chunked KVAE against the whole-tile KVAE, on a GPU.

W1 (768x512, 121 frames, x2, 9 tiles) with the full-size random-weight bundle of bench/run_bench.py. Each mode runs
in a process of its own, so that nothing one leaves on the GPU counts against the next:

    default  --memory auto on the whole card (it picks fast), compiled: one warm-up chunk and tile decode, then the
             W1 request hot, end to end (source decode ... MP4 written)
    24g      the same under torch.cuda.set_per_process_memory_fraction(24 GiB / card): allocating past it fails
    16g      the same under 16 GiB
    auto48, auto24, auto16
             --memory auto on a card of 48, 24 or 16 GiB (the same fraction): what the defaults do on smaller cards
    fast-whole, fast-3, fast-2, fast-1
             the `fast` budget with the KVAE decode forced to its own call (the default before chunking) or to 3, 2
             or 1 latent frames a call: the same-session references for the default's speed and memory
    decode   one denoised W1 tile decoded eagerly by the KVAE's own call and in chunks of 3, 2 and 1 latent frames
             (pixel differences, time and peak memory of each), and the clip encoded both ways

Every mode records its budget (what `choose_budget` chose and why, its estimate), wall time with the per-stage
split, torch.cuda.max_memory_reserved / max_memory_allocated overall and per stage (encode, denoise, decode), and
its output MP4; the parent compares each output with the default's. Everything goes to <out>/memory-bench.json as
it arrives, and a summary with the targets to stdout.

    python3 bench/memory_bench.py [--modes default,24g,16g,decode] [--eager] [--deadline 570] [--out $OUT]

`--tiny` runs the same on the CPU with the tiny bundle and a one-frame clip (a smoke test of this script).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "bench"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import run_bench  # noqa: E402
import torch  # noqa: E402

GIB = run_bench.GIB
MODES = ("default", "24g", "16g", "auto48", "auto24", "auto16", "decode", "fast-whole", "fast-3", "fast-2", "fast-1")
# `fast` with the decode chunk forced (None: the KVAE's own call).
FORCED_DECODE = {"fast-whole": None, "fast-3": 3, "fast-2": 2, "fast-1": 1}
# `auto` on a smaller card, simulated by the process's memory fraction.
SMALLER_CARDS = {"auto48": 48 * GIB, "auto24": 24 * GIB, "auto16": 16 * GIB}
CAPS = {"24g": 24 * GIB, "16g": 16 * GIB, **SMALLER_CARDS}
# What the modes are held to (the low-VRAM and memory-budget issues); today's default is bench/RESULTS.md's W1 dense
# hot figure. The default's time is judged against `fast-whole`, the whole-tile decode, of the same call.
TODAY_W1_S = 55.69
TARGETS = {
    "default_reserved_gib": 32.0,
    "default_time_vs_whole_decode": 1.02,
    "24g_time_vs_default": 1.2,
    "smaller_card_time_vs_default": 1.15,  # auto48 and auto24; auto16 need only run
}
# Rough seconds each child needs with a warm compile cache (a cold one adds about three minutes to the first).
COST = {
    "default": 150,
    "24g": 110,
    "16g": 120,
    "decode": 60,
    **dict.fromkeys(FORCED_DECODE, 120),
    **dict.fromkeys(SMALLER_CARDS, 120),
}


def bench_for(args: argparse.Namespace, label: str) -> run_bench.Bench:
    argv = ["--work", args.work, "--out", str(Path(args.work) / f"memory-{label}"), "--label", label]
    return run_bench.Bench(run_bench.parse(argv + (["--tiny"] if args.tiny else [])))


def plan_of(bench: run_bench.Bench) -> Any:
    from k6vsr_core.contract.plan import ModelTraits, make_plan
    from k6vsr_core.model.bundle import inspect_bundle

    info = inspect_bundle(bench.bundle_path).info
    traits = ModelTraits(tile_sizes=info.tile_sizes, scheduler=info.scheduler, trained_steps=info.trained_steps)
    width, height, frames, _ = bench.workloads["W1"]
    return make_plan((height, width), frames, 24, bench.params("W1"), traits)


def gib(value: float) -> float:
    return round(value / GIB, 2)


class StagePeaks:
    """Peak allocated and reserved memory of every encode, denoise and decode, by wrapping the stage functions.

    The runner calls them in turn and nothing else touches the GPU, so the largest stage peak is the run's peak.
    """

    def __init__(self, device: torch.device) -> None:
        from k6vsr_core.model import stages

        self.device = device
        self.peaks: dict[str, dict[str, float]] = {}
        self.originals = {name: getattr(stages, name) for name in ("encode_clip", "denoise_chunk", "decode_tile")}
        for name, original in self.originals.items():
            setattr(stages, name, self._wrap(name, original))

    def _wrap(self, name: str, original: Any) -> Any:
        def measured(*args: Any, **kwargs: Any) -> Any:
            run_bench.reset_peak(self.device)
            result = original(*args, **kwargs)
            run_bench.sync(self.device)
            if self.device.type == "cuda":
                seen = self.peaks.setdefault(name, {"alloc_gib": 0.0, "reserved_gib": 0.0})
                seen["alloc_gib"] = max(seen["alloc_gib"], gib(torch.cuda.max_memory_allocated(self.device)))
                seen["reserved_gib"] = max(seen["reserved_gib"], gib(torch.cuda.max_memory_reserved(self.device)))
            return result

        return measured

    def overall(self) -> dict[str, float]:
        if not self.peaks:
            return {}
        return {key: max(p[key] for p in self.peaks.values()) for key in ("alloc_gib", "reserved_gib")}

    def remove(self) -> None:
        from k6vsr_core.model import stages

        for name, original in self.originals.items():
            setattr(stages, name, original)


# ---------------------------------------------------------------------------------------------------- children


def run_mode(args: argparse.Namespace, mode: str) -> dict[str, Any]:
    """One budget: choose it as a worker would, load, compile, warm, then W1 hot end to end."""
    from k6vsr_core.model.bundle import load_bundle
    from k6vsr_core.model.fast import compile_bundle
    from k6vsr_core.model.memory import apply_budget, budget_for
    from k6vsr_core.model.runner import upscale

    bench = bench_for(args, mode)
    device = bench.device
    record: dict[str, Any] = {"mode": mode}
    if device.type == "cuda" and mode in CAPS:
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(CAPS[mode] / total, device.index or 0)
        record["cap_gib"] = gib(CAPS[mode])
    plan = plan_of(bench)
    asked = "auto" if mode == "default" or mode in SMALLER_CARDS else "fast" if mode in FORCED_DECODE else mode
    # As every path chooses it (k6vsr_core.model.memory.budget_for): from the card, capped above, and the plan.
    budget = budget_for(asked, device, plan)  # type: ignore[arg-type]
    if mode in FORCED_DECODE:
        budget = budget.model_copy(update={"decode_chunk": FORCED_DECODE[mode], "reason": f"forced by {mode}"})
    record["budget"] = {**budget.model_dump(mode="json", exclude={"footprint"}), "summary": budget.summary()}
    started = time.perf_counter()
    bundle = load_bundle(str(bench.bundle_path), device=device)
    compile_bundle(bundle, compiled=not args.eager)
    apply_budget(bundle, budget)
    record["load_s"] = round(time.perf_counter() - started, 2)
    record["warm_s"] = round(run_bench.warm_shapes(bench, bundle, "W1", "dense"), 2)
    peaks = StagePeaks(device)
    output = Path(args.work) / f"memory-{mode}.mp4"
    run_bench.reset_peak(device)
    started = time.perf_counter()
    try:
        result = upscale(bench.clip("W1"), output, bundle, bench.params("W1"))
    finally:
        peaks.remove()
    record["seconds"] = round(time.perf_counter() - started, 2)
    record["timings"] = {stage: round(s, 3) for stage, s in result.timings.items()}
    record["stage_peaks"] = peaks.peaks
    record.update({f"peak_{k}": v for k, v in peaks.overall().items()})
    if device.type == "cuda":
        record["max_memory_reserved_gib"] = gib(torch.cuda.max_memory_reserved(device))
    record["output"] = str(output)
    return record


def run_decode(args: argparse.Namespace) -> dict[str, Any]:
    """Eager KVAE on one denoised W1 tile: the KVAE's own call against chunks of 3, 2 and 1 latent frames."""
    from k6vsr_core.model import kvae, stages
    from k6vsr_core.model.bundle import load_bundle, model_traits
    from k6vsr_core.model.memory import frames_per_call
    from k6vsr_core.model.runner import read_source, read_window

    bench = bench_for(args, "decode")
    device = bench.device
    bundle = load_bundle(str(bench.bundle_path), device=device)
    vae = bundle.vae
    decoded = read_source(bench.clip("W1"), bench.params("W1"), model_traits(bundle.info))
    plan = decoded.plan
    video = stages.prepare_window(read_window(decoded, plan.windows[0]), plan, plan.windows[0])
    pixels = (video.to(device).permute(1, 0, 2, 3).unsqueeze(0).float() / 128.0 - 1.0).to(vae.dtype)
    record: dict[str, Any] = {"tile": list(plan.grid.base), "frames": plan.window_frames, "encode": {}, "decode": {}}
    with torch.no_grad():
        whole_latent = kvae.encode(vae, pixels, None)
        for chunk in (3, 2, 1):
            latent = kvae.encode(vae, pixels, chunk)
            record["encode"][str(chunk)] = {"max_abs_diff": float((latent - whole_latent).abs().max())}
        latent_clip = (whole_latent * vae.config.scaling_factor).float().cpu()
        chunk0 = plan.chunks[0]
        tile_latent = stages.denoise_chunk(bundle, stages.cut_tiles(latent_clip, plan, chunk0.tiles), chunk0, plan)[0]
        z = (tile_latent.unsqueeze(0).to(device) / vae.config.scaling_factor).to(vae.dtype)
        reference = None
        for chunk in (None, 3, 2, 1):
            run_bench.reset_peak(device)
            before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
            started = time.perf_counter()
            tile = kvae.decode(vae, z, chunk, stages.to_pixels)
            run_bench.sync(device)
            entry: dict[str, Any] = {"seconds": round(time.perf_counter() - started, 3), **run_bench.peak(device)}
            if device.type == "cuda":
                # What k6vsr_core.model.memory's decode_per_pixel_frame should be: activations per pixel and frame of
                # one
                # call, the causal caches counted as one more frame.
                activations = torch.cuda.max_memory_allocated(device) - before
                frames = frames_per_call(chunk, plan.window_frames) + 1
                entry["activations_gib"] = gib(activations)
                entry["bytes_per_pixel_frame"] = round(activations / (plan.grid.base[0] * plan.grid.base[1] * frames))
            if reference is None:
                reference = tile
            else:
                diff = (tile.int() - reference.int()).abs()
                entry.update(
                    max_abs_diff=int(diff.max()),
                    values_differing=int((diff > 0).sum()),
                    fraction_differing=float((diff > 0).float().mean()),
                )
            record["decode"]["whole" if chunk is None else str(chunk)] = entry
    return record


# ---------------------------------------------------------------------------------------------------- parent


def summarize(results: dict[str, Any]) -> dict[str, Any]:
    """Each measured mode against its targets: its peak under its cap (32 GiB for the default), and its time against
    the default's (the default's against the whole-tile decode's) where the target names one."""
    modes = results["modes"]
    checks: dict[str, Any] = {}
    default = modes.get("default", {})
    whole = modes.get("fast-whole", {})
    for mode in ("default", *CAPS):
        entry = modes.get(mode, {})
        if "seconds" not in entry:
            continue
        cap = CAPS.get(mode, TARGETS["default_reserved_gib"] * GIB)
        check: dict[str, Any] = {
            "budget": entry["budget"]["budget"],
            "reserved_gib": entry.get("peak_reserved_gib"),
            "cap_gib": gib(cap),
            "seconds": entry["seconds"],
            "estimate_gib": gib(entry["budget"]["estimate"] or 0),
            "reserved_ok": (entry.get("peak_reserved_gib") or 0) <= gib(cap),
        }
        if mode == "default":
            check["vs_today"] = round(entry["seconds"] / TODAY_W1_S, 3)
            if "seconds" in whole:
                check["vs_whole_decode"] = round(entry["seconds"] / whole["seconds"], 3)
                check["time_ok"] = check["vs_whole_decode"] <= TARGETS["default_time_vs_whole_decode"]
        elif "seconds" in default:
            check["vs_default"] = round(entry["seconds"] / default["seconds"], 3)
            goal = {"24g": TARGETS["24g_time_vs_default"], "auto48": TARGETS["smaller_card_time_vs_default"]}
            goal["auto24"] = TARGETS["smaller_card_time_vs_default"]
            if mode in goal:
                check["time_ok"] = check["vs_default"] <= goal[mode]
        checks[mode] = check
    return checks


def run_child(args: argparse.Namespace, mode: str, left: float) -> dict[str, Any]:
    result_path = Path(args.work) / f"memory-{mode}.json"
    result_path.unlink(missing_ok=True)
    command = [sys.executable, __file__, "--child", mode, "--work", args.work, "--result", str(result_path)]
    command += ["--tiny"] * args.tiny + ["--eager"] * args.eager
    started = time.perf_counter()
    try:
        done = subprocess.run(command, timeout=max(1.0, left), capture_output=True, text=True)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {left:.0f} s"}
    if result_path.exists():
        return {**json.loads(result_path.read_text()), "child_s": round(time.perf_counter() - started, 1)}
    return {"error": f"exit code {done.returncode}", "log": (done.stdout + done.stderr)[-4000:]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, in this order: {', '.join(MODES)}")
    parser.add_argument("--eager", action="store_true", help="no torch.compile (the default compiles, as --compile)")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke mode: tiny bundle and a one-frame clip")
    parser.add_argument("--work", default=os.environ.get("K6VSR_BENCH_WORK", "/tmp/k6vsr-bench"))
    parser.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "bench" / "out"))
    parser.add_argument("--deadline", type=float, default=570.0, help="seconds for everything; later modes are skipped")
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    # Before CUDA starts, in the parent and so in every child: as bench/run_bench.py measures.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    if args.child:
        torch.manual_seed(0)
        if torch.cuda.is_available() and not args.tiny:
            from k6vsr_core.device.compile_cache import enable_compile_cache

            enable_compile_cache()
        try:
            record = run_decode(args) if args.child == "decode" else run_mode(args, args.child)
        except Exception as err:  # noqa: BLE001 - reported to the parent, which goes on with the next mode
            import traceback

            record = {"error": f"{type(err).__name__}: {err}"[:600], "traceback": traceback.format_exc()[-3000:]}
        Path(args.result).write_text(json.dumps(record, indent=1, default=str))
        return 0
    started = time.monotonic()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        parser.error(f"unknown modes {unknown}; known: {', '.join(MODES)}")
    setup = bench_for(args, "setup")
    run_bench.ensure_bundle(setup)
    setup.clip("W1")
    if setup.device.type == "cuda":
        torch.cuda.empty_cache()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = "python3 bench/memory_bench.py " + " ".join(sys.argv[1:] if argv is None else argv)
    results: dict[str, Any] = {"env": setup.results["env"], "command": command.strip(), "modes": {}}

    def save() -> None:
        (out / "memory-bench.json").write_text(json.dumps(results, indent=1, default=str))

    for mode in modes:
        left = args.deadline - (time.monotonic() - started)
        if not args.tiny and left < COST[mode]:
            results["modes"][mode] = {"skipped": f"deadline: {left:.0f} s left, about {COST[mode]} s needed"}
        else:
            results["modes"][mode] = run_child(args, mode, left)
        print(
            f"[{time.monotonic() - started:6.1f}s] {mode}: {json.dumps(results['modes'][mode], default=str)[:1500]}",
            flush=True,
        )
        save()
    reference = results["modes"].get("default", {}).get("output")
    for mode in CAPS:
        output = results["modes"].get(mode, {}).get("output")
        if reference and output:
            results["modes"][mode]["vs_default"] = run_bench.frames_diff(Path(output), Path(reference))
    results["targets"] = summarize(results)
    save()
    print(json.dumps(results["targets"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
