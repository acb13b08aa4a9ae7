"""k6vsr benchmark: diffusers' Kandinsky6SRPipeline side by side with our runner, on one clip and one set of weights.

On a GPU machine it builds the full released architecture with random weights (diffusers class defaults equal the
release), writes it once as a bundle in the released layout (so the real loading path is timed), and measures the
workloads of shared/spec/performance-baseline.md:

    W1  768x512 (WxH), 121 frames at 24 fps, x2: 9 tiles, 18 DiT calls
    W2  384x256, 33 frames, x2: one tile
    W3  W1 at x4: 25 tiles

Phases (run in the order given by --phases; each measurement is saved to <out>/results.json as soon as it is taken,
so a run cut short keeps what it measured):

    setup     write the bundle and the clips if missing, time `load_bundle`
    baseline  Kandinsky6SRPipeline (dense SDPA processor, eager, frames returned as a tensor) on W2 and W1
    plain     our runner on the plain path (eager, dense) on W2: the reference frames for the fast path
    density   NABLA's block density on W1 tile 0, exactly and eagerly, at P 0.8 and at the STA-only floor
    fast      compile_bundle; W2 first request (compile) and hot; W1 hot, per-stage split and peak memory; W3
    nabla     NABLA through compiled flex attention on W1 (block density counted) and at the STA-only floor
    multi     one worker process per GPU through the store-backed stage functions, 1 worker vs all workers on W1,
              output bytes compared
    flexprobe does diffusers' own flex dispatch (its kernel options) compile for NABLA's 64-token blocks?

`--tiny` runs every phase on the CPU with a tiny bundle and tiny clips (a smoke test of this script). `--report`
merges results.json files from several runs into one table and, with `--append`, appends it to bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import math
import os
import platform
import shlex
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

GIB = 1024**3
DATE = _dt.date.today().isoformat()

# Workloads: (width, height, frames, scale)
WORKLOADS_FULL = {"W1": (768, 512, 121, 2), "W2": (384, 256, 33, 2), "W3": (768, 512, 121, 4)}
WORKLOADS_TINY = {"W1": (96, 64, 1, 2), "W2": (64, 64, 1, 2), "W3": (96, 64, 1, 4)}

# Rough costs in seconds on one H200, used to skip what would not finish before --deadline.
COST = {
    "build": 150,
    "load": 40,
    "baseline-W2": 15,
    "baseline-W1": 80,
    "plain-W2": 15,
    "fast-W2-first": 240,
    "fast-W2-hot": 10,
    "fast-W1-warm": 120,
    "fast-W1-hot": 60,
    "fast-W3": 150,
    "nabla-warm": 120,
    "nabla-hot": 55,
    "sta-warm": 100,
    "sta-hot": 45,
    "multi": 250,
    "flexprobe": 60,
    "sdpa-probe": 5,
    "density": 60,
}


# ---------------------------------------------------------------------------------------------------- context


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.tiny = args.tiny
        self.started = time.monotonic()
        self.work = Path(args.work)
        self.out = Path(args.out)
        self.work.mkdir(parents=True, exist_ok=True)
        self.out.mkdir(parents=True, exist_ok=True)
        self.device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
        self.workloads = WORKLOADS_TINY if self.tiny else WORKLOADS_FULL
        self.bundle_path = self.work / ("bundle-tiny" if self.tiny else "bundle-full")
        self.label = args.label
        self.results: dict[str, Any] = {"env": environment(self.device), "command": args.command, "records": []}
        self._bundle: Any = None
        self.fast_bundle = False

    # -- time budget
    def left(self) -> float:
        return self.args.deadline - (time.monotonic() - self.started)

    def fits(self, key: str) -> bool:
        return self.tiny or self.left() > COST.get(key, 30)

    # -- results
    def record(self, name: str, workload: str | None = None, seconds: float | None = None, **extra: Any) -> dict:
        entry = {"name": name, "workload": workload, "seconds": seconds, "run": self.label, **extra}
        self.results["records"].append(entry)
        self.save()
        shown = f"{seconds:9.3f} s" if isinstance(seconds, (int, float)) else "    -    "
        detail = {k: v for k, v in extra.items() if k not in ("stages", "traceback")}
        clock = f"[{time.monotonic() - self.started:7.1f}s]"
        print(f"{clock} {name:<28} {workload or '':<4} {shown}  {json.dumps(detail)[:300]}", flush=True)
        return entry

    def skip(self, name: str, workload: str | None, why: str) -> None:
        self.record(name, workload, None, skipped=why)

    def fail(self, name: str, workload: str | None, err: BaseException) -> None:
        self.record(
            name,
            workload,
            None,
            error=f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[:400],
            traceback=traceback.format_exc()[-3000:],
        )

    def save(self) -> None:
        text = json.dumps(self.results, indent=1, default=str)
        (self.out / "results.json").write_text(text)
        (self.work / f"results-{self.label}.json").write_text(text)

    # -- model
    def bundle(self) -> Any:
        if self._bundle is None:
            self._bundle = self.load()
        return self._bundle

    def load(self, record: bool = True) -> Any:
        from k6vsr_core.model.bundle import load_bundle

        ensure_bundle(self)
        sync(self.device)
        started = time.perf_counter()
        bundle = load_bundle(str(self.bundle_path), device=self.device)
        sync(self.device)
        if record:
            self.record("load_bundle", None, time.perf_counter() - started, device=str(self.device))
        return bundle

    def drop_bundle(self) -> None:
        self._bundle = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def clip(self, workload: str) -> Path:
        width, height, frames, _ = self.workloads[workload]
        path = self.work / f"clip-{width}x{height}x{frames}.mp4"
        if not path.exists():
            from k6vsr_core.media.sample import make_sample_clip

            make_sample_clip(path.with_suffix(".part.mp4"), width=width, height=height, num_frames=frames, fps=24)
            path.with_suffix(".part.mp4").rename(path)
        return path

    def params(self, workload: str, attention: str = "dense") -> Any:
        from k6vsr_core.contract.params import parse_params

        return parse_params(scale=self.workloads[workload][3], attention=attention, seed=42)


def environment(device: torch.device) -> dict[str, Any]:
    import importlib.metadata as md

    env: dict[str, Any] = {
        "date": DATE,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
    }
    for name in ("diffusers", "av", "zarr", "numpy"):
        try:
            env[name] = md.version(name)
        except md.PackageNotFoundError:
            env[name] = "absent"
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(0)
        env["gpus"] = torch.cuda.device_count()
        env["cuda"] = torch.version.cuda
        env["cudnn"] = torch.backends.cudnn.version()
        env["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / GIB, 1)
    else:
        env["gpu"] = "none (CPU)"
    return env


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def peak(device: torch.device) -> dict[str, float]:
    if device.type != "cuda":
        return {}
    return {
        "peak_alloc_gib": round(torch.cuda.max_memory_allocated() / GIB, 2),
        "peak_reserved_gib": round(torch.cuda.max_memory_reserved() / GIB, 2),
    }


# ---------------------------------------------------------------------------------------------------- bundle


def write_full_bundle(path: Path, device: torch.device, seed: int = 0) -> dict[str, Any]:
    """Write the full-size bundle with random bf16 weights, generated on `device` (fan-in scaled, norm gains ~1)."""
    from diffusers import Kandinsky6SRLatentUpscalerBank, Kandinsky6SRTransformer3DModel, Kandinsky6SRVAE
    from safetensors.torch import save_file

    from k6vsr_core.contract.release_config import released_configs
    from k6vsr_core.model.bundle import MODEL_INDEX, WEIGHTS, latent_upscaler_kwargs, transformer_kwargs, vae_kwargs

    configs = released_configs()
    tmp = path.with_name(path.name + ".part")
    if tmp.exists():
        import shutil

        shutil.rmtree(tmp)
    modules = {
        "transformer": (Kandinsky6SRTransformer3DModel, transformer_kwargs(configs["transformer"])),
        "vae": (Kandinsky6SRVAE, vae_kwargs(configs["vae"])),
        "latent_upscaler": (Kandinsky6SRLatentUpscalerBank, latent_upscaler_kwargs(configs["latent_upscaler"])),
    }
    generator = torch.Generator(device=device).manual_seed(seed)
    counts: dict[str, int] = {}
    for component, (cls, kwargs) in modules.items():
        with torch.device("meta"):
            shapes = {name: tuple(t.shape) for name, t in cls(**kwargs).state_dict().items()}
        state = {}
        for name, shape in shapes.items():
            fan_in = max(1, math.prod(shape[1:])) if len(shape) > 1 else 1
            scale = 1.0 / math.sqrt(fan_in) if len(shape) > 1 else 0.02
            values = torch.randn(shape, generator=generator, device=device, dtype=torch.float32) * scale
            if name.endswith("weight") and len(shape) == 1:
                values += 1.0  # norm gains
            state[name] = values.to(torch.bfloat16).cpu()
        counts[component] = sum(math.prod(s) for s in shapes.values())
        (tmp / component).mkdir(parents=True, exist_ok=True)
        save_file(state, str(tmp / component / WEIGHTS))
        (tmp / component / "config.json").write_text(json.dumps(configs[component], indent=2))
        del state
    (tmp / "scheduler").mkdir(parents=True, exist_ok=True)
    (tmp / "scheduler" / "scheduler_config.json").write_text(json.dumps(configs["scheduler"], indent=2))
    (tmp / MODEL_INDEX).write_text(json.dumps(configs["index"], indent=2))
    tmp.rename(path)
    return {"parameters": counts, "bytes": sum(f.stat().st_size for f in path.rglob("*") if f.is_file())}


def ensure_bundle(bench: Bench) -> None:
    if (bench.bundle_path / "model_index.json").exists():
        return
    started = time.perf_counter()
    if bench.tiny:
        from k6vsr_core.model.tiny_bundle import make_tiny_bundle

        make_tiny_bundle(bench.bundle_path)
        bench.record("write_bundle", None, time.perf_counter() - started, kind="tiny")
        return
    info = write_full_bundle(bench.bundle_path, bench.device)
    bench.record(
        "write_bundle",
        None,
        time.perf_counter() - started,
        kind="full-size random bf16",
        parameters=info["parameters"],
        gib=round(info["bytes"] / GIB, 2),
    )


# ---------------------------------------------------------------------------------------------------- measuring


class StageClock:
    """Synchronised wall time of every latent-upscaler and DiT forward (the rest of a chunk is noise + sampler)."""

    def __init__(self, bundle: Any, device: torch.device) -> None:
        self.device = device
        self.times: dict[str, list[float]] = {"upscaler": [], "dit": []}
        self.handles = []
        for name, module in (("upscaler", bundle.latent_upscaler), ("dit", bundle.transformer)):
            started: list[float] = []

            def pre(module: Any, args: Any, _started: list[float] = started) -> None:
                sync(self.device)
                _started.append(time.perf_counter())

            def post(module: Any, args: Any, output: Any, _name: str = name, _started: list[float] = started) -> None:
                sync(self.device)
                self.times[_name].append(time.perf_counter() - _started.pop())

            self.handles.append(module.register_forward_pre_hook(pre))
            self.handles.append(module.register_forward_hook(post))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def run_ours(
    bench: Bench, bundle: Any, workload: str, output: Path, attention: str = "dense", split: bool = False
) -> dict[str, Any]:
    """One request through the in-memory runner, end to end (decode source ... MP4 written)."""
    from k6vsr_core.model.runner import upscale

    clip = bench.clip(workload)
    clock = StageClock(bundle, bench.device) if split else None
    reset_peak(bench.device)
    before = round(torch.cuda.memory_allocated() / GIB, 2) if bench.device.type == "cuda" else None
    started = time.perf_counter()
    try:
        result = upscale(clip, output, bundle, bench.params(workload, attention))
    finally:
        if clock is not None:
            clock.remove()
    seconds = time.perf_counter() - started
    info: dict[str, Any] = {
        "seconds": seconds,
        "timings": {k: round(v, 3) for k, v in result.timings.items()},
        "dit_calls": result.dit_calls,
        "tiles": result.plan.num_tiles,
        **peak(bench.device),
        "alloc_before_gib": before,
    }
    if clock is not None:
        dit, lu = clock.times["dit"], clock.times["upscaler"]
        denoise = result.timings["denoise"]
        info["stages"] = {
            "ingest": round(result.timings["ingest"], 3),
            "encode": round(result.timings["encode"], 3),
            "upscaler": round(sum(lu), 3),
            "dit": round(sum(dit), 3),
            "dit_per_call_median": round(statistics.median(dit), 4) if dit else None,
            "denoise_other": round(denoise - sum(lu) - sum(dit), 3),
            "decode": round(result.timings["decode"], 3),
            "decode_per_tile": round(result.timings["decode"] / result.plan.num_tiles, 3),
            "blend": round(result.timings["blend"], 3),
            "mux": round(result.timings["mux"], 3),
        }
    return info


def all_frames(path: Path) -> np.ndarray:
    """Every frame of a video, as RGB."""
    from k6vsr_core import media

    count, pts = media.scan_frames(path)
    return media.read_frames(path, list(range(count)), pts)


def contract_frames(path: Path) -> np.ndarray:
    """The frames a run keeps of `path` under the contract's selection, read as a run reads them."""
    from k6vsr_core import media
    from k6vsr_core.contract.params import parse_params
    from k6vsr_core.contract.plan import ModelTraits
    from k6vsr_core.contract.source import read_source

    clip = read_source(path, parse_params(scale=2, frames="contract"), ModelTraits())
    return media.read_frames(path, clip.plan.source_indices(), clip.frame_pts)


def frames_diff(a: Path, b: Path) -> dict[str, Any]:
    fa, fb = all_frames(a), all_frames(b)
    same_bytes = a.read_bytes() == b.read_bytes()
    if fa.shape != fb.shape:
        return {"same_bytes": same_bytes, "shape_a": fa.shape, "shape_b": fb.shape}
    diff = np.abs(fa.astype(np.int16) - fb.astype(np.int16))
    mse = float((diff.astype(np.float64) ** 2).mean())
    return {
        "same_bytes": same_bytes,
        "same_frames": bool((diff == 0).all()),
        "max_abs_diff": int(diff.max()),
        "mean_abs_diff": round(float(diff.mean()), 4),
        "psnr_db": round(10 * math.log10(255**2 / mse), 2) if mse > 0 else None,
    }


def warm_shapes(bench: Bench, bundle: Any, workload: str, attention: str) -> float:
    """Compile and warm at a workload's tile shapes: one chunk (upscaler + DiT steps) and one tile decode."""
    from k6vsr_core.contract.plan import make_plan
    from k6vsr_core.model import stages
    from k6vsr_core.model.bundle import model_traits

    width, height, frames, _ = bench.workloads[workload]
    plan = make_plan((height, width), frames, 24, bench.params(workload, attention), model_traits(bundle.info))
    chunk = plan.chunks[0]
    th, tw = plan.grid.latent_tile
    generator = torch.Generator().manual_seed(1)
    lr = torch.randn((len(chunk.tiles), 64, plan.latent_frames, th, tw), generator=generator)
    sync(bench.device)
    started = time.perf_counter()
    latents = stages.denoise_chunk(bundle, lr, chunk, plan)
    stages.decode_tile(bundle, latents[0])
    sync(bench.device)
    return time.perf_counter() - started


# ---------------------------------------------------------------------------------------------------- phases


def phase_setup(bench: Bench) -> None:
    ensure_bundle(bench)
    for workload in ("W2", "W1"):
        bench.clip(workload)
    bench.bundle()


def phase_baseline(bench: Bench) -> None:
    # The module itself: diffusers' top-level name is a placeholder wherever `transformers` is not installed.
    from diffusers.pipelines.kandinsky6.pipeline_kandinsky6_sr import Kandinsky6SRPipeline

    from k6vsr_core.model.attention import set_attention

    if bench.fast_bundle:
        bench.skip("baseline", None, "the loaded bundle is already compiled; run baseline first")
        return
    bundle = bench.bundle()
    set_attention(bundle.transformer, "dense")
    pipe = Kandinsky6SRPipeline(
        transformer=bundle.transformer,
        vae=bundle.vae,
        scheduler=bundle.new_scheduler(),
        latent_upscaler=bundle.latent_upscaler,
    )
    pipe.set_progress_bar_config(disable=True)

    def once(workload: str) -> tuple[float, dict[str, float]]:
        frames = contract_frames(bench.clip(workload))
        video = torch.from_numpy(frames).permute(0, 3, 1, 2).float().div(255.0)  # (T, C, H, W) in [0, 1]
        reset_peak(bench.device)
        sync(bench.device)
        started = time.perf_counter()
        generator = torch.Generator(device=bench.device).manual_seed(42)
        out = pipe(
            video=video,
            resolution_scale=bench.workloads[workload][3],
            num_inference_steps=2,
            generator=generator,
            output_type="pt",
            return_dict=False,
        )[0]
        sync(bench.device)
        seconds = time.perf_counter() - started
        del out
        return seconds, peak(bench.device)

    for workload, key, runs in (("W2", "baseline-W2", 1 if bench.tiny else 2), ("W1", "baseline-W1", 1)):
        if not bench.fits(key):
            bench.skip("diffusers", workload, "deadline")
            continue
        try:
            if workload == "W2" and not bench.tiny:
                once("W2")  # warm-up: cuDNN plans, allocator pool
            times = [once(workload) for _ in range(runs)]
            best = min(times, key=lambda item: item[0])
            bench.record(
                "diffusers",
                workload,
                best[0],
                runs=[round(t[0], 3) for t in times],
                note="Kandinsky6SRPipeline, DenseSdpaProcessor, eager; decoded frames in, tensor out, no MP4",
                **best[1],
            )
        except Exception as err:  # noqa: BLE001
            bench.fail("diffusers", workload, err)
    pipe = None  # free the pipeline's GPU memory for the next phase
    gc.collect()


def phase_plain(bench: Bench) -> None:
    if bench.fast_bundle:
        bench.skip("ours-plain", "W2", "the loaded bundle is already compiled")
        return
    bundle = bench.bundle()
    try:
        run_ours(bench, bundle, "W2", bench.work / "w2-plain-warmup.mp4")
        info = run_ours(bench, bundle, "W2", bench.work / "w2-plain.mp4")
        bench.record("ours-plain (eager, dense)", "W2", info.pop("seconds"), **info)
    except Exception as err:  # noqa: BLE001
        bench.fail("ours-plain (eager, dense)", "W2", err)


def make_fast(bench: Bench) -> Any:
    from k6vsr_core.model.fast import compile_bundle

    bundle = bench.bundle()
    if not bench.fast_bundle:
        started = time.perf_counter()
        path = compile_bundle(bundle)
        bench.fast_bundle = True
        bench.record(
            "compile_bundle",
            None,
            time.perf_counter() - started,
            cache_dir=path.cache_dir,
            compiled_dit=path.compiled_dit,
            compiled_decoder=path.compiled_decoder,
            cache_files_before=count_files(path.cache_dir),
        )
    return bundle


def count_files(path: str | None) -> int | None:
    if not path or not os.path.isdir(path):
        return None
    return sum(len(files) for _, _, files in os.walk(path))


def sdpa_probe(bench: Bench) -> None:
    """Which SDPA backend the default picks at the tile shape, and each backend's time (ms per call)."""
    if bench.device.type != "cuda":
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    shape = (1, 28, 31 * 32 * 48, 64)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    result: dict[str, Any] = {"default_choice": int(torch._fused_sdp_choice(q, k, v))}
    for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
        try:
            with sdpa_kernel([backend]):
                for _ in range(2):
                    torch.nn.functional.scaled_dot_product_attention(q, k, v)
                sync(bench.device)
                started = time.perf_counter()
                for _ in range(5):
                    torch.nn.functional.scaled_dot_product_attention(q, k, v)
                sync(bench.device)
            result[f"{name}_ms"] = round((time.perf_counter() - started) / 5 * 1000, 2)
        except Exception as err:  # noqa: BLE001
            result[f"{name}_error"] = str(err).splitlines()[0][:200]
    members = getattr(SDPBackend, "__members__", {})
    result["default_choice_name"] = {int(v): k for k, v in members.items()}.get(result["default_choice"])
    bench.record("sdpa at tile shape 1x28x47616x64", None, None, **result)


def phase_fast(bench: Bench) -> None:
    if bench.fits("sdpa-probe"):
        try:
            sdpa_probe(bench)
        except Exception as err:  # noqa: BLE001
            bench.fail("sdpa probe", None, err)
    bundle = make_fast(bench)
    # W2: the first request pays the compile (cold or warm cache), then hot runs.
    try:
        if bench.fits("fast-W2-first"):
            info = run_ours(bench, bundle, "W2", bench.work / "w2-fast-first.mp4")
            bench.record("ours-fast first request", "W2", info.pop("seconds"), **info)
            runs = [
                run_ours(bench, bundle, "W2", bench.work / "w2-fast.mp4") for _ in range(2 if not bench.tiny else 1)
            ]
            times = [round(r["seconds"], 3) for r in runs]
            best = min(runs, key=lambda item: item["seconds"])
            extra: dict[str, Any] = {"runs": times}
            if (bench.work / "w2-plain.mp4").exists():
                extra["vs_plain"] = frames_diff(bench.work / "w2-fast.mp4", bench.work / "w2-plain.mp4")
            bench.record("ours-fast hot (dense)", "W2", best.pop("seconds"), **best, **extra)
        else:
            bench.skip("ours-fast", "W2", "deadline")
    except Exception as err:  # noqa: BLE001
        bench.fail("ours-fast", "W2", err)
    # W1: one warm-up request, then a hot request with the per-stage split and peak memory.
    try:
        if bench.fits("fast-W1-warm") and bench.fits("fast-W1-hot"):
            if bench.args.warmup == "request" and not bench.tiny:
                info = run_ours(bench, bundle, "W1", bench.work / "w1-fast-warmup.mp4")
                bench.record("ours-fast first request", "W1", info.pop("seconds"), **info)
            else:
                bench.record("ours-fast warm-up (shapes)", "W1", warm_shapes(bench, bundle, "W1", "dense"))
            if bench.fits("fast-W1-hot"):
                info = run_ours(bench, bundle, "W1", bench.work / "w1-fast.mp4", split=True)
                bench.record("ours-fast hot (dense)", "W1", info.pop("seconds"), **info)
        else:
            bench.skip("ours-fast", "W1", "deadline")
        if bench.args.w3 and bench.fits("fast-W3"):
            info = run_ours(bench, bundle, "W3", bench.work / "w3-fast.mp4", split=True)
            bench.record("ours-fast hot (dense)", "W3", info.pop("seconds"), **info)
    except Exception as err:  # noqa: BLE001
        bench.fail("ours-fast", "W1", err)


def phase_nabla(bench: Bench) -> None:
    bundle = make_fast(bench)
    switch = getattr(bundle, "attention_hook", None)
    stats = torch.zeros(2, dtype=torch.float64, device=bench.device)
    for threshold, label, warm_key, hot_key in (
        (None, "nabla", "nabla-warm", "nabla-hot"),
        (0.0, "nabla STA floor (thr 0)", "sta-warm", "sta-hot"),
    ):
        try:
            if not (bench.fits(warm_key) and bench.fits(hot_key)):
                bench.skip(f"ours-fast {label}", "W1", "deadline")
                continue
            switch.nabla_settings(threshold=threshold, stats=stats)
            warm = warm_shapes(bench, bundle, "W1", "nabla")
            bench.record(f"ours-fast {label} warm-up (shapes)", "W1", warm)
            stats.zero_()
            info = run_ours(
                bench,
                bundle,
                "W1",
                bench.work / f"w1-{label.split()[0]}-{threshold}.mp4",
                attention="nabla",
                split=True,
            )
            kept, total = (float(x) for x in stats.tolist())
            density = round(kept / total, 4) if total else None
            bench.record(f"ours-fast hot ({label})", "W1", info.pop("seconds"), block_density=density, **info)
        except Exception as err:  # noqa: BLE001
            bench.fail(f"ours-fast {label}", "W1", err)
    if switch is not None:
        switch.nabla_settings(threshold=None, stats=None)


def dense_block_mask(block_mask: Any) -> torch.Tensor:
    """(B, heads, Q blocks, KV blocks) bool: the blocks a flex BlockMask lets each query block see."""
    kv_blocks = block_mask.kv_indices.shape[-1]
    dense = torch.zeros(block_mask.kv_indices.shape, dtype=torch.bool, device=block_mask.kv_indices.device)
    for counts, indices in (
        (block_mask.kv_num_blocks, block_mask.kv_indices),
        (block_mask.full_kv_num_blocks, block_mask.full_kv_indices),
    ):
        if counts is None:
            continue
        valid = torch.arange(kv_blocks, device=dense.device) < counts[..., None]
        dense |= torch.zeros_like(dense).scatter_(-1, indices.long(), valid)
    return dense


def phase_density(bench: Bench) -> None:
    """NABLA's block density on the real W1 tile 0 (both DiT steps, every layer), eagerly and exactly.

    The mask comes from diffusers' own `nabla_block_mask`; attention is computed per head with SDPA under the
    token-level mask it implies (the same function as flex attention with that BlockMask), so the trajectory, and
    therefore each layer's density, is NABLA's. Needs no compile.
    """
    from diffusers.models.transformers.transformer_kandinsky6_sr import (
        Kandinsky6SRAttnProcessor,
        apply_rotary,
        nabla_block_mask,
    )

    from k6vsr_core.contract.plan import make_plan
    from k6vsr_core.model import stages
    from k6vsr_core.model.bundle import model_traits

    if bench.fast_bundle:
        bench.skip("nabla density", "W1", "needs the plain bundle")
        return
    bundle = bench.bundle()

    class DensityProbe(Kandinsky6SRAttnProcessor):
        def __init__(self, threshold: float | None, log: list) -> None:
            self.threshold, self.log = threshold, log

        def __call__(
            self, attn: Any, hidden_states: torch.Tensor, rotary_emb: torch.Tensor, sparse_params: Any
        ) -> torch.Tensor:
            q = attn.to_query(hidden_states).unflatten(-1, (attn.num_heads, -1))
            k = attn.to_key(hidden_states).unflatten(-1, (attn.num_heads, -1))
            v = attn.to_value(hidden_states).unflatten(-1, (attn.num_heads, -1))
            q = apply_rotary(attn.query_norm(q.float()).type_as(q), rotary_emb).transpose(1, 2)
            k = apply_rotary(attn.key_norm(k.float()).type_as(k), rotary_emb).transpose(1, 2)
            v = v.transpose(1, 2)
            thr = sparse_params["threshold"] if self.threshold is None else self.threshold
            dense = dense_block_mask(nabla_block_mask(q, k, sparse_params["sta_mask"], thr=thr))
            self.log.append((int(dense.sum()), dense.numel()))
            out = torch.empty_like(q)
            blocks = dense.shape[-1]
            size = q.shape[2] // blocks
            for b in range(q.shape[0]):
                for h in range(q.shape[1]):
                    mask = dense[b, h][:, None, :, None].expand(blocks, size, blocks, size).reshape(q.shape[2], -1)
                    out[b, h] = torch.nn.functional.scaled_dot_product_attention(
                        q[b, h][None, None], k[b, h][None, None], v[b, h][None, None], attn_mask=mask[None, None]
                    )[0, 0]
            return attn.out_layer(out.transpose(1, 2).flatten(2, 3))

    from diffusers.models.transformers.transformer_kandinsky6_sr import Kandinsky6SRAttention

    layers = [m for m in bundle.transformer.modules() if isinstance(m, Kandinsky6SRAttention)]
    width, height, frames, _ = bench.workloads["W1"]
    params = bench.params("W1", "nabla")
    plan = make_plan((height, width), frames, 24, params, model_traits(bundle.info))
    source_frames = contract_frames(bench.clip("W1"))
    latent = stages.encode_clip(bundle, stages.prepare_window(source_frames, plan, plan.windows[0]))
    chunk = plan.chunks[0]
    for threshold, label in ((None, "nabla (P 0.8)"), (0.0, "nabla STA floor (thr 0)")):
        if not bench.fits("density"):
            bench.skip(f"block density {label}", "W1", "deadline")
            continue
        try:
            log: list = []
            for module in layers:
                module.set_processor(DensityProbe(threshold, log))
            sync(bench.device)
            started = time.perf_counter()
            stages.denoise_chunk(bundle, stages.cut_tiles(latent, plan, chunk.tiles), chunk, plan)
            sync(bench.device)
            per_call = [kept / total for kept, total in log]
            bench.record(
                f"block density {label}",
                "W1",
                time.perf_counter() - started,
                block_density=round(sum(k for k, _ in log) / sum(t for _, t in log), 4),
                density_min=round(min(per_call), 4),
                density_max=round(max(per_call), 4),
                layer_calls=len(log),
                tile=chunk.tiles[0],
                note="exact NABLA (eager, per-head masked SDPA); seconds are not a speed figure",
            )
        except Exception as err:  # noqa: BLE001
            bench.fail(f"block density {label}", "W1", err)
    from k6vsr_core.model.attention import set_attention

    for module in layers:
        module.set_processor(Kandinsky6SRAttnProcessor())
    set_attention(bundle.transformer, "dense")


def phase_flexprobe(bench: Bench) -> None:
    """Compile diffusers' own flex dispatch (its kernel options) on a NABLA-style 64-block mask."""
    if bench.device.type != "cuda" or not bench.fits("flexprobe"):
        bench.skip("flexprobe", None, "CPU or deadline")
        return
    from diffusers.models.attention_dispatch import AttentionBackendName, dispatch_attention_fn
    from diffusers.models.transformers.transformer_kandinsky6_sr import nabla_block_mask, sliding_tile_mask

    t, h, w = 9, 4, 6  # a W2-sized token grid in 8x8 blocks: 9 x 32 x 48 tokens
    s = t * h * w * 64
    q, k, v = (torch.randn((1, s, 28, 64), device="cuda", dtype=torch.bfloat16) for _ in range(3))
    sta = sliding_tile_mask(t, h, w, (11, 7, 7), torch.device("cuda"))

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        mask = nabla_block_mask(q.transpose(1, 2), k.transpose(1, 2), sta, thr=0.8)
        return dispatch_attention_fn(q, k, v, attn_mask=mask, backend=AttentionBackendName.FLEX)

    started = time.perf_counter()
    try:
        torch.compile(attend, fullgraph=True, dynamic=False)(q, k, v)
        sync(bench.device)
        bench.record("flexprobe diffusers kernel options", None, time.perf_counter() - started, compiles=True)
    except Exception as err:  # noqa: BLE001
        bench.record(
            "flexprobe diffusers kernel options",
            None,
            time.perf_counter() - started,
            compiles=False,
            error=f"{type(err).__name__}: {str(err)}"[:600],
        )


# ---------------------------------------------------------------------------------------------------- multi-GPU


# The store-backed phase runs the flow's own task bodies (`Task.fn`: the body without Prefect), so it measures exactly
# what the flow computes; only the scheduling below is the benchmark's own (one process per GPU, no Prefect).
ATTEMPT = "bench"


def _run_ref(store_root: str | Path, run_key: str) -> Any:
    from service.runs import RunRef

    return RunRef(store_root=str(store_root), run_key=run_key)


def store_task(spec: Any, kind: str, store_root: str, run_key: str, index: int) -> None:
    """One tile stage of the flow (tasks/stage_tasks.py) in this worker process."""
    from tasks import stage_tasks

    run = _run_ref(store_root, run_key)
    if kind == "encode":
        stage_tasks.encode.fn(run, spec, 0, ATTEMPT)
    elif kind == "denoise":
        stage_tasks.denoise.fn(run, spec, 0, index, ATTEMPT)
    elif kind == "decode":
        stage_tasks.decode.fn(run, spec, 0, index, ATTEMPT)
    else:
        raise ValueError(kind)


def _worker(rank: int, device: str, bundle_path: str, fast: bool, warm: dict, tasks: Any, results: Any) -> None:
    try:
        from service.runs import ModelSpec
        from tasks.model_cache import get_bundle

        if device.startswith("cuda"):
            torch.cuda.set_device(torch.device(device))
        # The tasks' own model cache: the stage bodies below find this bundle (compiled if `fast`) loaded.
        spec = ModelSpec(model=bundle_path, device=device, compile=fast)
        started = time.perf_counter()
        bundle = get_bundle(spec)
        loaded = time.perf_counter() - started
        fast_path = getattr(bundle, "fast_path", None)
        started = time.perf_counter()
        if warm:
            from k6vsr_core.contract.params import parse_params
            from k6vsr_core.contract.plan import make_plan
            from k6vsr_core.model import stages
            from k6vsr_core.model.bundle import model_traits

            plan = make_plan(
                tuple(warm["size"]), warm["frames"], 24, parse_params(**warm["params"]), model_traits(bundle.info)
            )
            chunk = plan.chunks[0]
            th, tw = plan.grid.latent_tile
            lr = torch.randn(
                (len(chunk.tiles), 64, plan.latent_frames, th, tw), generator=torch.Generator().manual_seed(1)
            )
            stages.decode_tile(bundle, stages.denoise_chunk(bundle, lr, chunk, plan)[0])
        if device.startswith("cuda"):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        results.put(
            (
                "ready",
                rank,
                {
                    "load_s": round(loaded, 2),
                    "warm_s": round(time.perf_counter() - started, 2),
                    "cudnn_attention": getattr(fast_path, "cudnn_attention", None),
                    "deterministic": getattr(fast_path, "deterministic", None),
                    "cache_dir": os.environ.get("TORCHINDUCTOR_CACHE_DIR"),
                },
            )
        )
        while True:
            task = tasks.get()
            if task is None:
                break
            if task == "peak":
                results.put(("peak", rank, peak(torch.device(device)) if device.startswith("cuda") else {}))
                continue
            started = time.perf_counter()
            store_task(spec, *task)
            results.put(("done", rank, (task, round(time.perf_counter() - started, 3))))
    except BaseException as err:  # noqa: BLE001 - report, then let the parent decide
        results.put(("error", rank, f"{type(err).__name__}: {err}\n{traceback.format_exc()[-2000:]}"))


def _run_job(
    source: Path, root: Path, params: Any, info: Any, workers: list[int], queues: list[Any], results: Any
) -> dict[str, Any]:
    """Ingest -> encode -> denoise per chunk -> decode per tile (after its chunk) -> blend -> mux, like the flow."""
    import shutil

    from k6vsr_core import media
    from k6vsr_core.contract.plan import make_plan
    from k6vsr_core.model.bundle import model_traits
    from service.runs import PreparedRun
    from storage import RunStore
    from tasks import stage_tasks
    from tasks.ingest import ingest

    if root.exists():
        shutil.rmtree(root)
    run = _run_ref(root, "bench")
    probe = media.probe(source)
    planned = make_plan(
        (probe.height, probe.width), probe.num_frames, probe.fps, params, model_traits(info), probe.rate
    )
    prepared = PreparedRun(run=run, source=str(source), model_info=info, probe=probe, plan=planned, finished=False)
    started = time.perf_counter()
    plan = ingest.fn(prepared, ATTEMPT).plan
    pending: list[tuple[str, int]] = [("denoise", c.index) for c in plan.chunks]
    waiting = {t: plan.chunk_of(t).index for t in range(plan.num_tiles)}
    done_chunks: set[int] = set()
    free = list(workers)
    busy: dict[int, tuple[str, int]] = {}
    per_worker: dict[int, float] = {w: 0.0 for w in workers}
    queues[free[0]].put(("encode", str(root), "bench", 0))
    busy[free.pop(0)] = ("encode", 0)
    encode_done = False
    while busy or pending or waiting:
        kind, rank, payload = results.get(timeout=900)
        if kind == "error":
            raise RuntimeError(f"worker {rank}: {payload}")
        task, seconds = payload
        per_worker[rank] += seconds
        finished = busy.pop(rank)
        free.append(rank)
        if finished[0] == "encode":
            encode_done = True
        if finished[0] == "denoise":
            done_chunks.add(finished[1])
            # A decode becomes ready when its chunk is denoised; submitted after the chunks, as the flow does.
            for tile in sorted(t for t, c in waiting.items() if c == finished[1]):
                pending.append(("decode", tile))
                del waiting[tile]
        while free and pending and encode_done:
            rank_next = free.pop(0)
            task_next = pending.pop(0)
            queues[rank_next].put((task_next[0], str(root), "bench", task_next[1]))
            busy[rank_next] = task_next
    gpu_done = time.perf_counter() - started
    # W1 is one window (121 frames).
    stage_tasks.blend.fn(run, 0, ATTEMPT)
    stage_tasks.segment(run, 0, ATTEMPT)
    stage_tasks.mux.fn(run, ATTEMPT)
    seconds = time.perf_counter() - started
    return {
        "seconds": seconds,
        "until_last_decode": round(gpu_done, 3),
        "busy_per_worker": per_worker,
        "output": str(RunStore(root, "bench").output_path),
    }


def phase_multi(bench: Bench) -> None:
    import multiprocessing as mp

    from k6vsr_core.model.bundle import inspect_bundle

    ensure_bundle(bench)
    if not bench.fits("multi"):
        bench.skip("multi", "W1", "deadline")
        return
    n = bench.args.gpus or (torch.cuda.device_count() if bench.device.type == "cuda" else 2)
    devices = [f"cuda:{i}" for i in range(n)] if bench.device.type == "cuda" else ["cpu"] * n
    bench.drop_bundle()  # free this process's GPU memory for the workers
    workload = "W1"
    width, height, frames, scale = bench.workloads[workload]
    params = bench.params(workload)
    warm = {"size": [height, width], "frames": frames, "params": {"scale": scale, "attention": "dense", "seed": 42}}
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    queues = [ctx.Queue() for _ in devices]
    fast = bench.device.type == "cuda"
    procs = [
        ctx.Process(target=_worker, args=(i, d, str(bench.bundle_path), fast, warm, queues[i], results), daemon=True)
        for i, d in enumerate(devices)
    ]
    started = time.perf_counter()
    for proc in procs:
        proc.start()
    try:
        ready = {}
        while len(ready) < n:
            kind, rank, payload = results.get(timeout=min(max(60.0, bench.left()), 3600.0))
            if kind == "error":
                raise RuntimeError(f"worker {rank}: {payload}")
            ready[rank] = payload
        bench.record(
            "multi workers ready",
            workload,
            time.perf_counter() - started,
            workers=n,
            per_worker=ready,
            note="load + compile_bundle + one warm-up chunk and decode, in parallel",
        )
        info = inspect_bundle(bench.bundle_path).info
        source = bench.clip(workload)
        one = _run_job(source, bench.work / "store-1gpu", params, info, [0], queues, results)
        runner_output = bench.work / "w1-fast.mp4"
        if runner_output.exists():
            one["byte_identical_to_runner"] = Path(one["output"]).read_bytes() == runner_output.read_bytes()
        bench.record("store flow, 1 worker", workload, one.pop("seconds"), workers=1, **one)
        if n > 1:
            many = _run_job(source, bench.work / f"store-{n}gpu", params, info, list(range(n)), queues, results)
            same = Path(many["output"]).read_bytes() == Path(one["output"]).read_bytes()
            for q in queues:
                q.put("peak")
            peaks = {}
            while len(peaks) < n:
                kind, rank, payload = results.get(timeout=60)
                if kind == "peak":
                    peaks[rank] = payload
            bench.record(
                f"store flow, {n} workers",
                workload,
                many.pop("seconds"),
                workers=n,
                byte_identical_to_1_worker=same,
                peak_per_worker=peaks,
                **many,
            )
    except Exception as err:  # noqa: BLE001
        bench.fail("multi", workload, err)
    finally:
        for q in queues:
            q.put(None)
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.terminate()


PHASES: dict[str, Callable[[Bench], None]] = {
    "setup": phase_setup,
    "baseline": phase_baseline,
    "plain": phase_plain,
    "fast": phase_fast,
    "nabla": phase_nabla,
    "multi": phase_multi,
    "density": phase_density,
    "flexprobe": phase_flexprobe,
}


# ---------------------------------------------------------------------------------------------------- report

TARGETS = {
    "W1 dense hot (s)": 40.0,
    "W1 NABLA at STA floor hot (s)": 25.0,
    "W2 hot (s)": 1.2,
    "2 GPUs / 1 GPU": 0.55,
    "peak reserved per worker (GiB)": 32.0,
}


def _find(records: list[dict], name: str, workload: str | None) -> dict | None:
    found = [r for r in records if r["name"] == name and r.get("workload") == workload and r.get("seconds") is not None]
    return found[-1] if found else None


def render(payloads: list[dict[str, Any]]) -> str:
    """Markdown: environment and command of each run, every figure, ratios, the per-stage split, targets."""
    records = [r for p in payloads for r in p["records"]]
    lines = []
    env = payloads[0]["env"]
    lines.append(f"## {env['date']} — {env.get('gpu')} — torch {env['torch']}, diffusers {env.get('diffusers')}")
    lines.append("")
    for p in payloads:
        e = p["env"]
        label = p["records"][0]["run"] if p["records"] else "?"
        lines.append(
            f"- run `{label}`: {e.get('gpus', 0)}x {e.get('gpu')} ({e.get('gpu_memory_gib', '-')} GiB), "
            f"CUDA {e.get('cuda')}, cuDNN {e.get('cudnn')}, Python {e['python']}, torch {e['torch']}, "
            f"diffusers {e.get('diffusers')}, PyAV {e.get('av')}, zarr {e.get('zarr')}, "
            f"{e.get('cpus')} CPUs, PYTORCH_CUDA_ALLOC_CONF={e.get('alloc_conf')}; command: `{p['command']}`"
        )
    lines.append("")
    lines.append("| run | measurement | workload | seconds | peak alloc GiB | peak reserved GiB | notes |")
    lines.append("|---|---|---|---|---|---|---|")
    for r in records:
        notes = []
        for key in (
            "skipped",
            "error",
            "block_density",
            "dit_calls",
            "tiles",
            "vs_plain",
            "workers",
            "byte_identical_to_1_worker",
            "byte_identical_to_runner",
            "until_last_decode",
            "busy_per_worker",
            "peak_per_worker",
            "per_worker",
            "runs",
            "default_choice_name",
            "density_min",
            "density_max",
            "cudnn_ms",
            "flash_ms",
            "compiles",
            "parameters",
            "gib",
            "cache_files_before",
            "alloc_before_gib",
            "note",
        ):
            if key in r and r[key] is not None:
                notes.append(f"{key}={json.dumps(r[key], default=str)}")
        sec = f"{r['seconds']:.2f}" if isinstance(r.get("seconds"), (int, float)) else "—"
        lines.append(
            f"| {r.get('run')} | {r['name']} | {r.get('workload') or ''} | {sec} | "
            f"{r.get('peak_alloc_gib', '')} | {r.get('peak_reserved_gib', '')} | "
            f"{'; '.join(notes).replace('|', '/')[:700]} |"
        )
    lines.append("")
    # Ratios.
    ratio_rows = []

    def ratio(label: str, num: dict | None, den: dict | None) -> None:
        if num and den and den["seconds"]:
            ratio_rows.append(
                f"| {label} | {num['seconds']:.2f} | {den['seconds']:.2f} | {num['seconds'] / den['seconds']:.3f} |"
            )

    base = {w: _find(records, "diffusers", w) for w in ("W1", "W2")}
    ratio("W1 ours dense hot / diffusers", _find(records, "ours-fast hot (dense)", "W1"), base["W1"])
    ratio("W1 ours NABLA hot / diffusers", _find(records, "ours-fast hot (nabla)", "W1"), base["W1"])
    ratio(
        "W1 ours NABLA STA floor hot / diffusers",
        _find(records, "ours-fast hot (nabla STA floor (thr 0))", "W1"),
        base["W1"],
    )
    ours_w1 = _find(records, "ours-fast hot (dense)", "W1")
    if ours_w1 and ours_w1.get("stages") and base["W1"]:
        model_only = ours_w1["seconds"] - ours_w1["stages"]["ingest"] - ours_w1["stages"]["mux"]
        ratio("W1 ours dense hot without source decode and MP4 write / diffusers", {"seconds": model_only}, base["W1"])
    ratio("W2 ours hot / diffusers", _find(records, "ours-fast hot (dense)", "W2"), base["W2"])
    ratio("W2 ours plain (eager) / diffusers", _find(records, "ours-plain (eager, dense)", "W2"), base["W2"])
    multi = [r for r in records if r["name"].startswith("store flow,") and r.get("workers", 1) > 1 and r["seconds"]]
    ratio("W1 store flow 2 GPUs / 1 GPU", multi[-1] if multi else None, _find(records, "store flow, 1 worker", "W1"))
    ratio(
        "W1 store flow 1 GPU / in-memory runner",
        _find(records, "store flow, 1 worker", "W1"),
        _find(records, "ours-fast hot (dense)", "W1"),
    )
    if ratio_rows:
        lines += ["| ratio | numerator s | denominator s | ratio |", "|---|---|---|---|", *ratio_rows, ""]
    # Per-stage split.
    split = [r for r in records if r.get("stages")]
    if split:
        keys = list(split[0]["stages"])
        lines.append("| per-stage split (s) | workload | " + " | ".join(keys) + " |")
        lines.append("|---|---|" + "---|" * len(keys))
        for r in split:
            lines.append(
                f"| {r['name']} | {r['workload']} | " + " | ".join(str(r["stages"].get(k)) for k in keys) + " |"
            )
        lines.append("")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------------- main


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--phases", default="setup,baseline,plain,density,fast,nabla,multi", help="comma-separated, run in this order"
    )
    parser.add_argument("--tiny", action="store_true", help="CPU smoke mode: tiny bundle and clips")
    parser.add_argument(
        "--work",
        default=os.environ.get("K6VSR_BENCH_WORK", "/tmp/k6vsr-bench"),
        help="bundle, clips, stores and outputs (kept between runs)",
    )
    parser.add_argument(
        "--out",
        default=os.environ.get("OUT") or str(ROOT / "bench" / "out"),
        help="results.json and the markdown table",
    )
    parser.add_argument("--deadline", type=float, default=1e9, help="seconds; skip what would not fit")
    parser.add_argument(
        "--warmup",
        choices=("request", "shapes"),
        default="request",
        help="W1 warm-up: a whole request, or one chunk and one decode at its shapes",
    )
    parser.add_argument("--w3", action="store_true", help="also measure W3 (25 tiles) in the fast phase")
    parser.add_argument("--gpus", type=int, default=0, help="workers for the multi phase (default: all GPUs)")
    parser.add_argument("--label", default=time.strftime("%H%M%S"), help="name of this run in the tables")
    parser.add_argument("--report", nargs="*", default=None, help="render these results.json files and exit")
    parser.add_argument("--append", action="store_true", help="append the rendered table to bench/RESULTS.md")
    parser.add_argument("--command", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.command is None:
        args.command = "python " + " ".join(
            shlex.quote(a) for a in [os.path.relpath(__file__, ROOT), *(argv or sys.argv[1:])]
        )
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.report is not None:
        payloads = [json.loads(Path(p).read_text()) for p in args.report]
        text = render(payloads)
        print(text)
        if args.append:
            with (ROOT / "bench" / "RESULTS.md").open("a") as handle:
                handle.write("\n" + text)
        return 0
    # Before anything initialises CUDA: the allocator grows segments instead of caching fixed blocks.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    bench = Bench(args)
    torch.manual_seed(0)
    if bench.device.type == "cuda":
        from k6vsr_core.device.compile_cache import enable_compile_cache

        enable_compile_cache()
    print(json.dumps(bench.results["env"]), flush=True)
    for name in [p.strip() for p in args.phases.split(",") if p.strip()]:
        if name not in PHASES:
            raise SystemExit(f"unknown phase {name!r}; known: {', '.join(PHASES)}")
        try:
            PHASES[name](bench)
        except Exception as err:  # noqa: BLE001 - a failed phase must not lose the others
            bench.fail(f"phase {name}", None, err)
    text = render([bench.results])
    (bench.out / "RESULTS-fragment.md").write_text(text)
    print(text)
    if args.append:
        with (ROOT / "bench" / "RESULTS.md").open("a") as handle:
            handle.write("\n" + text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
