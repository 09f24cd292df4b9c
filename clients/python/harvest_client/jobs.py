"""What the download and stream modules need of a job, as a protocol: they take a
:class:`~harvest_client.Job` without importing the client module, which imports them."""

from __future__ import annotations

from typing import Any, Dict, Optional, Protocol


class JobLike(Protocol):
    """A job as the server last answered it, and the client that asks again."""

    #: The last answer.
    data: Dict[str, Any]
    #: The :class:`~harvest_client.Client` (its ``session`` and ``_json``).
    client: Any

    @property
    def id(self) -> str: ...

    @property
    def status(self) -> str: ...

    @property
    def result(self) -> Optional[Dict[str, Any]]: ...

    def refresh(self) -> Any: ...
