"""The HTTP server's configuration: its resource limits and the options of `k6vsr serve` that set them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from k6vsr_core import settings
from k6vsr_core.errors import ParameterError


@dataclass(frozen=True)
class Limits:
    """What one request, and all of them together, may make the server spend. Each is a `serve` option, whose
    default is set there."""

    max_upload_bytes: int  # --max-upload-mb: the clip of one upload
    max_fields: int  # --max-fields: fields of one request besides the clip
    max_fields_bytes: int  # --max-fields-kb: all of a request but the clip (a JSON body, form fields)
    max_queued: int  # --max-queued: jobs waiting for a worker
    input_quota_bytes: int  # --input-quota-mb: inputs on disk of queued and running jobs
    max_output_pixels: int  # --max-output-mpx: frames x width x height of one job's result
    retention_s: float  # --retention-hours: finished jobs are deleted this long after they finished
    max_tiles: int = 2048  # --max-tiles: tile tasks of one job (tiles of a window x windows)
    max_windows: int = 512  # --max-windows: windows of one job
    upload_timeout_s: float = 900.0  # --upload-timeout-s: a request body must arrive within this time, else 408
    # --min-upload-kb-s, --upload-rate-window-s: while a request body arrives, each window must bring this many
    # bytes a second on average, else 408 (0: no floor)
    min_upload_bytes_per_s: float = 8 << 10
    upload_rate_window_s: float = 30.0
    uploads_per_key: int | None = None  # --max-uploads-per-key: request bodies one key sends at once (None: any)
    queued_per_key: int | None = None  # --max-queued-per-key: queue places one key holds (None: its share only)
    finished_quota_bytes: int | None = None  # --finished-quota-mb: disk finished jobs may keep (None: no budget)
    finished_per_key: int | None = None  # --max-finished-per-key: finished job records one key keeps (None: any)
    memory_budget_bytes: int | None = None  # --memory-budget-mb: host memory of the server and its jobs (None: any)

    @property
    def max_request_bytes(self) -> int:
        return self.max_upload_bytes + self.max_fields_bytes


@dataclass(frozen=True)
class Connections:
    """What open connections may cost: their number, and how long one may sit without a request (see `serving`)."""

    max_connections: int = 1000  # --max-connections: open at once; past it the longest waiting one is closed
    header_timeout_s: float = 10.0  # --header-timeout-s: a request's head (line and headers) must arrive within this
    keep_alive_s: float = 5.0  # --keep-alive-s: an idle keep-alive connection is closed after this
    send_timeout_s: float = 30.0  # --send-timeout-s: bytes of an answer waiting for the client must be taken in this
    send_buffer_bytes: int | None = None  # --send-buffer-kb: the kernel's send buffer of a connection (None: its own)
    max_header_bytes: int = 16 << 10  # a request head larger than this is refused (400) by h11


@dataclass(frozen=True)
class ServerConfig:
    store_root: Path  # the server's own folder: job records, inputs, outputs, its Prefect home; the runs too by default
    limits: Limits
    allow_paths: tuple[Path, ...] = ()
    api_keys: tuple[str, ...] = ()
    admin_keys: tuple[str, ...] = ()  # keys that see, read and delete every job
    list_jobs: bool = False  # without keys: whether GET /v1/videos lists the jobs
    umask: int = 0o077
    workers: int = 1
    model_name: str = ""
    run_root: str | Path | None = None  # where the runs live when not in store_root (e.g. an object-store URL)
    connections: Connections = Connections()

    @property
    def runs(self) -> str | Path:
        return self.run_root or self.store_root


def _keys_in(files: list[str]) -> list[str]:
    """The keys of `--api-key-file` files: one a line; blank lines and `#` comments are skipped."""
    keys = []
    for name in files:
        try:
            lines = Path(name).expanduser().read_text().splitlines()
        except (OSError, UnicodeDecodeError) as err:
            reason = getattr(err, "strerror", None) or err
            raise ParameterError(f"--api-key-file {name}: cannot be read ({reason})") from None
        keys += [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]
    return keys


def _check_key(key: str, source: str) -> str:
    """A key a client can send: `Authorization: Bearer <key>` is read with the spaces around the key dropped, and
    carries printable ASCII only, so any other key could never authenticate. Refused at start, never echoed."""
    if key != key.strip():
        raise ParameterError(f"{source}: a key has leading or trailing spaces, so no client could send it; remove them")
    if not all(" " <= char <= "~" for char in key):
        raise ParameterError(
            f"{source}: a key holds a character other than printable ASCII, so no client could send it"
        )
    return key


def _at_least(value: float, minimum: float, flag: str) -> float:
    if value < minimum:
        raise ParameterError(f"{flag} must be at least {minimum:g}, not {value:g}")
    return value


def memory_budget(megabytes: float | None) -> int:
    """`--memory-budget-mb` in bytes; by default 80 % of this machine's memory."""
    if megabytes is None:
        import psutil

        return int(psutil.virtual_memory().total * 0.8)
    return int(_at_least(megabytes, 256, "--memory-budget-mb")) << 20


def _check_store_outside(store_root: Path, run_root: str | Path | None, roots: list[Path]) -> None:
    """The store (and a run store on this disk) must not overlap an `--allow-path` folder: a `video_path` into it
    would read another key's inputs and outputs."""
    stores = [store_root] + ([run_root] if isinstance(run_root, Path) else [])
    for store in stores:
        store = store.expanduser().resolve()
        for root in roots:
            if store.is_relative_to(root) or root.is_relative_to(store):
                raise ParameterError(
                    f"--allow-path {root}: overlaps the server's store {store}, so a video_path could read other "
                    "jobs' files; allow a folder outside the store"
                )


def config_from(args: Any, store_root: Path, model_name: str, run_root: str | Path | None = None) -> ServerConfig:
    roots = []
    for raw in args.allow_path or []:
        root = Path(raw).expanduser().resolve()
        if not root.is_dir():
            raise ParameterError(f"--allow-path {raw}: not a directory")
        roots.append(root)
    max_queued = int(_at_least(args.max_queued, 1, "--max-queued"))
    # One key (or, without keys, one client address) never holds more than half of the admission slots, so its
    # stalled uploads always leave room for another.
    uploads_per_key = min(int(_at_least(args.max_uploads_per_key, 1, "--max-uploads-per-key")), max(1, max_queued // 2))
    env_key = settings.read(settings.Server).api_key
    given = [(key, "--api-key") for key in args.api_key or ()] or ([(env_key, "K6VSR_API_KEY")] if env_key else [])
    api_keys = [_check_key(key, source) for key, source in given if key] + _keys_in(args.api_key_file or [])
    admin_keys = [_check_key(key, "--admin-key") for key in args.admin_key or () if key]
    _check_store_outside(Path(store_root), run_root, roots)
    limits = Limits(
        max_upload_bytes=int(_at_least(args.max_upload_mb, 1, "--max-upload-mb")) << 20,
        max_fields=int(_at_least(args.max_fields, 1, "--max-fields")),
        max_fields_bytes=int(_at_least(args.max_fields_kb, 1, "--max-fields-kb")) << 10,
        max_queued=max_queued,
        input_quota_bytes=int(
            _at_least(args.input_quota_mb, args.max_upload_mb, "--input-quota-mb (at least --max-upload-mb)")
        )
        << 20,
        max_output_pixels=int(_at_least(args.max_output_mpx, 0.001, "--max-output-mpx") * 10**6),
        retention_s=_at_least(args.retention_hours, 0, "--retention-hours") * 3600.0,
        max_tiles=int(_at_least(args.max_tiles, 1, "--max-tiles")),
        max_windows=int(_at_least(args.max_windows, 1, "--max-windows")),
        upload_timeout_s=_at_least(args.upload_timeout_s, 0.1, "--upload-timeout-s"),
        min_upload_bytes_per_s=_at_least(args.min_upload_kb_s, 0, "--min-upload-kb-s") * 1024,
        upload_rate_window_s=_at_least(args.upload_rate_window_s, 0.1, "--upload-rate-window-s"),
        uploads_per_key=uploads_per_key,
        queued_per_key=None
        if args.max_queued_per_key is None
        else int(_at_least(args.max_queued_per_key, 1, "--max-queued-per-key")),
        finished_quota_bytes=int(_at_least(args.finished_quota_mb, 0, "--finished-quota-mb")) << 20,
        finished_per_key=int(_at_least(args.max_finished_per_key, 1, "--max-finished-per-key")),
        memory_budget_bytes=memory_budget(args.memory_budget_mb),
    )
    connections = Connections(
        max_connections=int(_at_least(args.max_connections, 16, "--max-connections")),
        header_timeout_s=_at_least(args.header_timeout_s, 0.1, "--header-timeout-s"),
        keep_alive_s=_at_least(args.keep_alive_s, 0.1, "--keep-alive-s"),
        send_timeout_s=_at_least(args.send_timeout_s, 0.1, "--send-timeout-s"),
        send_buffer_bytes=None
        if args.send_buffer_kb is None
        else int(_at_least(args.send_buffer_kb, 16, "--send-buffer-kb")) << 10,
    )
    try:
        umask = int(args.umask, 8)
    except ValueError:
        raise ParameterError(f"--umask {args.umask!r} is not an octal mask such as 077 or 027") from None
    if not 0 <= umask <= 0o777:
        raise ParameterError(f"--umask {args.umask!r} is not an octal mask such as 077 or 027")
    return ServerConfig(
        store_root=Path(store_root),
        allow_paths=tuple(roots),
        api_keys=tuple(key for key in api_keys if key),
        admin_keys=tuple(admin_keys),
        list_jobs=bool(args.list_jobs),
        limits=limits,
        umask=umask,
        workers=max(1, int(getattr(args, "workers", 1) or 1)),
        model_name=model_name,
        run_root=run_root,
        connections=connections,
    )
