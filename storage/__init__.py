"""storage: the run store. The only place that knows where bytes live (Zarr arrays, records, published files)."""

from storage.location import StoreUnreachable, parse_store_root
from storage.manifest import STAGE_FORMAT_VERSION, RunManifest, SourceInfo, run_key, source_info
from storage.run_store import RunRef, RunStore, StoreError, collect_garbage, default_store_root, publish

__all__ = [
    "STAGE_FORMAT_VERSION",
    "RunManifest",
    "RunRef",
    "RunStore",
    "SourceInfo",
    "StoreError",
    "StoreUnreachable",
    "collect_garbage",
    "default_store_root",
    "parse_store_root",
    "publish",
    "run_key",
    "source_info",
]
