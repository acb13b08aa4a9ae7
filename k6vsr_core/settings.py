"""Every `K6VSR_*` setting in one registry: its group, type, default and meaning.

Each group is a pydantic-settings model read from the environment when it is asked for (`read(Store)`), never at
import: a test or a parent process that sets a variable before calling sees it, whatever was imported first. A
value that does not parse fails with a `SettingsError` naming the variable. `child_env` is the one place that turns
settings into the environment of a process k6vsr starts. The table of docs/settings.md is `settings_table()`
(tests/house/test_settings.py keeps them equal).

Variables outside k6vsr's own (Prefect's `PREFECT_*`, torch's, `CUDA_VISIBLE_DEVICES`, `XDG_*`) keep their owners'
names and readers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, TypeVar, get_args, get_origin

from pydantic import Field, ValidationError, field_validator
from pydantic_core import ErrorDetails
from pydantic_settings import BaseSettings, SettingsConfigDict

from k6vsr_core.errors import ParameterError

PREFIX = "K6VSR_"


class SettingsError(ParameterError):
    """A `K6VSR_*` variable whose value the registry cannot take."""


class _Group(BaseSettings):
    # An empty value means unset: a parent clears a child's variable by writing "" (the environment has no delete).
    model_config = SettingsConfigDict(env_prefix=PREFIX, env_ignore_empty=True, extra="ignore", frozen=True)


def _word(value: Any) -> Any:
    """A choice's word in any case and with spaces around it (`K6VSR_LANES=Threads`, `K6VSR_DETERMINISTIC= off`)."""
    return value.strip().lower() if isinstance(value, str) else value


class Store(_Group):
    """The run store."""

    store: str | None = Field(None, description="run store root, a folder or an object-store URL (`--store`)")
    lease_seconds: float = Field(300.0, gt=0, description="how long a window's lease lasts without renewal")
    blend_wait: float = Field(3600.0, gt=0, description="seconds a blend waits for a missing tile before it fails")


class Server(_Group):
    """The local Prefect server and the state folders."""

    state_home: Path | None = Field(None, description="root of k6vsr's state folders (default `$XDG_STATE_HOME/k6vsr`)")
    server_home: Path | None = Field(None, description="the local Prefect server's state folder")
    server_port: int | None = Field(
        None, ge=0, le=65535, description="the local Prefect server's port (0: any free port)"
    )
    server_start_timeout: float = Field(180.0, gt=0, description="seconds to wait for the local Prefect server")
    home: Path | None = Field(None, description="the checkout the deployments' flow runs start in")
    api_key: str | None = Field(None, description="a client key of `k6vsr serve` (as `--api-key`)")


class Workers(_Group):
    """Warm workers and the processes a command computes in."""

    warm_workers: bool = Field(True, description="use running warm workers (`off` ignores them)")
    workers_home: Path | None = Field(None, description="the warm workers' state folder")
    workers_start_timeout: float = Field(300.0, gt=0, description="seconds to wait for warm workers to start")
    workers_warm_timeout: float = Field(1800.0, gt=0, description="seconds to wait for warm workers' model to load")
    workers_ready_timeout: float = Field(300.0, gt=0, description="seconds a flow waits for its workers")
    lanes: Literal["auto", "processes", "threads"] = Field(
        "auto", description="where a command's tiles compute: its own model and CPU-lane processes, or its threads"
    )
    cpu_lane_workers: int | None = Field(None, ge=1, description="CPU-lane workers (default: one per model worker)")
    warm_model: str | None = Field(None, description="the model a warm worker loads as it starts (set by k6vsr)")
    model_cache_size: int = Field(2, ge=1, description="models a worker keeps loaded, most recently used")

    @field_validator("lanes", "warm_workers", mode="before")
    @classmethod
    def _choice(cls, value: Any) -> Any:
        return _word(value)


class Compute(_Group):
    """The model and how it computes."""

    model: str | None = Field(None, description="the default `--model`: a hub repo id or a local folder")
    compile_cache: Path | None = Field(None, description="compiled kernels' cache (default `~/.cache/k6vsr/compile`)")
    compile_artifacts: Path | None = Field(None, description="a `k6vsr cache export` file each process imports")
    deterministic: bool = Field(True, description="deterministic kernels (`0` only to measure what they cost)")
    decoder_layout: Literal["channels_last", "channels_first"] = Field(
        "channels_last", description="the fast KVAE decoder's memory layout (`channels_first` only to measure)"
    )
    cpu_threads: int | None = Field(None, ge=1, description="torch's CPU threads (default: the cores this may use)")
    networks: str | None = Field(
        None,
        description="`module:function` giving other calls than the model's for its networks "
        "(`k6vsr_core.model.networks`)",
    )

    @field_validator("deterministic", "decoder_layout", mode="before")
    @classmethod
    def _choice(cls, value: Any) -> Any:
        return _word(value)


GROUPS: tuple[type[_Group], ...] = (Store, Server, Workers, Compute)
Group = TypeVar("Group", bound=_Group)


def env_name(field: str) -> str:
    return PREFIX + field.upper()


def read(group: type[Group]) -> Group:
    """The group's settings as the environment holds them now."""
    try:
        return group()
    except ValidationError as err:
        problems = []
        for error in err.errors():
            field = str(error["loc"][0]) if error["loc"] else "?"
            problems.append(f"{env_name(field)}={error.get('input')!r}{_problem(group, field, error)}")
        raise SettingsError("; ".join(problems)) from None


def _problem(group: type[_Group], field: str, error: ErrorDetails) -> str:
    """The words after the value: a choice lists its words as the command's flags do."""
    info = group.model_fields.get(field)
    if error["type"] == "literal_error" and info is not None and get_origin(info.annotation) is Literal:
        return " must be one of " + ", ".join(str(word) for word in get_args(info.annotation))
    return ": " + error["msg"]


def child_env(**values: Any) -> dict[str, str]:
    """Settings as environment entries for a process k6vsr starts (None clears one: ""); unknown names refused."""
    known = {name for group in GROUPS for name in group.model_fields}
    unknown = sorted(set(values) - known)
    if unknown:
        raise KeyError(f"no such setting: {', '.join(unknown)}")
    return {env_name(name): "" if value is None else str(value) for name, value in values.items()}


def settings_table() -> str:
    """The table of docs/settings.md: every variable, its group, default and meaning."""
    rows = ["| variable | group | default | meaning |", "|---|---|---|---|"]
    for group in GROUPS:
        for name, field in group.model_fields.items():
            default = "" if field.default is None else f"`{field.default}`"
            rows.append(f"| `{env_name(name)}` | {group.__name__.lower()} | {default} | {field.description} |")
    return "\n".join(rows)
