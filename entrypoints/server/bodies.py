"""Request bodies read within bounds: JSON fields, a streamed multipart upload, a confined `video_path` copied."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import Request
from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header

from entrypoints.server.api_errors import ApiError
from entrypoints.server.config import Limits
from entrypoints.server.confine import PathRefused, open_confined, quote
from entrypoints.server.fields import FILE_FIELD, FILE_FIELDS, LATENT_FIELD
from entrypoints.server.job_records import InputFile, JobStore

if TYPE_CHECKING:
    from python_multipart.multipart import MultipartCallbacks  # a TypedDict of its type checking only

MAX_PART_HEADER_BYTES = 16 << 10


def _too_many_fields(limits: Limits) -> ApiError:
    return ApiError(
        413,
        f"the request has more than {limits.max_fields} fields besides the clip (--max-fields)",
        code="too_many_fields",
    )


def _fields_too_large(limits: Limits) -> ApiError:
    return ApiError(
        413,
        f"the request takes more than {limits.max_fields_bytes} bytes besides the clip (--max-fields-kb)",
        code="fields_too_large",
    )


def _declared_length(request: Request) -> int | None:
    length = request.headers.get("content-length", "")
    return int(length) if length.isdigit() else None


class UploadTimeout(ApiError):
    def __init__(self, limit_s: float) -> None:
        super().__init__(
            408,
            f"the request body did not arrive within {limit_s:g} s (--upload-timeout-s)",
            code="request_timeout",
            headers={"Connection": "close"},  # the rest of the body is never read
        )


class UploadTooSlow(ApiError):
    def __init__(self, limits: Limits) -> None:
        super().__init__(
            408,
            f"the request body arrived slower than {limits.min_upload_bytes_per_s / 1024:g} KiB/s over "
            f"{limits.upload_rate_window_s:g} s (--min-upload-kb-s, --upload-rate-window-s); its upload slot is "
            "given back, send it again",
            code="upload_too_slow",
            headers={"Connection": "close"},
        )


async def _next_chunk(chunks: AsyncIterator[bytes]) -> bytes | None:
    try:
        return await anext(chunks)
    except StopAsyncIteration:
        return None


async def body_chunks(request: Request, limits: Limits) -> AsyncIterator[bytes]:
    """The request body as it arrives: all of it within `upload_timeout_s`, and, while it lasts, at least
    `min_upload_bytes_per_s` in each `upload_rate_window_s` (0: no floor). A client that stalls or trickles gives
    back its admission slot and its quota at the end of the window where it fell short, not at the deadline.
    (Neither uvicorn nor Starlette bounds a body's time or rate.)"""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limits.upload_timeout_s
    window_s = limits.upload_rate_window_s
    floor = limits.min_upload_bytes_per_s * window_s  # bytes each window must bring
    window_end = loop.time() + window_s
    in_window = 0
    chunks = request.stream()
    # One read in flight, waited for across windows (a cancelled read would end the body's stream), and started
    # only when the next chunk is asked for.
    pending: asyncio.Future[bytes | None] | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(_next_chunk(chunks))
            wake = min(deadline, window_end) if floor else deadline
            await asyncio.wait({pending}, timeout=max(0.0, wake - loop.time()))
            if pending.done():
                chunk = pending.result()
                if chunk is None:
                    return
                pending = None
                in_window += len(chunk)
                yield chunk
            now = loop.time()
            if now >= deadline:
                raise UploadTimeout(limits.upload_timeout_s)
            if floor and now >= window_end:
                if in_window < floor:
                    raise UploadTooSlow(limits)
                in_window, window_end = 0, now + window_s
    finally:
        if pending is not None and not pending.done():
            pending.cancel()


async def read_json(request: Request, limits: Limits) -> dict[str, Any]:
    length = _declared_length(request)
    if length is not None and length > limits.max_fields_bytes:
        raise _fields_too_large(limits)
    body = bytearray()
    async for chunk in body_chunks(request, limits):
        body += chunk
        if len(body) > limits.max_fields_bytes:
            raise _fields_too_large(limits)
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):  # RecursionError: arrays nested deeper than the parser goes
        raise ApiError(400, "request body is not valid JSON", code="invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError(400, "request body must be a JSON object", code="invalid_json")
    extra = data.pop("extra_body", None)  # as SGLang's server: OpenAI clients may nest fields here
    if isinstance(extra, dict):
        data.update(extra)
    if len(data) > limits.max_fields + 1:  # + video_path
        raise _too_many_fields(limits)
    return data


class FormError(ApiError):
    def __init__(self, message: str) -> None:
        super().__init__(400, f"malformed multipart body: {message}", code="malformed_form")


class UploadTooLarge(ApiError):
    def __init__(self, limit: int, field: str = FILE_FIELD) -> None:
        super().__init__(
            413,
            f"{field} is larger than the upload limit of {limit} bytes (--max-upload-mb)",
            param=field,
            code="file_too_large",
        )


@dataclass(frozen=True)
class FormBody:
    fields: dict[str, str]  # every field but the file, as text
    file_field: str  # the file's field: `video_reference` (a clip) or `latent_reference` (a latent)


class _FormReceiver:
    """python-multipart's streaming callbacks: the file (`video_reference`, or `latent_reference`) goes straight to
    the job's input (stopping as soon as it passes the cap or the quota), other fields are kept as strings,
    `max_fields` of them at most. The client's file name is never used."""

    def __init__(self, open_input: Callable[[str], InputFile], limits: Limits) -> None:
        self.open_input = open_input
        self.limits = limits
        self.fields: dict[str, str] = {}
        self.file_bytes = 0
        self.ended = False
        self._header: list[bytes] = [b"", b""]
        self._disposition = b""
        self._name = ""
        self._value = bytearray()
        self._input: InputFile | None = None
        self.file_field: str | None = None  # the file field received, once it is complete

    def callbacks(self) -> MultipartCallbacks:
        return {
            "on_part_begin": self._begin,
            "on_header_field": lambda data, start, end: self._add_header(0, data[start:end]),
            "on_header_value": lambda data, start, end: self._add_header(1, data[start:end]),
            "on_header_end": self._header_end,
            "on_headers_finished": self._headers_finished,
            "on_part_data": lambda data, start, end: self._data(bytes(data[start:end])),
            "on_part_end": self._part_end,
            "on_end": self._end,
        }

    def _begin(self) -> None:
        self._header, self._disposition, self._value = [b"", b""], b"", bytearray()

    def _add_header(self, which: int, data: bytes) -> None:
        self._header[which] += data

    def _header_end(self) -> None:
        if self._header[0].strip().lower() == b"content-disposition":
            self._disposition = self._header[1].strip()
        self._header = [b"", b""]

    def _headers_finished(self) -> None:
        _, options = parse_options_header(self._disposition)
        name = options.get(b"name", b"").decode("latin-1")
        if not name:
            raise FormError("a part has no name")
        self._name = name
        if b"filename" in options or name in FILE_FIELDS:
            if name not in FILE_FIELDS:
                raise ApiError(
                    400,
                    f"unexpected file field {quote(name)}; send the clip as {FILE_FIELD!r} (or a latent as "
                    f"{LATENT_FIELD!r})",
                    param=name[:64],
                    code="unexpected_file_field",
                )
            if self.file_field == name:
                raise ApiError(400, f"{name} was sent twice", param=name, code="duplicate_field")
            if self.file_field is not None:
                raise ApiError(
                    400, f"send {FILE_FIELD} or {LATENT_FIELD}, not both", param=name, code="conflicting_inputs"
                )
            self._input = self.open_input(name)
        elif len(self.fields) >= self.limits.max_fields:
            raise _too_many_fields(self.limits)

    def _data(self, data: bytes) -> None:
        if self._input is not None:
            self._input.write(data)
            self.file_bytes += len(data)
        else:
            self._value += data
            if len(self._value) > self.limits.max_fields_bytes:
                raise _fields_too_large(self.limits)

    def _part_end(self) -> None:
        if self._input is not None:
            self._input.close()
            self._input = None
            self.file_field = self._name
            return
        if self._name in self.fields:
            raise ApiError(
                400, f"form field {quote(self._name)} was sent twice", param=self._name[:64], code="duplicate_field"
            )
        try:
            self.fields[self._name] = self._value.decode("utf-8")
        except UnicodeDecodeError:
            raise ApiError(
                400, f"form field {quote(self._name)} is not UTF-8 text", param=self._name[:64], code="invalid_value"
            ) from None

    def _end(self) -> None:
        self.ended = True

    def close(self) -> None:
        if self._input is not None:
            self._input.close()


async def read_form(request: Request, open_input: Callable[[str], InputFile], limits: Limits) -> FormBody:
    """Stream a multipart body: the clip (or latent) into `open_input(field name)`, the other fields returned as
    strings. Everything but the file's bytes (boundaries, part headers, fields) counts toward `max_fields_bytes`."""
    length = _declared_length(request)
    if length is not None and length > limits.max_request_bytes:
        raise ApiError(
            413,
            f"the request is larger than {limits.max_request_bytes} bytes (--max-upload-mb plus --max-fields-kb)",
            code="request_too_large",
        )
    _, options = parse_options_header(request.headers["content-type"])
    boundary = options.get(b"boundary", b"")
    if not 1 <= len(boundary) <= 200:
        raise FormError("missing or invalid boundary in Content-Type")
    receiver = _FormReceiver(open_input, limits)
    parser = MultipartParser(boundary, receiver.callbacks(), max_header_size=MAX_PART_HEADER_BYTES)
    received = 0
    try:
        async for chunk in body_chunks(request, limits):
            received += len(chunk)
            parser.write(chunk)
            if received - receiver.file_bytes > limits.max_fields_bytes:
                raise _fields_too_large(limits)
            if receiver.ended:
                break  # the epilogue is not read
        parser.finalize()
    except MultipartParseError as err:
        raise FormError(f"{' '.join(str(err).split())[:200]}") from None
    finally:
        receiver.close()
    if not receiver.ended:
        raise FormError("the body ended before the closing boundary")
    if receiver.file_field is None:
        raise ApiError(
            400,
            f"the clip is missing: send it as the file field {FILE_FIELD!r} (or a latent as {LATENT_FIELD!r})",
            param=FILE_FIELD,
            code="missing_file",
        )
    return FormBody(receiver.fields, receiver.file_field)


def copy_path_source(raw: Any, roots: tuple[Path, ...], store: JobStore, job_id: str) -> str:
    """Copy the file `video_path` names, opened inside the allowed folders, into the job's input: the run reads that
    copy, never the path again. Returns the path relative to its allowed folder."""
    opened = open_confined(raw, roots)
    try:
        limit = store.quota.limit
        if opened.size > limit:
            raise ApiError(
                413,
                f"video_path {quote(opened.relative)} is larger than the input storage quota of "
                f"{limit} bytes (--input-quota-mb)",
                param="video_path",
                code="file_too_large",
            )
        too_large = lambda: ApiError(  # noqa: E731 - grown while being copied
            413,
            f"video_path {quote(opened.relative)} grew past the input storage quota while being copied",
            param="video_path",
            code="file_too_large",
        )
        target = store.open_input(job_id, cap=limit, too_large=too_large)
        try:
            while True:
                try:
                    data = os.read(opened.fd, 1 << 20)
                except OSError as err:
                    raise PathRefused(
                        "path_unreadable",
                        f"video_path {quote(opened.relative)} could not be read ({os.strerror(err.errno or 0)})",
                    ) from None
                if not data:
                    break
                target.write(data)  # a full disk raises here: the server's fault (507), not the file's
        finally:
            target.close()
    finally:
        os.close(opened.fd)
    return opened.relative
