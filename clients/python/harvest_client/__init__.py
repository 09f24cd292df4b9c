"""harvest-client: submit harvest jobs, wait for them, download and verify their files, and read
the activations back, shuffled across shards, ready for SAE training or a probe.

    from harvest_client import Client

    client = Client()                       # ACS_API_BASE and ACS_API_KEY
    job = client.submit(prompts, model="llama-8b", layers=[16]).wait()
    job.download("run1")
    for batch in job.open("run1").token_batches(layer=16, batch_size=4096):
        ...
"""

from .client import Client, Job
from .download import Download
from .errors import (
    ApiError,
    BudgetExceeded,
    ConcurrencyExceeded,
    ConnectionFailed,
    CountBusy,
    FilesGone,
    HarvestError,
    HarvestTooLarge,
    InsufficientStorage,
    IntegrityError,
    InternalError,
    InvalidApiKey,
    InvalidRequest,
    JobCancelled,
    JobFailed,
    LinkExpired,
    LinkInvalid,
    MethodNotAllowed,
    NotCancellable,
    NotFound,
    PayloadTooLarge,
    QuotaExceeded,
    Unavailable,
)
from .reader import Reader

__version__ = "0.1.0"

__all__ = [
    "ApiError",
    "BudgetExceeded",
    "Client",
    "ConcurrencyExceeded",
    "ConnectionFailed",
    "CountBusy",
    "Download",
    "FilesGone",
    "HarvestError",
    "HarvestTooLarge",
    "InsufficientStorage",
    "IntegrityError",
    "InternalError",
    "InvalidApiKey",
    "InvalidRequest",
    "Job",
    "JobCancelled",
    "JobFailed",
    "LinkExpired",
    "LinkInvalid",
    "MethodNotAllowed",
    "NotCancellable",
    "NotFound",
    "PayloadTooLarge",
    "QuotaExceeded",
    "Reader",
    "Unavailable",
]
