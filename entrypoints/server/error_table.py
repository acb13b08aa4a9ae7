"""One table from an error to the HTTP API's answer: its status and code, and for a limit the server is at, its
message. No web framework here: the job's child process (`entrypoints.server.child`) types a failed job's error
from the same table the routes answer with (`entrypoints.server.api_errors`).
"""

from __future__ import annotations

from entrypoints.server.job_records import InputQuotaFull, KeyQueueFull, QueueFull, UploadsBusy
from k6vsr_core.errors import BundleError, MediaError, ParameterError, StoreError, UnsupportedColour, UserFacingError

# The errors a user can fix (k6vsr_core.errors) as HTTP answers: the first class that matches gives status and code.
USER_ERROR_STATUS: tuple[tuple[type[UserFacingError], int, str], ...] = (
    (UnsupportedColour, 400, "unsupported_colour"),
    (MediaError, 400, "invalid_video"),
    (ParameterError, 400, "invalid_value"),
    (BundleError, 503, "model_unavailable"),
    (StoreError, 500, "store_unusable"),
    (UserFacingError, 400, "invalid_request"),
)


def user_answer(err: UserFacingError) -> tuple[int, str]:
    """The status and code of an error a user can fix: the first class of `USER_ERROR_STATUS` it is."""
    return next((status, code) for kind, status, code in USER_ERROR_STATUS if isinstance(err, kind))


# A limit the server is at, answered 429 with Retry-After: the message (`{limit}`, and `{why}` for a key's share,
# filled in) and the code of each.
BUSY_ANSWERS: dict[type[Exception], tuple[str, str]] = {
    QueueFull: (
        "the queue is full ({limit} places, --max-queued, each taken within its key's share); retry later",
        "queue_full",
    ),
    KeyQueueFull: (
        "this key (or client address) already holds {limit} places of the queue, jobs queued or being sent: {why}; "
        "retry once one of its jobs runs",
        "key_queue_full",
    ),
    UploadsBusy: (
        "this key (or client address) is already sending {limit} request(s): {why}; retry once one is done",
        "too_many_uploads",
    ),
    InputQuotaFull: (
        "the inputs of queued and running jobs fill the input storage quota ({limit} bytes, --input-quota-mb); "
        "retry later",
        "input_quota_full",
    ),
}
