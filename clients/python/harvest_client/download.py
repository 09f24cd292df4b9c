"""Parallel, resumable, verified downloads of a done job's files.

Each file goes to ``NAME.part`` first and is renamed once its size and sha256 match the
manifest, so an interrupted download leaves only ``.part`` files, which the next call resumes
with a Range request. ``manifest.json`` is written last."""

from __future__ import annotations

import hashlib
import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

import requests

from . import errors
from .jobs import JobLike


#: Bytes read from the network at a time.
CHUNK = 1 << 20
#: Times a file is fetched again after its bytes failed the check.
REFETCHES = 1
#: Times a refused (403) link is renewed for one file before giving up.
RENEWALS = 2


@dataclass
class Download:
    """What a download did."""

    directory: Path
    #: Bytes received over the network, in all.
    fetched_bytes: int = 0
    #: Files that were already complete and correct.
    kept: List[str] = field(default_factory=list)
    #: Files continued from a ``.part`` with a Range request.
    resumed: List[str] = field(default_factory=list)
    #: Files that failed the check and were fetched again.
    refetched: List[str] = field(default_factory=list)
    #: Times the links had expired and fresh ones were asked for.
    renewed_links: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def _add(self, n: int) -> None:
        with self._lock:
            self.fetched_bytes += n


class _Expired(Exception):
    """The link was refused (expired or otherwise no longer valid)."""


@dataclass(frozen=True)
class _Wanted:
    name: str
    size: Optional[int]
    sha256: Optional[str]


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _matches(path: Path, wanted: _Wanted) -> bool:
    if wanted.size is not None and path.stat().st_size != wanted.size:
        return False
    return wanted.sha256 is None or _sha256(path) == wanted.sha256


class _Links:
    """The job's current links, renewed (once per expiry, whichever thread sees it first)."""

    def __init__(self, job: JobLike, report: Download) -> None:
        self.job = job
        self.report = report
        self.lock = threading.Lock()
        self.generation = 0
        self.urls = self._read()

    def _read(self) -> Dict[str, str]:
        result = self.job.result
        if result is None:
            raise errors.FilesGone(f"job {self.job.id} has no files to download (status {self.job.status})")
        urls = {"manifest.json": result["manifest_url"], "stats.safetensors": result["stats_url"]}
        prefix = "train" if result.get("layout") == "shuffled" else "shard"
        for i, url in enumerate(result["shard_urls"]):
            urls[f"{prefix}_{i:05d}.safetensors"] = url
        return urls

    def get(self, name: str) -> tuple[str, int]:
        with self.lock:
            return self.urls[name], self.generation

    def renew(self, seen: int) -> None:
        with self.lock:
            if seen != self.generation:
                return
            self.job.refresh()
            if self.job.data.get("urls_expired"):
                raise errors.FilesGone(f"the files of job {self.job.id} are no longer kept")
            self.urls = self._read()
            self.generation += 1
            self.report.renewed_links += 1


def _get(session: requests.Session, url: str, headers: Dict[str, str]) -> requests.Response:
    try:
        response = session.get(url, headers=headers, stream=True, timeout=120)
    except requests.RequestException as error:
        raise errors.ConnectionFailed(f"download of {url.split('?')[0]} failed: {error}") from None
    if response.status_code == 403:
        response.close()
        raise _Expired()
    return response


def _fetch(session: requests.Session, url: str, part: Path, wanted: _Wanted, report: Download) -> bool:
    """Fetches into ``part``, continuing it if it holds a prefix; whether it resumed."""
    offset = part.stat().st_size if part.exists() else 0
    if wanted.size is not None and offset > wanted.size:
        part.unlink()
        offset = 0
    if wanted.size is not None and offset == wanted.size:
        return False
    headers = {"Range": f"bytes={offset}-"} if offset else {}
    response = _get(session, url, headers)
    with response:
        if response.status_code == 416:
            # The server has no bytes past ours: what we hold is all there is.
            return False
        if response.status_code not in (200, 206):
            raise errors.HarvestError(
                f"download of {wanted.name} answered HTTP {response.status_code}: {response.text[:200]}"
            )
        resumed = offset > 0 and response.status_code == 206
        with open(part, "ab" if resumed else "wb") as out:
            for chunk in response.iter_content(CHUNK):
                out.write(chunk)
                report._add(len(chunk))
    return resumed


def _one(session: requests.Session, links: _Links, directory: Path, wanted: _Wanted, report: Download) -> None:
    final = directory / wanted.name
    if final.exists():
        if _matches(final, wanted):
            with report._lock:
                report.kept.append(wanted.name)
            return
        final.unlink()
        with report._lock:
            report.refetched.append(wanted.name)
    part = directory / (wanted.name + ".part")
    attempts = renewals = 0
    while True:
        url, generation = links.get(wanted.name)
        try:
            resumed = _fetch(session, url, part, wanted, report)
        except _Expired:
            renewals += 1
            if renewals > RENEWALS:
                raise errors.HarvestError(
                    f"the link of {wanted.name} was refused (HTTP 403) even after it was renewed"
                ) from None
            links.renew(generation)
            continue
        if resumed:
            with report._lock:
                report.resumed.append(wanted.name)
        if _matches(part, wanted):
            os.replace(part, final)
            return
        got = part.stat().st_size
        part.unlink()
        attempts += 1
        if attempts > REFETCHES:
            raise errors.IntegrityError(
                f"{wanted.name} does not match the manifest (got {got} bytes, expected "
                f"{wanted.size} bytes with sha256 {wanted.sha256}) after {attempts} fetches"
            )
        with report._lock:
            report.refetched.append(wanted.name)


def _manifest(session: requests.Session, links: _Links, report: Download) -> bytes:
    for _ in range(RENEWALS + 1):
        url, generation = links.get("manifest.json")
        try:
            response = _get(session, url, {})
        except _Expired:
            links.renew(generation)
            continue
        with response:
            if response.status_code != 200:
                raise errors.HarvestError(f"manifest.json answered HTTP {response.status_code}")
            body = response.content
            report._add(len(body))
            return body
    raise errors.HarvestError("the manifest's link was refused (HTTP 403) even after it was renewed")


def download_job(job: JobLike, directory: Path, *, workers: int = 4, progress: bool = False) -> Download:
    """See :meth:`harvest_client.Job.download`."""
    if job.status != "done" or job.result is None:
        job.refresh()
    if job.status != "done":
        raise errors.HarvestError(f"job {job.id} is {job.status}, not done: wait for it first")
    if job.data.get("urls_expired"):
        raise errors.FilesGone(f"the files of job {job.id} are no longer kept")
    directory.mkdir(parents=True, exist_ok=True)
    report = Download(directory=directory)
    session = job.client.session
    links = _Links(job, report)
    manifest_bytes = _manifest(session, links, report)
    manifest: Dict[str, Any] = json.loads(manifest_bytes)
    files = manifest["train"]["files"] if manifest.get("layout") == "shuffled" else manifest["shards"]
    wanted = [_Wanted(s["file"], int(s["bytes"]), s["sha256"]) for s in files]
    stats = manifest.get("stats_file")
    wanted.append(
        _Wanted("stats.safetensors", int(stats["bytes"]), stats["sha256"]) if stats else _Wanted("stats.safetensors", None, None)
    )
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(wanted), unit="file", desc=f"job {job.id[:8]}")
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        futures = [pool.submit(_one, session, links, directory, w, report) for w in wanted]
        for future in futures:
            future.result()
            if bar is not None:
                bar.update(1)
    if bar is not None:
        bar.close()
    target = directory / "manifest.json"
    staging = directory / "manifest.json.part"
    staging.write_bytes(manifest_bytes)
    os.replace(staging, target)
    return report
