"""The compute profile: one thread count (and kernel policy) per run, whatever process computes a stage."""

from __future__ import annotations

import os
import sys

import procs
import pytest
import torch

from k6vsr_core.device.compute import THREADS_ENV, ComputeProfile, apply_profile, default_profile
from k6vsr_core.errors import ParameterError


def test_default_profile_counts_the_cores_this_process_may_use(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(THREADS_ENV, raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # what Dask's nanny exports: it must not decide the profile
    assert default_profile().cpu_threads == len(os.sched_getaffinity(0))


def test_threads_env_overrides_and_bad_values_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(THREADS_ENV, "3")
    assert default_profile() == ComputeProfile(cpu_threads=3)
    monkeypatch.setenv(THREADS_ENV, "many")
    with pytest.raises(ParameterError, match="K6VSR_CPU_THREADS='many'"):
        default_profile()


def test_apply_profile_sets_the_thread_count_of_a_one_thread_worker() -> None:
    """A process started as Dask's nanny starts workers computes with the run's thread count once applied."""
    code = (
        "import torch; from k6vsr_core.device.compute import ComputeProfile, apply_profile;"
        "before = torch.get_num_threads(); apply_profile(ComputeProfile(cpu_threads=2));"
        "print(before, torch.get_num_threads(), torch.backends.cudnn.benchmark)"
    )
    done = procs.run([sys.executable, "-c", code], env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["1", "2", "False"]


def test_apply_profile_is_idempotent() -> None:
    threads = torch.get_num_threads()
    apply_profile(ComputeProfile(cpu_threads=threads))
    apply_profile(ComputeProfile(cpu_threads=threads))
    assert torch.get_num_threads() == threads
