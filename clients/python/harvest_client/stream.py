"""Training batches while a job runs: the shards a running job lists as ready
(``GET /v1/harvest/{id}?partial=true``) are fetched, checked against their sha256, read and
deleted one at a time, and their rows mixed in a bounded shuffle buffer; once the job is done,
the shards not yet read follow from its manifest. Every kept token is yielded exactly once, and
memory stays bounded by the buffer plus one prompt's rows."""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Union

import numpy as np

from . import errors
from .jobs import JobLike
from .download import _Expired, _fetch, _matches, _Wanted, Download
from .reader import SafetensorsFile, bf16_to_f32, kept_by_role, role_ids


#: Rows the shuffle buffer holds by default (256 MB of float32 rows at width 1024).
DEFAULT_SHUFFLE_BUFFER = 65536
#: Seconds between asks while no new shard is ready.
DEFAULT_POLL_S = 1.0
#: Times one shard's link is renewed, or its bytes fetched again, before giving up.
SHARD_ATTEMPTS = 3


@dataclass
class StreamReport:
    """What a stream did, as it goes (``Job.stream(..., report=StreamReport())``)."""

    #: Rows yielded.
    rows: int = 0
    #: Batches yielded.
    batches: int = 0
    #: Shards read, in all.
    shards: int = 0
    #: Shards read while the job was still running.
    early_shards: int = 0
    #: Bytes fetched over the network.
    fetched_bytes: int = 0
    #: When the stream started (``time.monotonic()``).
    started: float = field(default_factory=time.monotonic)

    def rows_per_second(self) -> float:
        """Rows yielded per second since the start."""
        return self.rows / max(time.monotonic() - self.started, 1e-9)


class ShuffleBuffer:
    """A fixed-size pool of rows: once full, each row pushed in takes the place of one drawn
    uniformly from the pool, and the displaced row leaves. Every row leaves exactly once
    (the rest at :meth:`drain`); memory is the pool, whatever the stream's length."""

    def __init__(self, capacity: int, width: int, rng: np.random.Generator) -> None:
        self.rows = np.empty((capacity, width), dtype=np.float32)
        self.held = 0
        self.rng = rng

    def push(self, values: np.ndarray) -> Iterator[np.ndarray]:
        """Adds ``values`` (``[n, width]``), yielding the rows they displace."""
        capacity = self.rows.shape[0]
        take = min(capacity - self.held, values.shape[0])
        self.rows[self.held : self.held + take] = values[:take]
        self.held += take
        values = values[take:]
        while values.shape[0]:
            k = min(values.shape[0], capacity)
            slots = self.rng.choice(capacity, size=k, replace=False)
            leaving = self.rows[slots]
            self.rows[slots] = values[:k]
            values = values[k:]
            yield leaving

    def drain(self) -> np.ndarray:
        """Every row still held, in a random order; the buffer is then empty."""
        rows = self.rows[: self.held][self.rng.permutation(self.held)]
        self.held = 0
        return rows


class _Batcher:
    """Cuts a stream of row blocks into batches of ``batch_size``."""

    def __init__(self, batch_size: int, width: int) -> None:
        self.batch_size = batch_size
        self.width = width
        self.pending: List[np.ndarray] = []
        self.held = 0

    def add(self, rows: np.ndarray) -> Iterator[np.ndarray]:
        if rows.shape[0]:
            self.pending.append(rows)
            self.held += rows.shape[0]
        while self.held >= self.batch_size:
            joined = np.concatenate(self.pending) if len(self.pending) > 1 else self.pending[0]
            yield np.ascontiguousarray(joined[: self.batch_size])
            rest = joined[self.batch_size :]
            self.pending, self.held = ([rest] if rest.shape[0] else []), rest.shape[0]

    def rest(self) -> Optional[np.ndarray]:
        if not self.held:
            return None
        rows = np.concatenate(self.pending)
        self.pending, self.held = [], 0
        return rows


@dataclass(frozen=True)
class _Shard:
    file: str
    url: str
    first: int
    last: int
    bytes: int
    sha256: str


class _Stream:
    """One pass over a job's rows of hook site ``site`` at block ``layer``."""

    def __init__(self, job: JobLike, layer: int, site: str, drop_bos: bool, directory: Path, keep_files: bool, report: StreamReport, roles: Optional[Sequence[str]] = None) -> None:
        self.job = job
        #: The ids of the roles kept, or None for every token.
        self.roles: Optional[np.ndarray] = None if roles is None else role_ids(roles)
        self.site = site
        self.drop_bos = drop_bos
        self.directory = directory
        self.keep_files = keep_files
        self.report = report
        self.bos: Optional[int] = None
        self.read: set = set()
        data = job.data
        layers = list(data.get("layers") or [])
        if layer not in layers:
            raise ValueError(f"layer {layer} was not harvested: job {job.id} kept blocks {layers}")
        self.position = layers.index(layer)
        sites = data.get("sites") or ["resid_post"]
        if site not in sites:
            raise ValueError(f"site {site!r} was not harvested: job {job.id} kept {sites}")

    def _refresh(self) -> Dict[str, Any]:
        self.job.data = self.job.client._json("GET", f"/harvest/{self.job.id}", params={"partial": "true"})
        return self.job.data

    def ready(self) -> List[_Shard]:
        """The ready shards not read yet, in shard order."""
        info = self.job.data.get("partial") or {}
        if info.get("unavailable"):
            raise errors.HarvestError(f"job {self.job.id} cannot be streamed: {info['unavailable']}")
        if info.get("bos_token_id") is not None:
            self.bos = int(info["bos_token_id"])
        return [
            _Shard(s["file"], s["url"], s["prompts"][0], s["prompts"][1], int(s["bytes"]), s["sha256"])
            for s in self.job.data.get("ready_shard_urls") or []
            if s["file"] not in self.read
        ]

    def rest_from_manifest(self) -> List[_Shard]:
        """Once the job is done: the shards not read yet, from its manifest."""
        result = self.job.result
        if result is None:
            raise errors.FilesGone(f"the files of job {self.job.id} are no longer kept")
        if result.get("layout") == "shuffled":
            raise errors.HarvestError(
                f"job {self.job.id} has the shuffled layout: download it and read it with Reader.train_batches"
            )
        manifest = self.job.client.session.get(result["manifest_url"], timeout=120)
        if manifest.status_code != 200:
            raise errors.HarvestError(f"manifest.json of job {self.job.id} answered HTTP {manifest.status_code}")
        manifest = manifest.json()
        self.bos = (manifest.get("tokenizer") or {}).get("bos_token_id")
        urls = result["shard_urls"]
        rest = []
        for index, entry in enumerate(manifest["shards"]):
            if entry["file"] in self.read:
                continue
            prompts = entry.get("prompts") or [entry["first_prompt"], entry["first_prompt"] + len(entry["token_counts"]) - 1]
            rest.append(_Shard(entry["file"], urls[index], int(prompts[0]), int(prompts[-1]), int(entry["bytes"]), entry["sha256"]))
        return rest

    def fetch(self, shard: _Shard) -> Path:
        """The shard's file, fetched and checked (its link renewed when refused)."""
        final = self.directory / shard.file
        wanted = _Wanted(shard.file, shard.bytes, shard.sha256)
        if final.exists() and _matches(final, wanted):
            return final
        part = self.directory / (shard.file + ".part")
        url = shard.url
        download = Download(directory=self.directory)
        for _ in range(SHARD_ATTEMPTS):
            try:
                _fetch(self.job.client.session, url, part, wanted, download)
            except _Expired:
                url = self._renewed_url(shard)
                continue
            if _matches(part, wanted):
                os.replace(part, final)
                self.report.fetched_bytes += download.fetched_bytes
                return final
            part.unlink()
        raise errors.IntegrityError(
            f"{shard.file} of job {self.job.id} does not match its sha256 {shard.sha256} ({shard.bytes} bytes) after {SHARD_ATTEMPTS} fetches"
        )

    def _renewed_url(self, shard: _Shard) -> str:
        data = self._refresh()
        for entry in data.get("ready_shard_urls") or []:
            if entry["file"] == shard.file:
                return entry["url"]
        urls = (data.get("result") or {}).get("shard_urls") or []
        index = int(shard.file[len("shard_") : -len(".safetensors")])
        if index < len(urls):
            return urls[index]
        raise errors.FilesGone(f"{shard.file} of job {self.job.id} is no longer offered")

    def rows(self, shard: _Shard) -> Iterator[np.ndarray]:
        """The shard's rows, prompt by prompt, as float32 ``[n, width]``."""
        path = self.fetch(shard)
        file = SafetensorsFile(path)
        prefix = "prompt" if self.site == "resid_post" else self.site
        for i in range(shard.first, shard.last + 1):
            name = f"{prefix}_{i}"
            values = file.raw(name)[self.position]
            first = 0
            if self.drop_bos and self.bos is not None and values.shape[0]:
                starts = f"positions_{i}" not in file.header or int(file.raw(f"positions_{i}")[0]) == 0
                if starts and int(file.raw(f"tokens_{i}")[0]) == self.bos:
                    first = 1
            if self.roles is not None:
                keep = kept_by_role(file, i, self.roles)
                keep[:first] = False
                values = values[keep]
            else:
                values = values[first:]
            yield bf16_to_f32(values) if file.dtype(name) == "BF16" else np.array(values, dtype=np.float32)
        del file
        self.read.add(shard.file)
        self.report.shards += 1
        if not self.keep_files:
            path.unlink()


def stream_job(
    job: JobLike,
    layer: int,
    batch_size: int,
    *,
    shuffle_buffer: int = DEFAULT_SHUFFLE_BUFFER,
    seed: int = 0,
    drop_bos: bool = True,
    site: str = "resid_post",
    directory: Union[str, Path, None] = None,
    poll_s: float = DEFAULT_POLL_S,
    drop_last: bool = False,
    report: Optional[StreamReport] = None,
    roles: Optional[Sequence[str]] = None,
) -> Iterator[np.ndarray]:
    """See :meth:`harvest_client.Job.stream`."""
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be at least 1")
    if shuffle_buffer < 0:
        raise ValueError(f"shuffle_buffer={shuffle_buffer} must be 0 (no shuffling) or more rows")
    report = report if report is not None else StreamReport()
    job.data = job.client._json("GET", f"/harvest/{job.id}", params={"partial": "true"})
    scratch = None
    if directory is None:
        scratch = tempfile.TemporaryDirectory(prefix=f"harvest-stream-{job.id[:8]}-")
        directory = scratch.name
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    try:
        stream = _Stream(job, layer, site, drop_bos, directory, scratch is None, report, roles)
        yield from _batches(stream, batch_size, shuffle_buffer, seed, poll_s, drop_last, report)
    finally:
        if scratch is not None:
            scratch.cleanup()


def _shards(stream: _Stream, poll_s: float) -> Iterator[_Shard]:
    """The job's shards as they become ready, then the rest once it is done."""
    while True:
        data = stream.job.data
        status = data["status"]
        if status == "done":
            yield from stream.rest_from_manifest()
            return
        if status == "failed":
            raise errors.JobFailed(stream.job.id, data.get("error"))
        if status == "cancelled":
            raise errors.JobCancelled(stream.job.id)
        ready = stream.ready()
        for shard in ready:
            stream.report.early_shards += 1
            yield shard
        if not ready:
            time.sleep(poll_s)
        stream._refresh()


def _batches(stream: _Stream, batch_size: int, shuffle_buffer: int, seed: int, poll_s: float, drop_last: bool, report: StreamReport) -> Iterator[np.ndarray]:
    rng = np.random.default_rng(seed)
    buffer: Optional[ShuffleBuffer] = None
    batcher: Optional[_Batcher] = None

    def out(rows: np.ndarray) -> Iterator[np.ndarray]:
        for batch in batcher.add(rows):
            report.rows += batch.shape[0]
            report.batches += 1
            yield batch

    for shard in _shards(stream, poll_s):
        for rows in stream.rows(shard):
            if batcher is None:
                batcher = _Batcher(batch_size, rows.shape[1])
                buffer = ShuffleBuffer(shuffle_buffer, rows.shape[1], rng) if shuffle_buffer else None
            if buffer is None:
                yield from out(rows)
                continue
            for leaving in buffer.push(rows):
                yield from out(leaving)
    if batcher is None:
        return
    if buffer is not None:
        yield from out(buffer.drain())
    rest = batcher.rest()
    if rest is not None and not drop_last:
        report.rows += rest.shape[0]
        report.batches += 1
        yield rest


def torch_dataset(job: JobLike, layer: int, batch_size: int, **kwargs: Any):
    """A ``torch.utils.data.IterableDataset`` whose items are float32 ``[batch, width]``
    tensors from :meth:`Job.stream` (pass ``batch_size=None`` to the ``DataLoader``). Each
    iteration streams the job again; use it with one worker, since a second would read the
    same rows."""
    import torch
    from torch.utils.data import IterableDataset

    class HarvestStream(IterableDataset):
        def __iter__(self):
            for batch in stream_job(job, layer, batch_size, **kwargs):
                yield torch.from_numpy(batch)

    return HarvestStream()
