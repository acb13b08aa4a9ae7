"""The networks' modules, imported in one thread before any other imports them."""

from __future__ import annotations

from k6vsr_core.model.bundle import DIFFUSERS_LOCK, PIFLOW, diffusers_class


def import_networks() -> None:
    """Imports every k6vsr_core module that imports diffusers at its top, under the lock of diffusers' classes
    (`k6vsr_core.model.bundle`). Two threads that import diffusers' modules at the same time can meet Python's
    import-deadlock avoidance, which hands one of them a partly initialized module (an ImportError naming a class
    diffusers has): a model worker's preload and its first tasks, or two clips' first tasks on one worker, import
    them in this one order instead."""
    with DIFFUSERS_LOCK:
        import k6vsr_core.model.fast_decoder
        import k6vsr_core.model.stages  # noqa: F401 - its imports are what is taken under the lock

        diffusers_class(PIFLOW)  # and diffusers' own classes
