"""Which settings make the compiled KVAE decoder give the same bytes in every process (the same-bytes issue).

The device check's same-bytes runs (bench/RESULTS.md, 2026-12-02) showed every stage's checksums equal across
processes but the decode's: processes that compiled the decoder from a cold cache, several at once, or that decoded
without having denoised first, each decoded the same stored latent to other pixels. This script isolates the
decoder: for each variant, `--processes` fresh processes at once, each with a compile cache of its own (cold, as in
the failing runs), load the bundle the command's way, place it under the W2 clip's budget, decode one seeded latent
tile twice, and print the output's digest and the second (hot) decode's time.

    python3 bench/decode_determinism.py --bundle /tmp/k6vsr-check/bundle --out $OUT/decode.json

Variants: `compiled` (the settings as shipped), `strict` (also `torch.use_deterministic_algorithms(True,
warn_only=True)`, Inductor's pointwise autotuning and RBLOCK scaling off), `eager` (the decoder not compiled).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("compiled", "strict", "eager")


def child(variant: str, bundle_path: str, device_name: str = "cuda") -> dict[str, object]:
    import torch

    from k6vsr_core.contract.params import UpscaleParams
    from k6vsr_core.contract.plan import make_plan
    from k6vsr_core.model import stages
    from k6vsr_core.model.bundle import load_bundle, model_traits
    from k6vsr_core.model.fast import compile_bundle
    from k6vsr_core.model.memory import apply_budget, budget_for

    device = torch.device(device_name)
    bundle = load_bundle(bundle_path, device=device)
    if variant == "strict":
        from torch._inductor import config as inductor_config

        torch.use_deterministic_algorithms(True, warn_only=True)
        inductor_config.triton.autotune_pointwise = False
        if hasattr(inductor_config, "dynamic_scale_rblock"):
            inductor_config.dynamic_scale_rblock = False
    plan = make_plan((256, 384), 33, 24.0, UpscaleParams(scale=2), model_traits(bundle.info))
    apply_budget(bundle, budget_for("auto", device, plan))
    compile_bundle(bundle, compiled=variant != "eager")
    generator = torch.Generator().manual_seed(7)
    frames = plan.latent_frames
    height, width = (side // 16 for side in plan.grid.base)
    latent = torch.randn((int(bundle.vae.config.latent_channels), frames, height, width), generator=generator)
    digests, seconds = [], []
    for _ in range(2):
        started = time.perf_counter()
        pixels = stages.decode_tile(bundle, latent)
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds.append(round(time.perf_counter() - started, 3))
        digests.append(hashlib.sha256(pixels.numpy().tobytes()).hexdigest()[:16])
    return {"variant": variant, "pid": os.getpid(), "digests": digests, "seconds": seconds, "shape": list(latent.shape)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundle", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--processes", type=int, default=3)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--deadline", type=float, default=480)
    parser.add_argument("--device", default="cuda", help="cpu: a smoke test of the script with a tiny bundle")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.bundle, args.device)))
        return 0
    started, results = time.time(), []
    caches = Path(tempfile.mkdtemp(prefix="decode-determinism-"))

    def run(variant: str, index: int) -> dict[str, object]:
        env = {**os.environ, "K6VSR_COMPILE_CACHE": str(caches / f"{variant}-{index}")}
        env.pop("TORCHINDUCTOR_CACHE_DIR", None)
        argv = [
            sys.executable,
            __file__,
            "--child",
            variant,
            "--bundle",
            args.bundle,
            "--out",
            "-",
            "--device",
            args.device,
        ]
        left = max(30.0, args.deadline - (time.time() - started))
        try:
            done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=left, cwd=ROOT)
        except subprocess.TimeoutExpired:
            return {"variant": variant, "error": "deadline"}
        if done.returncode != 0:
            return {"variant": variant, "error": done.stderr.strip().splitlines()[-3:]}
        return json.loads(done.stdout.strip().splitlines()[-1])

    for variant in args.variants.split(","):
        if time.time() - started > args.deadline - 60:
            results.append({"variant": variant, "error": "not run: deadline"})
            continue
        with ThreadPoolExecutor(args.processes) as pool:
            group = list(pool.map(lambda i, v=variant: run(v, i), range(args.processes)))
        results += group
        digests = {d for r in group for d in r.get("digests", [])}
        print(f"{variant}: {len(digests)} distinct digest(s) over {args.processes} processes x 2 decodes: {group}")
        Path(args.out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
