"""Where one W1 tile's GPU time goes, and what each faster form of the networks changes, against the eager reference.

In one process, with the full-size random bundle and W1's tile (512x768 output, 121 frames, x2, NABLA), the real stage
functions (`stages.denoise_chunk`: latent upscaler and 2 DiT calls; `stages.decode_tile`). Sections, in order:

- `reference`: the eager reference: DiT blocks eager (NABLA's flex attention compiled alone, as it must be), KVAE
  decoder eager in diffusers' forms. Its latents and pixels are kept in `--work` for later calls; every other
  section's outputs are measured against them: latents after denoise (relative L2 error), pixels after decode
  (PSNR, share of equal bytes), and the end to end pixels of a variant's own latents through its own decoder.
- `fast`: the shipped fast path (compiled blocks and decoder, the decoder's fast forms): hot times (median of 3),
  and a torch.profiler kernel table of one denoise chunk and one decode (by kernel, and by kind).
- `unfused`: the compiled decoder in diffusers' forms (the path before `k6vsr_core.model.fast_decoder`).
- `flex`: one layer's NABLA attention at the tile shape (its inputs and block mask taken from the reference's first
  layer) with the shipped kernel options and others.
- `convs`: every distinct convolution of the reference decode timed alone: as recorded, with height and width padded
  by the convolution, channels-last, cuDNN's benchmark search, and as 2-D convolutions over frames.
- `fp8`: the DiT with FP8 linear layers (`--precision fp8`, k6vsr_core.device.precision), compiled.
- `attention`: one layer's attention at the tile shape, every maintained kernel this torch has, on the reference's
  layer-0 inputs: flex attention on NABLA's real mask (shipped options, then Inductor's max-autotune), on fixed
  block densities (`k6vsr_core.model.fast.fixed_density_block_mask`: 40 % and 27 %, and the STA floor), on a mask of
  every
  block; dense SDPA through cuDNN, FlashAttention 2 and memory-efficient kernels; FP8 inputs where a kernel takes
  them. Each with its milliseconds and its deviation from the shipped kernel's output.
- `density`: the shipped fast path's DiT with a fixed block density (the STA floor, 40 %) in place of NABLA's
  threshold, timed as one denoise chunk; with one W1 encode and the `fast` section's decode, W1's GPU work at each
  density (the plan's chunks and tiles), beside the random weights' own. Trained weights keep far fewer blocks than
  random ones: this is the projection of what the released weights cost.

    python3 bench/network_profile.py --work /tmp/k6vsr-net --out $OUT/net --sections reference,fast,unfused \\
        --cache-import .devcache/compile-cache.zip --deadline 520

`results.json` in `--out` holds every figure; `kernels-*.txt` the profiler tables. A section that would not finish
before `--deadline` seconds is skipped and says so.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SECTIONS = ("reference", "fast", "unfused", "flex", "convs", "fp8", "attention", "density")
# Rough seconds each section takes on an H200 (compiles from a warm cache), to skip what cannot finish.
COST = {
    "reference": 60,
    "fast": 120,
    "unfused": 40,
    "flex": 120,
    "convs": 60,
    "fp8": 120,
    "attention": 90,
    "density": 150,
}
# The fixed densities of the projection: NABLA's STA floor measured 27 % of block pairs on W1 (performance-baseline.md).
FIXED_DENSITIES = (0.40, 0.27)
FLEX_VARIANTS: dict[str, dict[str, Any]] = {
    "shipped": {},
    "warps8": {"num_warps": 8},
    "stages2": {"num_stages": 2},
    "stages4": {"num_stages": 4},
    "tma": {"USE_TMA": True},
    "rows_safe": {"ROWS_GUARANTEED_SAFE": True},
    "block_n32": {"BLOCK_N": 32},
}


def sync() -> None:
    torch.cuda.synchronize()


def timed(fn: Callable[[], Any], repeats: int = 3) -> tuple[float, Any]:
    """Median wall seconds of `repeats` synchronised calls (after the caller's warm call), and the last result."""
    seconds, result = [], None
    for _ in range(repeats):
        sync()
        started = time.perf_counter()
        result = fn()
        sync()
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds), result


def event_ms(fn: Callable[[], Any], repeats: int = 5) -> float:
    """Median device milliseconds of `fn` by CUDA events, after one warm call."""
    fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def rel_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    value, reference = value.double(), reference.double()
    return float((value - reference).norm() / reference.norm())


def pixel_match(value: torch.Tensor, reference: torch.Tensor) -> dict[str, float]:
    diff = value.float() - reference.float()
    mse = float(diff.pow(2).mean())
    return {
        "psnr_db": round(10 * math.log10(255.0**2 / mse), 2) if mse > 0 else float("inf"),
        "equal_bytes": round(float((diff == 0).float().mean()), 4),
        "max_abs": float(diff.abs().max()),
    }


def kind_of(name: str, stage: str) -> str:
    lowered = name.lower()
    if "memcpy" in lowered or "memset" in lowered:
        return "memory copy"
    if stage == "DiT" and ("flex" in lowered or "fmha" in lowered or "attention" in lowered or "triton_tem" in lowered):
        return "attention"
    if "nchwtonhwc" in lowered or "nhwctonchw" in lowered:
        return "layout transposes (cuDNN)"
    if any(key in lowered for key in ("fprop", "implicit_gemm", "winograd", "conv")):
        return "convolution"
    if any(key in lowered for key in ("gemm", "nvjet", "cutlass", "cublas", "matmul", "_mm_")):
        return "matmul"
    if "sort" in lowered:
        return "sort (NABLA mask)"
    if "triton" in lowered:
        return "fused (Triton)"
    return "other (aten)"


def kernel_table(prof: Any, stage: str, top: int = 30) -> dict[str, Any]:
    from torch.autograd import DeviceType

    rows = []
    for event in prof.key_averages():
        # Kernels only: an operator's row repeats the time of the kernels it launched.
        device_us = getattr(event, "self_device_time_total", 0) or 0
        if device_us > 0 and event.device_type == DeviceType.CUDA:
            rows.append((event.key, event.count, device_us / 1000.0))
    total = sum(ms for _, _, ms in rows) or 1.0
    rows.sort(key=lambda row: -row[2])
    kinds: dict[str, float] = {}
    for name, _, ms in rows:
        kinds[kind_of(name, stage)] = kinds.get(kind_of(name, stage), 0.0) + ms
    return {
        "total_ms": round(total, 1),
        "by_kind": {
            k: {"ms": round(v, 1), "share": round(v / total, 3)}
            for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])
        },
        "top": [
            {"kernel": n[:140], "calls": c, "ms": round(ms, 2), "share": round(ms / total, 3)}
            for n, c, ms in rows[:top]
        ],
    }


def table_text(table: dict[str, Any], title: str) -> str:
    lines = [f"# {title}: {table['total_ms']} ms of kernels", "", "| kind | ms | share |", "|---|---|---|"]
    lines += [f"| {k} | {v['ms']} | {v['share']:.1%} |" for k, v in table["by_kind"].items()]
    lines += ["", "| kernel | calls | ms | share |", "|---|---|---|---|"]
    lines += [f"| `{r['kernel']}` | {r['calls']} | {r['ms']} | {r['share']:.1%} |" for r in table["top"]]
    return "\n".join(lines) + "\n"


class Session:
    """The state shared by the sections: the bundle on disk, W1's plan and inputs, the reference outputs."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.started = time.monotonic()
        self.work = Path(args.work)
        self.out = Path(args.out)
        self.work.mkdir(parents=True, exist_ok=True)
        self.out.mkdir(parents=True, exist_ok=True)
        self.device = torch.device("cuda")
        self.results: dict[str, Any] = {"argv": sys.argv, "device": torch.cuda.get_device_name(), "sections": {}}
        self.bundle_path = self.work / "bundle"
        self.captured: dict[str, Any] = {}

    def left(self) -> float:
        return self.args.deadline - (time.monotonic() - self.started)

    def save(self) -> None:
        (self.out / "results.json").write_text(json.dumps(self.results, indent=1, default=str))

    def record(self, section: str, **values: Any) -> None:
        self.results["sections"].setdefault(section, {}).update(values)
        self.save()
        print(
            f"[{time.monotonic() - self.started:6.1f}s] {section}: {json.dumps(values, default=str)[:600]}", flush=True
        )

    # -- model and inputs
    def ensure_bundle(self) -> None:
        if not (self.bundle_path / "model_index.json").exists():
            from bench.run_bench import write_full_bundle

            started = time.perf_counter()
            write_full_bundle(self.bundle_path, self.device)
            self.results["write_bundle_s"] = round(time.perf_counter() - started, 1)

    def plan(self, precision: str = "bf16") -> Any:
        """W1's plan (`load` reads the bundle's traits first)."""
        from k6vsr_core.contract.params import UpscaleParams
        from k6vsr_core.contract.plan import make_plan
        from k6vsr_core.model.bundle import model_traits

        return make_plan((512, 768), 121, 24.0, UpscaleParams(scale=2, precision=precision), model_traits(self.info))

    def load(self, *, compiled: bool, fuse: bool) -> Any:
        from k6vsr_core.model.bundle import load_bundle
        from k6vsr_core.model.fast import compile_bundle
        from k6vsr_core.model.memory import apply_budget, budget_for

        self.ensure_bundle()
        bundle = load_bundle(str(self.bundle_path), device=self.device)
        self.info = bundle.info
        apply_budget(bundle, budget_for("auto", self.device, self.plan()))
        compile_bundle(bundle, compiled=compiled, fuse=fuse)
        return bundle

    def lr_tiles(self) -> tuple[torch.Tensor, Any]:
        plan = self.plan()
        chunk = plan.chunks[0]
        th, tw = plan.grid.latent_tile
        generator = torch.Generator().manual_seed(1)
        return torch.randn((len(chunk.tiles), 64, plan.latent_frames, th, tw), generator=generator), chunk

    def reference(self) -> tuple[torch.Tensor, torch.Tensor]:
        path = self.work / "reference.pt"
        saved = torch.load(path)
        return saved["latents"], saved["pixels"]


def denoise_fn(session: Session, bundle: Any, precision: str = "bf16") -> Callable[[], torch.Tensor]:
    from k6vsr_core.model import stages

    lr, chunk = session.lr_tiles()
    plan = session.plan(precision)
    return lambda: stages.denoise_chunk(bundle, lr, chunk, plan)


def decode_fn(bundle: Any, latent: torch.Tensor) -> Callable[[], torch.Tensor]:
    from k6vsr_core.model import stages

    return lambda: stages.decode_tile(bundle, latent)


def free(*objects: Any) -> None:
    del objects
    gc.collect()
    torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------------- sections


def section_reference(session: Session) -> None:
    bundle = session.load(compiled=False, fuse=False)
    switch = bundle.attention_hook
    first = switch.processors["nabla"][0]
    original = first.flex

    def recorder(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        if "q" not in session.captured:
            session.captured.update(q=query.clone(), k=key.clone(), v=value.clone(), block_mask=kwargs["block_mask"])
        return original(query, key, value, **kwargs)

    original_call = type(first).__call__

    def keep_sta(self: Any, attn: Any, hidden_states: Any, rotary_emb: Any, sparse_params: Any) -> Any:
        session.captured.setdefault("sta", sparse_params["sta_mask"])
        return original_call(self, attn, hidden_states, rotary_emb, sparse_params)

    first.flex = recorder
    type(first).__call__ = keep_sta  # type: ignore[method-assign]
    denoise = denoise_fn(session, bundle)
    started = time.perf_counter()
    try:
        latents = denoise()
        sync()
    finally:
        type(first).__call__ = original_call  # type: ignore[method-assign]
    first_s = time.perf_counter() - started
    first.flex = original
    denoise_s, latents = timed(denoise, repeats=1)
    decode = decode_fn(bundle, latents[0])
    decode_s, pixels = timed(decode, repeats=1)
    torch.save({"latents": latents, "pixels": pixels}, session.work / "reference.pt")
    mask = session.captured["block_mask"]
    kept = mask.kv_num_blocks.sum() + (mask.full_kv_num_blocks.sum() if mask.full_kv_num_blocks is not None else 0)
    density = float(kept) / (mask.kv_num_blocks.numel() * mask.kv_indices.shape[-1])
    torch.save({k: session.captured[k] for k in ("q", "k", "v")}, session.work / "layer0-qkv.pt")
    session.record(
        "reference",
        denoise_first_s=round(first_s, 2),
        denoise_s=round(denoise_s, 3),
        decode_s=round(decode_s, 3),
        layer0_block_density=round(density, 3),
        latents_shape=list(latents.shape),
        pixels_shape=list(pixels.shape),
    )
    free(bundle)


def warm_then_timed(fn: Callable[[], Any]) -> tuple[float, float, Any]:
    """The first call's seconds (it compiles, or loads compiled graphs), then `timed`'s median and result."""
    started = time.perf_counter()
    fn()
    sync()
    warm = time.perf_counter() - started
    return (warm, *timed(fn))


def measure_variant(session: Session, name: str, bundle: Any, precision: str = "bf16", profile: bool = False) -> None:
    ref_latents, ref_pixels = session.reference()
    denoise = denoise_fn(session, bundle, precision)
    warm_denoise, denoise_s, latents = warm_then_timed(denoise)
    decode_ref = decode_fn(bundle, ref_latents[0])
    warm_decode, decode_s, pixels = warm_then_timed(decode_ref)
    own_pixels = decode_fn(bundle, latents[0])()
    values: dict[str, Any] = {
        "warm_denoise_s": round(warm_denoise, 1),
        "warm_decode_s": round(warm_decode, 1),
        "denoise_chunk_s": round(denoise_s, 3),
        "dit_call_s_approx": round((denoise_s - 0.05) / 2, 3),
        "decode_tile_s": round(decode_s, 3),
        "latents_rel_error": rel_error(latents, ref_latents),
        "decode_of_reference_latents": pixel_match(pixels, ref_pixels),
        "end_to_end_pixels": pixel_match(own_pixels, ref_pixels),
        "peak_reserved_gib": round(torch.cuda.max_memory_reserved() / 1024**3, 1),
    }
    session.record(name, **values)
    if profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        for stage, fn in (("DiT", denoise), ("decode", decode_ref)):
            with torch_profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
                fn()
                sync()
            table = kernel_table(prof, stage)
            (session.out / f"kernels-{name}-{stage}.txt").write_text(table_text(table, f"{name}, {stage}"))
            session.record(name, **{f"profile_{stage}": {"total_ms": table["total_ms"], "by_kind": table["by_kind"]}})


def section_fast(session: Session) -> None:
    bundle = session.load(compiled=True, fuse=True)
    measure_variant(session, "fast", bundle, profile=True)
    session.fast_bundle = bundle  # type: ignore[attr-defined]


def section_unfused(session: Session) -> None:
    bundle = session.load(compiled=True, fuse=False)
    ref_latents, ref_pixels = session.reference()
    warm, seconds, pixels = warm_then_timed(decode_fn(bundle, ref_latents[0]))
    session.record(
        "unfused",
        warm_decode_s=round(warm, 1),
        decode_tile_s=round(seconds, 3),
        decode_of_reference_latents=pixel_match(pixels, ref_pixels),
    )
    free(bundle)


def section_flex(session: Session) -> None:
    from diffusers.models.transformers.transformer_kandinsky6_sr import nabla_block_mask  # noqa: F401
    from torch.nn.attention.flex_attention import flex_attention

    from k6vsr_core.model.fast import FLEX_KERNEL_OPTIONS

    if "q" not in session.captured:
        session.record("flex", skipped="needs the reference section in the same process (the block mask)")
        return
    q, k, v, mask = (session.captured[key] for key in ("q", "k", "v", "block_mask"))
    compiled = torch.compile(flex_attention, dynamic=False, fullgraph=True)
    baseline = None
    rows = {}
    for name, change in FLEX_VARIANTS.items():
        if session.left() < 25:
            rows[name] = {"skipped": "deadline"}
            continue
        options = {**FLEX_KERNEL_OPTIONS, **change}
        try:
            started = time.perf_counter()
            out = compiled(q, k, v, block_mask=mask, kernel_options=options)
            sync()
            compile_s = time.perf_counter() - started
            ms = event_ms(lambda options=options: compiled(q, k, v, block_mask=mask, kernel_options=options))
            if baseline is None:
                baseline = out
            rows[name] = {
                "options": options,
                "ms_per_layer": round(ms, 2),
                "compile_s": round(compile_s, 1),
                "max_abs_vs_shipped": float((out.float() - baseline.float()).abs().max()),
            }
        except Exception as err:  # noqa: BLE001 - a kernel option this torch refuses is a result too
            rows[name] = {"options": options, "error": f"{type(err).__name__}: {str(err)[:300]}"}
        session.record("flex", variants=rows)


def _conv_shapes(session: Session) -> list[dict[str, Any]]:
    """The distinct convolutions of one reference decode (diffusers' forms), with their counts."""
    from torch.overrides import TorchFunctionMode

    from k6vsr_core.model import stages

    seen: dict[tuple[Any, ...], int] = {}

    class Recorder(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if func is torch.nn.functional.conv3d:
                x, w = args[0], args[1]
                stride, padding = (
                    tuple(args[3]) if len(args) > 3 else (1, 1, 1),
                    tuple(args[4]) if len(args) > 4 else (0, 0, 0),
                )
                key = (tuple(x.shape), tuple(w.shape), stride, padding)
                seen[key] = seen.get(key, 0) + 1
            return func(*args, **(kwargs or {}))

    bundle = session.load(compiled=False, fuse=False)
    ref_latents, _ = session.reference()
    with Recorder():
        stages.decode_tile(bundle, ref_latents[0])
    free(bundle)
    return [
        {"x": list(k[0]), "w": list(k[1]), "stride": list(k[2]), "padding": list(k[3]), "count": n}
        for k, n in seen.items()
    ]


def conv_variants(
    x: torch.Tensor,
    w: torch.Tensor,
    stride: tuple[int, ...],
    recorded_pad: tuple[int, ...],
    inner: torch.Tensor,
    pad: tuple[int, ...],
) -> dict[str, Callable[[], Any]]:
    """One convolution in each form: as recorded, padding by the convolution, channels-last, 2-D over frames."""
    import torch.nn.functional as F

    inner_cl, w_cl = inner.to(memory_format=torch.channels_last_3d), w.to(memory_format=torch.channels_last_3d)
    variants: dict[str, Callable[[], Any]] = {
        "as_recorded": lambda: F.conv3d(x, w, None, stride, recorded_pad),
        "conv_pads": lambda: F.conv3d(inner, w, None, stride, pad),
        "channels_last": lambda: F.conv3d(inner_cl, w_cl, None, stride, pad),
    }
    if stride == (1, 1, 1):
        frames = inner.permute(0, 2, 1, 3, 4)[0].contiguous(memory_format=torch.channels_last)  # (T, C, H, W)
        taps = [w[:, :, t].contiguous(memory_format=torch.channels_last) for t in range(w.shape[2])]

        def frames_2d() -> torch.Tensor:
            count_out = frames.shape[0] - len(taps) + 1
            out = F.conv2d(frames[:count_out], taps[0], None, 1, pad[1:])
            for t in range(1, len(taps)):
                out = out + F.conv2d(frames[t : t + count_out], taps[t], None, 1, pad[1:])
            return out

        variants["frames_2d"] = frames_2d
    return variants


def section_convs(session: Session) -> None:
    shapes = _conv_shapes(session)
    totals: dict[str, float] = {}
    rows = []
    for shape in sorted(shapes, key=lambda s: -math.prod(s["x"]) * s["w"][0] * s["count"]):
        if session.left() < 20:
            break
        x_shape, w_shape, count = shape["x"], shape["w"], shape["count"]
        x = torch.randn(x_shape, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(w_shape, device="cuda", dtype=torch.bfloat16) * 0.02
        kt, kh, kw = w_shape[2:]
        recorded_pad = tuple(shape["padding"])
        if any(recorded_pad):  # already padded by the convolution
            inner, pad = x, recorded_pad
        else:  # diffusers padded height and width with F.pad: the same convolution on the unpadded input
            inner = x[:, :, :, kh // 2 : x.shape[3] - kh // 2, kw // 2 : x.shape[4] - kw // 2].contiguous()
            pad = (0, kh // 2, kw // 2)
        stride = tuple(shape["stride"])
        out_frames = (x_shape[2] - kt) // stride[0] + 1
        flop = 2 * math.prod(w_shape) * out_frames * inner.shape[3] * inner.shape[4]
        variants = conv_variants(x, w, stride, recorded_pad, inner, pad)
        row: dict[str, Any] = {"x": x_shape, "w": w_shape, "count": count, "gflop": round(flop / 1e9, 1)}
        for name, fn in variants.items():
            ms = event_ms(fn, repeats=3)
            row[name] = round(ms, 3)
            totals[name] = totals.get(name, 0.0) + ms * count
        for name, fn in (("conv_pads", variants["conv_pads"]), ("channels_last", variants["channels_last"])):
            torch.backends.cudnn.benchmark = True
            try:
                ms = event_ms(fn, repeats=3)
            finally:
                torch.backends.cudnn.benchmark = False
            row[f"{name}_benchmark"] = round(ms, 3)
            totals[f"{name}_benchmark"] = totals.get(f"{name}_benchmark", 0.0) + ms * count
        row["tflops_as_recorded"] = round(flop / row["as_recorded"] / 1e9, 1)
        rows.append(row)
        free(x, w, inner, variants)
        session.record("convs", rows=rows, totals_ms={k: round(v, 1) for k, v in totals.items()})


def section_fp8(session: Session) -> None:
    from k6vsr_core.device.precision import dit_for, fp8_unavailable

    reason = fp8_unavailable(session.device)
    if reason is not None:
        session.record("fp8", skipped=reason)
        return
    bundle = getattr(session, "fast_bundle", None) or session.load(compiled=True, fuse=True)
    started = time.perf_counter()
    dit_for(bundle, "fp8")
    session.record("fp8", convert_s=round(time.perf_counter() - started, 1))
    measure_variant(session, "fp8", bundle, precision="fp8", profile=True)


def deviation(value: torch.Tensor, reference: torch.Tensor) -> dict[str, float]:
    diff = value.float() - reference.float()
    return {"max_abs": round(float(diff.abs().max()), 5), "rel_l2": round(rel_error(value, reference), 6)}


def attention_kernels(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, masks: dict[str, Any]) -> dict[str, Any]:
    """The attention kernels of one layer: name -> (callable, the name of the output it is compared with)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.flex_attention import flex_attention

    from k6vsr_core.model.fast import FLEX_KERNEL_OPTIONS, _cudnn_attention

    flex = torch.compile(flex_attention, dynamic=False, fullgraph=True)
    options = dict(FLEX_KERNEL_OPTIONS)
    kernels: dict[str, Any] = {}
    for name, mask in masks.items():
        kernels[f"flex {name}"] = (lambda m=mask: flex(q, k, v, block_mask=m, kernel_options=options), "flex nabla")

    def sdpa(backend: Any) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v)

        return run

    kernels["dense cudnn"] = (lambda: _cudnn_attention(q, k, v), "flex all blocks")
    kernels["dense flash2"] = (sdpa(SDPBackend.FLASH_ATTENTION), "flex all blocks")
    kernels["dense efficient"] = (sdpa(SDPBackend.EFFICIENT_ATTENTION), "flex all blocks")
    fp8 = [t.to(torch.float8_e4m3fn) for t in (q, k, v)]
    kernels["fp8 flex nabla"] = (
        lambda: flex(*fp8, block_mask=masks["nabla"], kernel_options=options),
        "flex nabla",
    )
    kernels["fp8 dense sdpa"] = (lambda: F.scaled_dot_product_attention(*fp8), "flex all blocks")
    return kernels


def section_attention(session: Session) -> None:
    from diffusers.models.transformers.transformer_kandinsky6_sr import nabla_block_mask
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    from k6vsr_core.model.fast import FLEX_KERNEL_OPTIONS, fixed_density_block_mask

    if "q" not in session.captured:
        session.record("attention", skipped="needs the reference section in the same process (the block mask)")
        return
    q, k, v, nabla = (session.captured[key] for key in ("q", "k", "v", "block_mask"))
    sta = session.captured["sta"]
    blocks = q.shape[2] // 64
    every = torch.ones((*q.shape[:2], blocks, blocks), dtype=torch.bool, device=q.device)
    masks: dict[str, Any] = {
        "nabla": nabla,
        "sta floor": nabla_block_mask(q, k, sta, thr=0.0),
        **{f"{d:.0%}": fixed_density_block_mask(q, k, sta, d) for d in FIXED_DENSITIES},
        "all blocks": fixed_density_block_mask(q, k, every, 1.0),
    }
    densities = {name: round(block_density(mask), 4) for name, mask in masks.items()}
    rows: dict[str, Any] = {}
    outputs: dict[str, torch.Tensor] = {}
    for name, (fn, compare_with) in attention_kernels(q, k, v, masks).items():
        if session.left() < 30:
            rows[name] = {"skipped": "deadline"}
            continue
        try:
            started = time.perf_counter()
            out = fn()
            sync()
            first_s = time.perf_counter() - started
            ms = event_ms(fn)
            outputs.setdefault(name, out)
            row: dict[str, Any] = {"ms_per_layer": round(ms, 3), "first_call_s": round(first_s, 1)}
            if compare_with in outputs and compare_with != name:
                row[f"vs {compare_with}"] = deviation(out, outputs[compare_with])
            rows[name] = row
        except Exception as err:  # noqa: BLE001 - a kernel this torch or card refuses is a result too
            rows[name] = {"error": f"{type(err).__name__}: {str(err)[:300]}"}
        session.record("attention", densities=densities, kernels=rows)
    if session.left() > 120:
        # Inductor's own search over flex's kernel configurations, on NABLA's real mask.
        tuned = torch.compile(flex_attention, dynamic=False, fullgraph=True, mode="max-autotune-no-cudagraphs")
        try:
            started = time.perf_counter()
            out = tuned(q, k, v, block_mask=nabla)
            sync()
            first_s = time.perf_counter() - started
            ms = event_ms(lambda: tuned(q, k, v, block_mask=nabla))
            rows["flex nabla max-autotune"] = {
                "ms_per_layer": round(ms, 3),
                "first_call_s": round(first_s, 1),
                "vs flex nabla": deviation(out, outputs["flex nabla"]),
                "shipped_options": dict(FLEX_KERNEL_OPTIONS),
            }
        except Exception as err:  # noqa: BLE001
            rows["flex nabla max-autotune"] = {"error": f"{type(err).__name__}: {str(err)[:300]}"}
        session.record("attention", densities=densities, kernels=rows)
    del BlockMask


def block_density(mask: Any) -> float:
    kept = mask.kv_num_blocks.sum() + (mask.full_kv_num_blocks.sum() if mask.full_kv_num_blocks is not None else 0)
    return float(kept) / (mask.kv_num_blocks.numel() * mask.kv_indices.shape[-1])


def encode_seconds(session: Session, bundle: Any) -> float:
    """One W1 window's KVAE encode, hot (the median of three after a warm call)."""
    from k6vsr_core.model import stages

    plan = session.plan()
    height, width = plan.grid.padded_size
    generator = torch.Generator().manual_seed(2)
    video = torch.randint(0, 256, (plan.window_frames, 3, height, width), dtype=torch.uint8, generator=generator)
    stages.encode_clip(bundle, video)
    return timed(lambda: stages.encode_clip(bundle, video))[0]


def section_density(session: Session) -> None:
    """W1's GPU work with the DiT at fixed block densities, beside NABLA's own on random weights."""
    bundle = getattr(session, "fast_bundle", None)
    fast = session.results["sections"].get("fast", {})
    if bundle is None or "decode_tile_s" not in fast:
        session.record("density", skipped="needs the fast section in the same process")
        return
    plan = session.plan()
    chunks, tiles = len(plan.chunks), plan.grid.num_tiles
    encode_s = encode_seconds(session, bundle)
    switch = bundle.attention_hook
    stats = torch.zeros(2, dtype=torch.float64, device=session.device)

    def projection(chunk_s: float) -> float:
        return round(encode_s + chunks * chunk_s + tiles * fast["decode_tile_s"], 2)

    rows: dict[str, Any] = {
        "nabla (random weights)": {
            "denoise_chunk_s": fast["denoise_chunk_s"],
            "w1_gpu_work_s": projection(fast["denoise_chunk_s"]),
        }
    }
    denoise = denoise_fn(session, bundle)
    for label, threshold, density in (("sta floor", 0.0, None), *((f"{d:.0%}", None, d) for d in FIXED_DENSITIES)):
        if session.left() < 90:
            rows[label] = {"skipped": "deadline"}
            continue
        try:
            switch.nabla_settings(threshold=threshold, density=density, stats=stats)
            warm, chunk_s, _ = warm_then_timed(denoise)
            stats.zero_()
            denoise()
            kept, total = (float(x) for x in stats.tolist())
            rows[label] = {
                "block_density": round(kept / total, 4) if total else None,
                "warm_s": round(warm, 1),
                "denoise_chunk_s": round(chunk_s, 3),
                "w1_gpu_work_s": projection(chunk_s),
            }
        except Exception as err:  # noqa: BLE001
            rows[label] = {"error": f"{type(err).__name__}: {str(err)[:300]}"}
        finally:
            switch.nabla_settings()
        session.record("density", encode_s=round(encode_s, 3), chunks=chunks, tiles=tiles, rows=rows)


RUNNERS: dict[str, Callable[[Session], None]] = {
    "reference": section_reference,
    "fast": section_fast,
    "unfused": section_unfused,
    "flex": section_flex,
    "convs": section_convs,
    "fp8": section_fp8,
    "attention": section_attention,
    "density": section_density,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", required=True, help="bundle, reference outputs (kept for later calls)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--sections", default=",".join(SECTIONS))
    parser.add_argument("--cache-import", default=None, help="a `k6vsr cache export` file to import first")
    parser.add_argument("--deadline", type=float, default=520.0)
    args = parser.parse_args(argv)
    session = Session(args)
    if args.cache_import:
        from k6vsr_core.device.compile_cache import import_cache

        session.results["cache_import"] = import_cache(Path(args.cache_import))
    for name in args.sections.split(","):
        if name not in RUNNERS:
            parser.error(f"unknown section {name!r}; known: {', '.join(SECTIONS)}")
        if session.left() < COST[name] * 0.5:
            session.record(name, skipped=f"{session.left():.0f} s left, about {COST[name]} s needed")
            continue
        try:
            RUNNERS[name](session)
        except Exception as err:  # noqa: BLE001 - one failed section must not lose the others' figures
            session.record(name, error=f"{type(err).__name__}: {err}", traceback=traceback.format_exc()[-3000:])
    session.results["total_s"] = round(time.monotonic() - session.started, 1)
    session.save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
