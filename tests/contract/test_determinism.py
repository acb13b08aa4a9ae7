"""The process-wide kernel settings (k6vsr_core.device.determinism): applied where every computing process loads its
model, before its first kernel, and left at the libraries' defaults only when asked, to measure their cost."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch._inductor import config as inductor_config

from k6vsr_core.device.compute import apply_profile, default_profile
from k6vsr_core.device.determinism import CUBLAS_ENV, CUBLAS_WORKSPACE, SWITCH_ENV, apply_kernel_settings
from k6vsr_core.model.bundle import load_bundle


@pytest.fixture
def library_defaults(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The settings as a process starts (with autotuning asked for), restored after the test. (Inductor's config is
    patched with its own context manager: monkeypatch's undo deletes a config entry instead of restoring it.)"""
    monkeypatch.delenv(CUBLAS_ENV, raising=False)
    monkeypatch.delenv(SWITCH_ENV, raising=False)
    cudnn = torch.backends.cudnn
    algorithms = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(False)
    strict = {"triton.autotune_pointwise": True, "dynamic_scale_rblock": True}
    try:
        with (
            inductor_config.patch(deterministic=False, max_autotune=True, coordinate_descent_tuning=True),
            inductor_config.patch(strict),
            cudnn.flags(enabled=cudnn.enabled, benchmark=True, deterministic=False, allow_tf32=cudnn.allow_tf32),
        ):
            yield
    finally:
        torch.use_deterministic_algorithms(algorithms[0], warn_only=algorithms[1])
        torch.utils.deterministic.fill_uninitialized_memory = fill


def test_loading_a_bundle_fixes_the_kernel_choices(library_defaults: None, tiny_bundle_path: Path) -> None:
    import os

    load_bundle(str(tiny_bundle_path))
    assert inductor_config.deterministic is True
    assert inductor_config.max_autotune is False and inductor_config.coordinate_descent_tuning is False
    assert os.environ[CUBLAS_ENV] == CUBLAS_WORKSPACE
    # What made the compiled KVAE decoder agree across processes on an H200 (bench/decode_determinism.py).
    assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
    assert inductor_config.triton.autotune_pointwise is False and inductor_config.dynamic_scale_rblock is False
    assert torch.utils.deterministic.fill_uninitialized_memory is False
    # cuDNN's flags are the run's compute profile, applied before every stage.
    apply_profile(default_profile())
    assert torch.backends.cudnn.benchmark is False and torch.backends.cudnn.deterministic is True


def test_an_explicit_cublas_workspace_is_kept(library_defaults: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CUBLAS_ENV, ":16:8")
    settings = apply_kernel_settings()
    assert settings.cublas_workspace == ":16:8" and settings.inductor_deterministic is True
    assert set(settings.inductor_timing_off) >= {"max_autotune", "coordinate_descent_tuning"}


@pytest.mark.parametrize("value", ["0", "off", "False"])
def test_the_switch_leaves_the_library_defaults_to_measure_their_cost(
    library_defaults: None, monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    import os

    monkeypatch.setenv(SWITCH_ENV, value)
    settings = apply_kernel_settings()
    assert not settings.deterministic and settings.inductor_deterministic is False and settings.cublas_workspace is None
    assert CUBLAS_ENV not in os.environ and inductor_config.max_autotune is True  # untouched, as the process had it
    assert not torch.are_deterministic_algorithms_enabled() and inductor_config.triton.autotune_pointwise is True
    profile = default_profile()
    assert profile.cudnn_benchmark is True and profile.cudnn_deterministic is False
