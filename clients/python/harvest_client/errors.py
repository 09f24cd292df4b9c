"""Typed exceptions: one class per error code of the API's envelope, each carrying the server's
message, the HTTP status and, where the server sent one, ``Retry-After`` in seconds."""

from __future__ import annotations

from typing import Dict, Optional, Type


class HarvestError(Exception):
    """Anything this client raises on purpose."""


class ConnectionFailed(HarvestError):
    """The server could not be reached at all (wrong base URL, server down, network)."""


class ApiError(HarvestError):
    """An error answer of the API. ``code`` is the envelope's stable code."""

    code: str = "unknown"

    def __init__(
        self,
        message: str,
        *,
        status: int,
        code: Optional[str] = None,
        retry_after: Optional[float] = None,
        job_id: Optional[str] = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        if code is not None:
            self.code = code
        self.retry_after = retry_after
        self.job_id = job_id

    def __str__(self) -> str:
        tail = f"; retry after {self.retry_after:g} s" if self.retry_after is not None else ""
        return f"{self.message} ({self.code}, HTTP {self.status}{tail})"


class InvalidRequest(ApiError):
    """400 ``invalid_request``: the message names the field and the fix."""

    code = "invalid_request"


class HarvestTooLarge(ApiError):
    """400 ``harvest_too_large``: split the corpus into several jobs."""

    code = "harvest_too_large"


class InvalidApiKey(ApiError):
    """401 ``invalid_api_key``: the key is unknown, revoked, or was not sent."""

    code = "invalid_api_key"


class LinkExpired(ApiError):
    """403 ``link_expired``: ask for the job again for fresh links."""

    code = "link_expired"


class LinkInvalid(ApiError):
    """403 ``link_invalid``: the link was altered."""

    code = "link_invalid"


class NotFound(ApiError):
    """404 ``not_found``: no such job for this key (or no such route)."""

    code = "not_found"


class MethodNotAllowed(ApiError):
    """405 ``method_not_allowed``."""

    code = "method_not_allowed"


class NotCancellable(ApiError):
    """409 ``harvest_not_cancellable``: the job already ended."""

    code = "harvest_not_cancellable"


class PayloadTooLarge(ApiError):
    """413 ``payload_too_large``: the body is over 50 MiB."""

    code = "payload_too_large"


class CountBusy(ApiError):
    """429 ``harvest_count_busy``: another submit is being counted; retry after ``retry_after``."""

    code = "harvest_count_busy"


class ConcurrencyExceeded(ApiError):
    """429 ``harvest_concurrency_exceeded``: the lane is full; retry or cancel a job."""

    code = "harvest_concurrency_exceeded"


class BudgetExceeded(ApiError):
    """429 ``budget_exceeded``: a token budget is used up."""

    code = "budget_exceeded"


class QuotaExceeded(ApiError):
    """429 ``harvest_quota_exceeded``: the key's monthly job quota is used up."""

    code = "harvest_quota_exceeded"


class InsufficientStorage(ApiError):
    """507 ``insufficient_storage``: the job's files would not fit."""

    code = "insufficient_storage"


class Unavailable(ApiError):
    """503 ``harvest_unavailable``: ``job_id`` names the job that was recorded."""

    code = "harvest_unavailable"


class InternalError(ApiError):
    """500 ``internal_error``."""

    code = "internal_error"


class JobFailed(HarvestError):
    """The job ended ``failed``; ``job`` is its last answer."""

    def __init__(self, job_id: str, error: Optional[str]) -> None:
        super().__init__(f"job {job_id} failed: {error or 'no reason given'}")
        self.job_id = job_id
        self.error = error


class JobCancelled(HarvestError):
    """The job ended ``cancelled``."""

    def __init__(self, job_id: str) -> None:
        super().__init__(f"job {job_id} was cancelled")
        self.job_id = job_id


class IntegrityError(HarvestError):
    """A downloaded file does not match the manifest's size or sha256, even after a fresh fetch."""


class FilesGone(HarvestError):
    """The job's files are no longer kept (``urls_expired``)."""


BY_CODE: Dict[str, Type[ApiError]] = {
    cls.code: cls
    for cls in (
        InvalidRequest,
        HarvestTooLarge,
        InvalidApiKey,
        LinkExpired,
        LinkInvalid,
        NotFound,
        MethodNotAllowed,
        NotCancellable,
        PayloadTooLarge,
        CountBusy,
        ConcurrencyExceeded,
        BudgetExceeded,
        QuotaExceeded,
        InsufficientStorage,
        Unavailable,
        InternalError,
    )
}


def from_response(status: int, body: object, retry_after: Optional[str]) -> ApiError:
    """The exception for an error answer: by the envelope's code, else by the HTTP status."""
    seconds: Optional[float] = None
    if retry_after is not None:
        try:
            seconds = float(retry_after)
        except ValueError:
            seconds = None
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict) and isinstance(error.get("code"), str):
        code = error["code"]
        message = str(error.get("message") or code)
        cls = BY_CODE.get(code, ApiError)
        return cls(message, status=status, code=code, retry_after=seconds, job_id=error.get("job_id"))
    fallback = {401: InvalidApiKey, 404: NotFound, 413: PayloadTooLarge, 500: InternalError}
    cls = fallback.get(status, ApiError)
    return cls(f"HTTP {status} without an error envelope", status=status, retry_after=seconds)
