"""Which calls compute the three networks: the model's (`k6vsr_core.model.stages`), or others a caller injects.

`K6VSR_NETWORKS` names a `module:function` (the syntax of a package's entry points) that returns the calls to use
instead, or None for the model's. It is read at each call, so every process a command starts, which inherits the
variable, injects the same calls, and a process that clears it gets the model's again. The calls injected carry an
`identity`, added to the model's identity in the run key (`storage.manifest.run_key`): their runs never share a
store's items with the model's, and the model's runs keep their keys.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from k6vsr_core import settings
from k6vsr_core.errors import ParameterError

if TYPE_CHECKING:
    import torch

    from k6vsr_core.contract.plan import ClipPlan, TileChunk
    from k6vsr_core.model.bundle import ModelBundle


class Networks(Protocol):
    """The three network calls of `k6vsr_core.model.stages`, with their signatures."""

    def encode_clip(self, bundle: ModelBundle, video: torch.Tensor) -> torch.Tensor: ...

    def denoise_chunk(
        self,
        bundle: ModelBundle,
        lr_tiles: torch.Tensor,
        chunk: TileChunk,
        plan: ClipPlan,
        on_step: Callable[[int], None] | None = None,
    ) -> torch.Tensor: ...

    def decode_tile(self, bundle: ModelBundle, latent: torch.Tensor, depth: int = 8) -> torch.Tensor: ...


class InjectedNetworks(Networks, Protocol):
    """Calls in place of the model's, and what they add to the model's identity (never empty)."""

    identity: str


ENV = settings.env_name("networks")


@functools.cache
def _provider(spec: str) -> Callable[[], InjectedNetworks | None]:
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise ParameterError(f"{ENV}={spec!r}: expected module:function")
    try:
        provider: Callable[[], InjectedNetworks | None] = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as err:
        raise ParameterError(f"{ENV}={spec!r}: {err}") from None
    if not callable(provider):
        raise ParameterError(f"{ENV}={spec!r}: {attribute} is not a function")
    return provider


def injected() -> InjectedNetworks | None:
    """The calls injected through `K6VSR_NETWORKS`, or None while the model's compute."""
    spec = settings.read(settings.Compute).networks
    if spec is None:
        return None
    calls = _provider(spec)()
    if calls is not None and not calls.identity:
        raise ParameterError(f"{ENV}={spec!r}: the calls it returns have no identity, so their runs would share keys")
    return calls


def current() -> Networks:
    """The calls that compute now: the injected ones, else the model's."""
    calls = injected()
    if calls is not None:
        return calls
    from k6vsr_core.model import stages

    return stages


def identity_mark() -> str:
    """What the model's identity gains in the run key: the injected calls' identity, empty for the model's."""
    calls = injected()
    return "" if calls is None else calls.identity
