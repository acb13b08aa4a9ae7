"""Sources and outputs given as object-store URLs (`s3://bucket/clip.mp4`), reached like the store (fsspec).

A source URL is downloaded once, whole, into a private local file that the run reads as it would a file on disk:
its bytes, hence its run key, are those of the same file read locally. An output URL receives the finished output
as one object: an object store publishes an object only when its upload completes, so no reader ever sees part of
one at the destination.
"""

from __future__ import annotations

from pathlib import Path

from k6vsr_core.errors import MediaError, UserFacingError
from storage.location import LocalLocation, Location, RemoteLocation, StoreUnreachable, is_url, location

UNREACHABLE = "the object store does not answer; check AWS_ENDPOINT_URL and the network"

__all__ = ["fetch_source", "check_output_prefix", "is_url", "publish_to_url", "url_parent"]


def _remote(url: str, what: str) -> RemoteLocation:
    try:
        where = location(url)
    except UserFacingError as err:
        raise MediaError(url, f"the {what} cannot be reached: {err}") from None
    if not isinstance(where, RemoteLocation) or url.endswith("/") or "/" not in where.path:
        raise MediaError(url, f"the {what} must name an object (s3://bucket/name), not a bucket or prefix")
    return where


def url_parent(url: str) -> str:
    """The prefix an object lies in: where an output goes by default, beside its source."""
    return url.rstrip("/").rsplit("/", 1)[0]


def fetch_source(url: str, folder: Path) -> Path:
    """Download the object `url` into `folder` (the caller's, private), under the object's own name (the output's
    default name and the container's format come from it), and return that file."""
    where = _remote(url, "source")
    file = folder / where.name
    try:
        where.copy_to(file)
    except FileNotFoundError:
        raise MediaError(url, "no such object (check the bucket and the name)") from None
    except PermissionError as err:
        raise MediaError(url, f"access denied ({err}); check the AWS_* credentials") from None
    except IsADirectoryError:
        raise MediaError(url, "this is a prefix, not an object; name the video itself") from None
    except StoreUnreachable:
        raise MediaError(url, UNREACHABLE) from None
    return file


def check_output_prefix(prefix: str) -> None:
    """Refuse an output prefix whose bucket is missing or unreachable before any work starts, not after it."""
    where = location(prefix)
    if not isinstance(where, RemoteLocation):
        raise MediaError(prefix, "not an object-store URL")
    bucket = where.path.split("/", 1)[0]
    try:
        with where.reaching():
            found = where.fs.exists(bucket)
    except StoreUnreachable:
        raise MediaError(prefix, UNREACHABLE) from None
    except PermissionError as err:
        raise MediaError(prefix, f"access denied ({err}); check the AWS_* credentials") from None
    if not found:
        raise MediaError(prefix, f"the bucket {bucket} does not exist")


def publish_to_url(source: Location | Path, url: str) -> None:
    """Upload the finished `source` (a local file, or the store's output wherever it is) to `url` as one object."""
    destination = _remote(url, "output")
    with (source if isinstance(source, Location) else LocalLocation(source)).fetch() as file:
        try:
            destination.put(file)
        except (FileNotFoundError, PermissionError) as err:
            raise MediaError(url, f"could not write the output ({err})") from None
