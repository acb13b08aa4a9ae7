"""The state folder of a detached service (the local Prefect server, the warm workers): where it lives, what it holds.

A service started in its own session outlives the command that started it; the next command finds it through its
folder alone. `<stem>` names each file in it:

    <stem>.json   the service's record (a pydantic model): its pid and where to reach it, written atomically
    <stem>.log    what the service prints
    <stem>.lock   held (fcntl) while a command checks, starts or stops the service, so racing commands start one

A recorded pid may outlive its process and be given to another: the record keeps the process's start time too, and
`storage.processes.alive` asks for both.

Both services start the same way (`StateFolder.launch`): a short-lived launcher forks the service into its own
session, with its output appended to the log, writes its record and exits. So the service is nobody's child (a
long-lived command such as `k6vsr serve` never holds it as a zombie), killing the command or its process group never
reaches it, and a command killed right after the launch still leaves a recorded service, which the next command
finds and waits for.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel

from k6vsr_core import settings
from storage.processes import alive
from storage.records import atomic_write_bytes

LOG_KEEP_BYTES = 1 << 20

Record = TypeVar("Record", bound=BaseModel)


def state_home(explicit: Path | None, name: str) -> Path:
    """`explicit` (a folder's own setting, e.g. `K6VSR_SERVER_HOME`), else `$K6VSR_STATE_HOME/<name>`, else
    `$XDG_STATE_HOME/k6vsr/<name>` (`~/.local/state` if unset).

    Never under `K6VSR_HOME`: that names the checkout the deployments' flow runs start in, and state written there
    would land among the code."""
    if explicit is not None:
        return explicit.expanduser()
    root = settings.read(settings.Server).state_home
    if root is not None:
        return Path(root).expanduser() / name
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state).expanduser() / "k6vsr" / name


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

    def launch(self, argv: list[str], env: dict[str, str], fields: dict[str, object]) -> None:
        """Start `argv` detached (see above), from this folder, and record it: `fields` with its `pid` and
        `process_start`, unless the service has already written its own record. Read the record back with `read`."""
        self.make()
        self.rotate_log()
        launcher = subprocess.run(
            [sys.executable, "-c", _LAUNCHER, str(self.record_path), str(self.log_path), json.dumps(fields), *argv],
            env=env,
            cwd=self.path,  # never the command's folder, which the service would otherwise keep busy for its lifetime
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            start_new_session=True,
            check=False,
            timeout=60,
        )
        if launcher.returncode != 0:
            raise LaunchFailed(launcher.stderr.strip()[-2000:] or f"the launcher exited with {launcher.returncode}")

    def launch_recorded(
        self, argv: list[str], env: dict[str, str], fields: dict[str, object], model_type: type[Record]
    ) -> Record:
        """`launch`, then its record as `model_type`; LaunchFailed if it left none."""
        self.launch(argv, env, fields)
        record = self.read(model_type)
        if record is None:
            raise LaunchFailed(f"no record in {self.record_path}")
        return record

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


class LaunchFailed(RuntimeError):
    """The launcher could not start the service; the message is what it printed."""


# Run by `StateFolder.launch` as `python -c`: the record is linked into place, so it appears whole, and only where the
# service has not written its own in the meantime.
_LAUNCHER = """
import json, os, subprocess, sys
record_path, log_path, fields = sys.argv[1:4]
with open(log_path, "ab") as log:
    process = subprocess.Popen(sys.argv[4:], stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True, close_fds=True)
try:
    with open(f"/proc/{process.pid}/stat") as stat:
        process_start = int(stat.read().rsplit(")", 1)[1].split()[19])
except OSError:
    process_start = None
record = {**json.loads(fields), "pid": process.pid, "process_start": process_start}
partial = f"{record_path}.{os.getpid()}.partial"
with open(partial, "w") as handle:
    json.dump(record, handle)
    handle.flush()
    os.fsync(handle.fileno())
try:
    os.link(partial, record_path)
except FileExistsError:
    pass
finally:
    os.unlink(partial)
"""


def now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")
