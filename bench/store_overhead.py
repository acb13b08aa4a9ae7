"""The run store's overhead in an S3 bucket against a local folder: the clip flow on the CPU with the tiny bundle.

    python bench/store_overhead.py [--work DIR] [--long 250x64x64] [--append] [--machine TEXT]

The bucket is moto's S3 server on loopback, started here (what the tests use), so the figures are the cost of the
object-store path itself (uploads, conditional writes, listings, one object per record and log line), not of a
network. Two clips (24 fps, with a tone): the demo's (128x96, 9 frames, as `k6vsr demo` makes it) and a long one,
`--long FRAMESxWIDTHxHEIGHT` (default 250 frames of 64x64: three windows, decoded in minutes on a small CPU). Each
runs with the default parameters, in one process, the model loaded once (a warm-up run comes first, unmeasured):

- `first`: a fresh run, every stage computed, into a new local store, then into a new prefix of the bucket;
- `rerun`: the same command again, everything reused, only the output published (pure store reads).

The two stores' outputs are compared byte for byte. A markdown table goes to stdout; `--append` also appends it,
dated, with the machine and the command, to bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import platform
import shlex
import sys
import tempfile
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def start_endpoint() -> object:
    """moto's S3 server on 127.0.0.1, and the AWS_* settings that point s3fs at it."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    os.environ.update(
        AWS_ENDPOINT_URL=f"http://{host}:{port}",
        AWS_ACCESS_KEY_ID="bench",
        AWS_SECRET_ACCESS_KEY="bench",
        AWS_DEFAULT_REGION="us-east-1",
    )
    return server


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, default=None, help="folder for the bundle, clips, stores (default: temp)")
    parser.add_argument("--long", default="250x64x64", help="the long clip: FRAMESxWIDTHxHEIGHT")
    parser.add_argument("--append", action="store_true", help="append the table to bench/RESULTS.md")
    parser.add_argument("--machine", default=f"{os.cpu_count()}-core CPU", help="how RESULTS.md names the machine")
    args = parser.parse_args()

    import s3fs

    from flows.orchestrate import prefect_api, run_clip
    from k6vsr_core.contract.params import UpscaleParams
    from k6vsr_core.media.sample import make_sample_clip
    from k6vsr_core.model.tiny_bundle import make_tiny_bundle
    from runtime.prefect_server import stop_server
    from service.runs import ModelSpec, prepare_run

    work = (args.work or Path(tempfile.mkdtemp(prefix="k6vsr-store-bench-"))).resolve()
    work.mkdir(parents=True, exist_ok=True)
    server = start_endpoint()
    bucket = f"k6vsr-bench-{uuid.uuid4().hex[:8]}"
    s3fs.S3FileSystem().mkdir(bucket)
    bundle = work / "tiny-bundle"
    if not (bundle / "model_index.json").is_file():
        make_tiny_bundle(bundle)
    model = ModelSpec(model=str(bundle), device="cpu")
    params = UpscaleParams()
    home = work / "prefect"
    rows: list[list[str]] = []
    try:
        with prefect_api(home):
            warm = make_sample_clip(work / "warm.mp4", width=64, height=64, num_frames=1)
            run_clip(prepare_run(warm, params, model, work / "warm-store"), str(work / "warm-out.mp4"), model).summary()
            long_clip = tuple(int(part) for part in args.long.split("x"))
            for frames, width, height in ((9, 128, 96), long_clip):
                clip = work / f"clip-{frames}x{width}x{height}.mp4"
                if not clip.is_file():
                    make_sample_clip(clip, width=width, height=height, num_frames=frames, fps=24, audio=True)
                label = uuid.uuid4().hex[:6]
                stores = {"local folder": str(work / f"store-{label}"), "S3 (moto, loopback)": f"s3://{bucket}/{label}"}
                seconds: dict[tuple[str, str], float] = {}
                digests = set()
                for kind, store in stores.items():
                    for attempt in ("first", "rerun"):
                        out = work / f"out-{label}-{len(seconds)}.mp4"
                        started = time.perf_counter()
                        summary = run_clip(prepare_run(clip, params, model, store), str(out), model).summary()
                        seconds[kind, attempt] = time.perf_counter() - started
                        digests.add(hashlib.sha256(out.read_bytes()).hexdigest())
                        print(f"{frames} frames, {kind}, {attempt}: {seconds[kind, attempt]:.1f} s", flush=True)
                if len(digests) != 1:
                    raise SystemExit(f"{frames} frames: the outputs differ between the stores ({len(digests)} digests)")
                tiles = summary.tiles_total
                for attempt in ("first", "rerun"):
                    local, remote = seconds["local folder", attempt], seconds["S3 (moto, loopback)", attempt]
                    rows.append(
                        [
                            f"{width}x{height}, {frames} frames ({tiles} items)",
                            attempt,
                            f"{local:.1f}",
                            f"{remote:.1f}",
                            f"{remote - local:+.1f}",
                            f"{remote / local:.2f}",
                        ]
                    )
    finally:
        stop_server(home)
        server.stop()  # type: ignore[attr-defined]

    table = "\n".join(
        [
            "| clip | run | local folder (s) | S3 bucket (s) | difference (s) | S3 / local |",
            "|---|---|---|---|---|---|",
            *("| " + " | ".join(row) + " |" for row in rows),
        ]
    )
    print(table)
    if args.append:
        command = "python bench/store_overhead.py " + shlex.join(sys.argv[1:])
        day = datetime.now(UTC).strftime("%Y-%m-%d")
        text = (
            f"\n## {day}: the run store in an S3 bucket against a local folder (CPU, tiny bundle)\n\n"
            f"Machine: {args.machine} ({platform.processor() or platform.machine()}). Command: `{command}`. "
            "The bucket is moto's S3 server on loopback, so this is the cost of the object-store path, not of a "
            "network. `first`: a fresh run; `rerun`: everything reused, the output published. The outputs of the "
            "two stores are the same bytes.\n\n"
            f"{table}\n"
        )
        with (ROOT / "bench" / "RESULTS.md").open("a") as handle:
            handle.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
