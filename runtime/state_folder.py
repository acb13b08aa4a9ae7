"""The state folder of a detached service (the local Prefect server, the warm workers): where it lives, what it holds.

A service started in its own session outlives the command that started it; the next command finds it through its
folder alone. `<stem>` names each file in it:

    <stem>.json   the service's record (a pydantic model): its pid and where to reach it, written atomically
    <stem>.log    what the service prints
    <stem>.lock   held (fcntl) while a command checks, starts or stops the service, so racing commands start one

A recorded pid may outlive its process and be given to another: the record keeps the process's start time too, and
`storage.processes.alive` asks for both.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel

from storage.processes import alive
from storage.records import atomic_write_bytes

LOG_KEEP_BYTES = 1 << 20

Record = TypeVar("Record", bound=BaseModel)


def state_home(env_var: str, name: str) -> Path:
    """`$<env_var>`, else `$K6VSR_HOME/<name>`, else `$XDG_STATE_HOME/k6vsr/<name>` (`~/.local/state` if unset)."""
    explicit = os.environ.get(env_var)
    if explicit:
        return Path(explicit).expanduser()
    k6vsr_home = os.environ.get("K6VSR_HOME")
    if k6vsr_home:
        return Path(k6vsr_home).expanduser() / name
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "k6vsr" / name


@dataclass(frozen=True)
class StateFolder:
    path: Path
    stem: str

    @property
    def record_path(self) -> Path:
        return self.path / f"{self.stem}.json"

    @property
    def log_path(self) -> Path:
        return self.path / f"{self.stem}.log"

    def make(self) -> None:
        # Owner-only: the server's history and the logs kept here name every clip and folder the user ran.
        self.path.mkdir(mode=0o700, parents=True, exist_ok=True)

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """The folder's lock: one command at a time checks, starts, stops or clears the service."""
        self.make()
        with open(self.path / f"{self.stem}.lock", "a") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def read(self, model_type: type[Record]) -> Record | None:
        """The record, or None where there is none or it does not parse."""
        try:
            return model_type.model_validate_json(self.record_path.read_bytes())
        except (OSError, ValueError):
            return None

    def write(self, record: BaseModel) -> None:
        atomic_write_bytes(self.record_path, record.model_dump_json().encode())

    def remove_record(self) -> None:
        self.record_path.unlink(missing_ok=True)

    def stop(self, model_type: type[Record], terminate: Callable[[Record], None]) -> bool:
        """Under the lock, end the process the record names (`terminate`; the record has its `pid` and
        `process_start`) and drop the record. False if it was not running."""
        with self.locked():
            record = self.read(model_type)
            running = record is not None and alive(record.pid, record.process_start)  # type: ignore[attr-defined]
            if record is not None:
                terminate(record)
            self.remove_record()
        return running

    def rotate_log(self) -> None:
        """Each start appends to the log: past `LOG_KEEP_BYTES`, keep the previous log, once, and start anew."""
        with contextlib.suppress(OSError):
            if self.log_path.stat().st_size > LOG_KEEP_BYTES:
                self.log_path.replace(self.log_path.with_suffix(".log.1"))

    def log_tail(self, chars: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


def now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")
