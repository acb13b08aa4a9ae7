"""Shared fixtures for the k6vsr_core tests: tiny random model bundles, written and loaded once per session.

The tiny bundles have the released layout and native config spelling but tile sizes (128,128), (128,256),
(256,128), so every model stage runs in well under a second on a CPU for 1-frame clips of 64-96 px.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from k6vsr_core.bundle import ModelBundle, load_bundle, make_tiny_bundle


@pytest.fixture(scope="session")
def tiny_bundle_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The distilled (PiFlow, 640-wide head) tiny bundle, written once. Tests must not modify it: copy it."""
    return make_tiny_bundle(tmp_path_factory.mktemp("bundles") / "tiny")


@pytest.fixture(scope="session")
def tiny_bundle(tiny_bundle_path: Path) -> ModelBundle:
    """The distilled tiny bundle, loaded once on the CPU (fp32)."""
    return load_bundle(str(tiny_bundle_path))


@pytest.fixture(scope="session")
def flow_bundle_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The non-distilled tiny bundle (flow-Euler scheduler, 64-wide head), written once."""
    return make_tiny_bundle(tmp_path_factory.mktemp("bundles") / "tiny-flow", distilled=False)


@pytest.fixture(scope="session")
def flow_bundle(flow_bundle_path: Path) -> ModelBundle:
    return load_bundle(str(flow_bundle_path))
