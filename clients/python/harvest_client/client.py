"""The REST client: :class:`Client` for the server, :class:`Job` for one harvest job."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Union

import requests

from . import errors
from .encoding import encode_directions

#: ``?wait=`` asked of each long-poll (the server's maximum).
LONG_POLL_S = 60
#: Seconds to wait after a declined long-poll when the server sent no ``Retry-After``.
DECLINED_RETRY_S = 3.0
#: How long ``submit(retry=True)`` keeps retrying a 429 it may retry, by default.
SUBMIT_RETRY_FOR_S = 600.0
#: 429 codes worth retrying: they clear by themselves. Budgets and quotas do not.
RETRYABLE_SUBMIT_CODES = ("harvest_count_busy", "harvest_concurrency_exceeded")
#: Answers that end a job.
TERMINAL = ("done", "failed", "cancelled")

Layers = Union[None, str, Sequence[int]]


class Client:
    """A harvest server.

    ``base_url`` is the API's base, ending in ``/v1`` (default: ``$ACS_API_BASE``), and
    ``api_key`` the bearer key (default: ``$ACS_API_KEY``)::

        client = Client()
        job = client.submit(["The quick brown fox."], model="llama-8b", layers=[8, 16])
        job.wait().download("out")
    """

    def __init__(
        self,
        base_url: Optional[str] = None,
        api_key: Optional[str] = None,
        *,
        timeout: float = 120.0,
        session: Optional[requests.Session] = None,
    ) -> None:
        base_url = base_url or os.environ.get("ACS_API_BASE")
        api_key = api_key or os.environ.get("ACS_API_KEY")
        if not base_url:
            raise errors.HarvestError(
                "no server given: pass base_url, or set ACS_API_BASE (for example "
                "http://127.0.0.1:8080/v1)"
            )
        if not api_key:
            raise errors.HarvestError(
                "no API key given: pass api_key, or set ACS_API_KEY (harvest-api create-key "
                "prints one)"
            )
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.timeout = timeout
        self.session = session or requests.Session()
        self._models: Optional[List[Dict[str, Any]]] = None

    def __repr__(self) -> str:
        return f"Client(base_url={self.base_url!r})"

    # -- transport -------------------------------------------------------------------------

    def _call(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        params: Optional[Dict[str, Any]] = None,
        timeout: Optional[float] = None,
    ) -> requests.Response:
        url = f"{self.base_url}{path}"
        try:
            response = self.session.request(
                method,
                url,
                json=json,
                params=params,
                headers={"Authorization": f"Bearer {self.api_key}"},
                timeout=timeout or self.timeout,
            )
        except requests.ConnectionError as error:
            raise errors.ConnectionFailed(
                f"could not reach {url}: is the server running, and is ACS_API_BASE right? ({error})"
            ) from None
        except requests.Timeout:
            raise errors.ConnectionFailed(f"{method} {url} got no answer in {timeout or self.timeout:g} s") from None
        if response.status_code >= 400:
            try:
                body = response.json()
            except ValueError:
                body = None
            raise errors.from_response(response.status_code, body, response.headers.get("Retry-After"))
        return response

    def _json(self, method: str, path: str, **kwargs: Any) -> Any:
        response = self._call(method, path, **kwargs)
        try:
            return response.json()
        except ValueError:
            raise errors.HarvestError(
                f"{method} {self.base_url}{path} answered {response.status_code} with a body that is not JSON"
            ) from None

    # -- the API ---------------------------------------------------------------------------

    def models(self) -> List[Dict[str, Any]]:
        """The catalogue: each model's ``name``, ``layers``, ``hidden_size``, ``default_layers``,
        ``lane``, ``max_tokens`` and ``devices``; a model listed with ``available: false``
        (its files are missing on the server) has an ``unavailable_reason`` instead of a shape."""
        self._models = list(self._json("GET", "/models")["models"])
        return self._models

    def _model(self, name: str) -> Optional[Dict[str, Any]]:
        models = self._models if self._models is not None else self.models()
        return next((m for m in models if m["name"] == name), None)

    def account(self) -> Dict[str, Any]:
        """The key's account: lanes, token budgets, the key's monthly jobs and storage, each
        as ``{"used": n, "limit": m or None}``."""
        return self._json("GET", "/account")

    def job(self, job_id: str) -> "Job":
        """A job by id (``NotFound`` for an unknown id or another account's job)."""
        return Job(self, self._json("GET", f"/harvest/{job_id}"))

    def jobs(self, status: Optional[str] = None, *, page_size: int = 100) -> Iterator["Job"]:
        """Every job of the key's account, newest first, fetched a page at a time. Each is
        answered without its result; ``job.refresh()`` fetches it with its links."""
        params: Dict[str, Any] = {"limit": page_size}
        if status is not None:
            params["status"] = status
        while True:
            page = self._json("GET", "/harvest", params=params)
            for data in page["data"]:
                yield Job(self, data)
            if not page.get("next_after"):
                return
            params["after"] = page["next_after"]

    def estimate(
        self,
        prompts: Optional[Sequence[str]] = None,
        model: Optional[str] = None,
        layers: Layers = None,
        shard_size: Optional[int] = None,
        add_special_tokens: bool = True,
        project_onto: Any = None,
        *,
        sites: Optional[Sequence[str]] = None,
        conversations: Optional[Sequence[Sequence[Dict[str, str]]]] = None,
        add_generation_prompt: Optional[bool] = None,
        **selection: Any,
    ) -> Dict[str, Any]:
        """A dry run: what the job would be (``tokens``, ``kept_tokens``, ``files`` bytes per
        kind, ``total_bytes``, ``estimated_seconds``), with no job made and no quota used.
        Takes ``conversations=`` instead of prompts, as :meth:`submit` does."""
        body = self._body(prompts, model, layers, shard_size, add_special_tokens, project_onto, None, sites)
        body.update(_conversations(conversations, add_generation_prompt, "prompts" in body))
        body.update(_selection(selection))
        body["dry_run"] = True
        return self._json("POST", "/harvest", json=body)

    def submit(
        self,
        prompts: Optional[Sequence[str]] = None,
        model: Optional[str] = None,
        layers: Layers = None,
        shard_size: Optional[int] = None,
        add_special_tokens: bool = True,
        project_onto: Any = None,
        *,
        sites: Optional[Sequence[str]] = None,
        batch_size: Optional[int] = None,
        conversations: Optional[Sequence[Sequence[Dict[str, str]]]] = None,
        add_generation_prompt: Optional[bool] = None,
        retry: bool = False,
        retry_for: float = SUBMIT_RETRY_FOR_S,
        **selection: Any,
    ) -> "Job":
        """Queues a job and returns it (``pending``).

        ``layers`` is a list of block indices, ``"all"``, or None for the model's default.
        ``sites`` lists hook sites of each kept block (``resid_pre``, ``attn_out``,
        ``resid_mid``, ``mlp_out``, ``resid_post``); None keeps ``resid_post`` alone.
        Token selection takes ``exclude_special_tokens=True``, ``positions=(start, end)``,
        ``sample_rate=`` with ``seed=``, ``max_norm_multiple=``, and for conversations
        ``roles=["assistant"]`` (any of ``template``, ``system``, ``user``, ``assistant``,
        ``tool``: only those tokens are kept); ``layout="shuffled"``
        (with ``rows_per_file=`` and ``seed=``) writes training files instead of shards;
        ``precision="f32"`` or ``"bf16"`` picks the arithmetic (None: the device's own, f32 on
        a CPU and bf16 on a GPU; the manifest says which ran); ``parallelism=N`` runs the job as
        N harvester processes on the embedded server (the files are those of one);
        ``max_prompt_tokens=N`` cuts each prompt to its first N tokens before the forward pass.
        ``project_onto`` is a numpy array or torch tensor ``[n_directions, hidden]``; it is
        checked and encoded here. Instead of prompts, ``conversations=`` takes a list of
        conversations, each a list of ``{"role": "system" | "user" | "assistant" | "tool",
        "content": "..."}`` messages, which the server renders with the model's own chat template
        (as transformers' ``apply_chat_template`` does, one BOS); ``add_generation_prompt=True``
        ends each with the opening of the assistant's next turn. With ``retry=True``, a 429 that clears by itself
        (``harvest_count_busy``, ``harvest_concurrency_exceeded``) is retried after its
        ``Retry-After`` for up to ``retry_for`` seconds; nothing else is retried."""
        body = self._body(prompts, model, layers, shard_size, add_special_tokens, project_onto, batch_size, sites)
        body.update(_conversations(conversations, add_generation_prompt, "prompts" in body))
        body.update(_selection(selection))
        deadline = time.monotonic() + retry_for
        while True:
            try:
                return Job(self, self._json("POST", "/harvest", json=body))
            except errors.ApiError as error:
                wait = error.retry_after if error.retry_after is not None else 5.0
                if not retry or error.code not in RETRYABLE_SUBMIT_CODES or time.monotonic() + wait > deadline:
                    raise
                time.sleep(wait)

    def _body(
        self,
        prompts: Optional[Sequence[str]],
        model: Optional[str],
        layers: Layers,
        shard_size: Optional[int],
        add_special_tokens: bool,
        project_onto: Any,
        batch_size: Optional[int],
        sites: Optional[Sequence[str]] = None,
    ) -> Dict[str, Any]:
        """The request body, checked and encoded here (before anything is sent)."""
        if not isinstance(model, str) or not model:
            raise TypeError("model is missing: name a model of the server's catalogue, e.g. model=\"llama-8b\"")
        body: Dict[str, Any] = {"model": model}
        if prompts is not None:
            if isinstance(prompts, (str, bytes)):
                raise TypeError("prompts must be a list of strings, not one string: wrap it as [prompt]")
            prompts = list(prompts)
            for i, prompt in enumerate(prompts):
                if not isinstance(prompt, str):
                    raise TypeError(f"prompts[{i}] is a {type(prompt).__name__}: every prompt must be a string")
            body["prompts"] = prompts
        if layers is not None:
            body["layers"] = layers if isinstance(layers, str) else [int(layer) for layer in layers]
        if sites is not None:
            if isinstance(sites, str):
                raise TypeError(f"sites must be a list of site names, not one string: wrap it as [{sites!r}]")
            body["sites"] = [str(site) for site in sites]
        if shard_size is not None:
            body["shard_size"] = int(shard_size)
        if batch_size is not None:
            body["batch_size"] = int(batch_size)
        if not add_special_tokens:
            body["add_special_tokens"] = False
        if project_onto is not None:
            entry = self._model(model)
            body["project_onto"] = encode_directions(project_onto, entry.get("hidden_size") if entry else None)
        return body


ROLES = ("system", "user", "assistant", "tool")
#: The roles a token can have (``roles_i`` holds their index): the template's own markup, or
#: a message's role.
TOKEN_ROLES = ("template",) + ROLES


def _conversations(
    conversations: Optional[Sequence[Sequence[Dict[str, str]]]],
    add_generation_prompt: Optional[bool],
    has_prompts: bool,
) -> Dict[str, Any]:
    """The request's ``conversations`` (checked here: each a list of role/content messages)
    and ``add_generation_prompt``; prompts or conversations, exactly one."""
    if conversations is None:
        if not has_prompts:
            raise TypeError("give prompts (a list of strings) or conversations= (a list of message lists)")
        if add_generation_prompt is not None:
            raise TypeError("add_generation_prompt applies to conversations=, not to prompts")
        return {}
    if has_prompts:
        raise TypeError("give prompts or conversations=, not both: one job holds one kind")
    if isinstance(conversations, (str, bytes, dict)):
        raise TypeError("conversations must be a list of conversations, each a list of {\"role\", \"content\"} messages")
    checked = []
    for i, conversation in enumerate(conversations):
        if isinstance(conversation, (str, bytes, dict)):
            raise TypeError(f"conversations[{i}] is a {type(conversation).__name__}: each conversation is a list of messages")
        messages = []
        for j, message in enumerate(conversation):
            if not isinstance(message, dict) or set(message) != {"role", "content"}:
                raise TypeError(f"conversations[{i}][{j}] must be a dict with exactly \"role\" and \"content\"")
            if message["role"] not in ROLES:
                raise ValueError(f"conversations[{i}][{j}]: role {message['role']!r} is not one of {', '.join(ROLES)}")
            if not isinstance(message["content"], str):
                raise TypeError(f"conversations[{i}][{j}]: content is a {type(message['content']).__name__}, not a string")
            messages.append({"role": message["role"], "content": message["content"]})
        if not messages:
            raise ValueError(f"conversations[{i}] has no messages: give each at least one")
        checked.append(messages)
    body: Dict[str, Any] = {"conversations": checked}
    if add_generation_prompt is not None:
        body["add_generation_prompt"] = bool(add_generation_prompt)
    return body


class Job:
    """One harvest job, as the server last answered it (``data``)."""

    def __init__(self, client: Client, data: Dict[str, Any]) -> None:
        self.client = client
        self.data = data

    def __repr__(self) -> str:
        return f"Job(id={self.id!r}, status={self.status!r}, model={self.data.get('model')!r})"

    @property
    def id(self) -> str:
        """The job's id."""
        return self.data["job_id"]

    @property
    def status(self) -> str:
        """pending, running, done, failed or cancelled."""
        return self.data["status"]

    @property
    def done(self) -> bool:
        """Whether the job has ended (in any way)."""
        return self.status in TERMINAL

    @property
    def result(self) -> Optional[Dict[str, Any]]:
        """The result of a done job (links included), else None."""
        return self.data.get("result")

    @property
    def error(self) -> Optional[str]:
        """Why a failed job failed."""
        return self.data.get("error")

    def refresh(self) -> "Job":
        """Asks the server for the job again (with fresh links when it is done)."""
        self.data = self.client._json("GET", f"/harvest/{self.id}")
        return self

    def cancel(self) -> "Job":
        """Cancels the job if it is pending or running (``NotCancellable`` once it ended)."""
        self.data = self.client._json("DELETE", f"/harvest/{self.id}")
        return self

    def wait(
        self,
        progress: bool = True,
        timeout: Optional[float] = None,
        raise_on_failure: bool = True,
    ) -> "Job":
        """Long-polls until the job ends, with a progress bar of its prompts when ``progress``.
        A declined long-poll (``X-Acs-Longpoll: declined``) waits its ``Retry-After`` before
        asking again. Raises ``JobFailed`` or ``JobCancelled`` when it ends that way (unless
        ``raise_on_failure`` is false) and ``TimeoutError`` after ``timeout`` seconds."""
        from tqdm.auto import tqdm

        deadline = None if timeout is None else time.monotonic() + timeout
        total = int(self.data.get("n_prompts") or 0)
        with tqdm(total=total, unit="prompt", desc=f"job {self.id[:8]}", disable=not progress, leave=True) as bar:
            self._show(bar)
            while not self.done:
                wait = LONG_POLL_S
                if deadline is not None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise TimeoutError(f"job {self.id} is still {self.status} after {timeout:g} s")
                    wait = max(1, min(wait, int(left)))
                response = self.client._call(
                    "GET", f"/harvest/{self.id}", params={"wait": wait}, timeout=wait + 30
                )
                self.data = response.json()
                self._show(bar)
                if response.headers.get("X-Acs-Longpoll") == "declined" and not self.done:
                    retry = response.headers.get("Retry-After")
                    time.sleep(float(retry) if retry else DECLINED_RETRY_S)
        if raise_on_failure and self.status == "failed":
            raise errors.JobFailed(self.id, self.error)
        if raise_on_failure and self.status == "cancelled":
            raise errors.JobCancelled(self.id)
        return self

    def _show(self, bar: Any) -> None:
        progress = self.data.get("progress") or {}
        done = bar.total if self.status == "done" else int(progress.get("prompts_done", bar.n))
        if done != bar.n:
            bar.update(done - bar.n)
        loading = progress.get("phase") == "loading" and self.status == "running"
        bar.set_postfix_str("loading weights" if loading else self.status, refresh=True)

    def download(self, directory: Union[str, Path], workers: int = 4, progress: bool = False):
        """Downloads the job's files into ``directory`` in parallel and returns a
        :class:`~harvest_client.download.Download` report. Partial files resume with Range
        requests; every file is checked against the manifest's size and sha256 (a bad one is
        fetched again once); expired links are renewed. ``manifest.json`` is written last, so
        a directory with a manifest is complete."""
        from .download import download_job

        return download_job(self, Path(directory), workers=workers, progress=progress)

    def stream(
        self,
        layer: int,
        batch_size: int,
        *,
        shuffle_buffer: int = 65536,
        seed: int = 0,
        drop_bos: bool = True,
        site: str = "resid_post",
        directory: Union[str, Path, None] = None,
        poll_s: float = 1.0,
        drop_last: bool = False,
        report: Any = None,
        roles: Optional[Sequence[str]] = None,
    ) -> Iterator[Any]:
        """Float32 ``[batch, width]`` rows of hook site ``site`` at block ``layer``, yielded
        while the job runs: each shard the server lists as ready is fetched, checked against
        its sha256, read and deleted (kept when ``directory`` is given), then the rest once
        the job is done. Every kept token comes once (``drop_bos`` leaves out each prompt's
        leading BOS, as the statistics and :meth:`Reader.token_batches` do); rows are mixed
        in a buffer of ``shuffle_buffer`` rows drawn from ``seed`` (0: shard order), which
        bounds the memory. The order depends on when shards become ready; the rows do not.
        Raises ``JobFailed`` or ``JobCancelled`` if the job ends that way. Pass a
        :class:`~harvest_client.stream.StreamReport` as ``report`` to follow rows/s. For a
        job of conversations, ``roles=["assistant"]`` yields only those roles' tokens."""
        from .stream import stream_job

        return stream_job(
            self,
            layer,
            batch_size,
            shuffle_buffer=shuffle_buffer,
            seed=seed,
            drop_bos=drop_bos,
            site=site,
            directory=directory,
            poll_s=poll_s,
            drop_last=drop_last,
            report=report,
            roles=roles,
        )

    def torch_stream(self, layer: int, batch_size: int, **kwargs: Any):
        """:meth:`stream` as a ``torch.utils.data.IterableDataset`` of float32 tensors (needs
        torch: ``pip install harvest-client[torch]``)."""
        from .stream import torch_dataset

        return torch_dataset(self, layer, batch_size, **kwargs)

    def open(self, directory: Union[str, Path]):
        """A :class:`~harvest_client.reader.Reader` over the files downloaded to ``directory``."""
        from .reader import Reader

        return Reader(directory)


SELECTION_FIELDS = (
    "exclude_special_tokens",
    "positions",
    "roles",
    "sample_rate",
    "seed",
    "max_norm_multiple",
    "layout",
    "rows_per_file",
    "precision",
    "parallelism",
    "max_prompt_tokens",
)


def _selection(given: Dict[str, Any]) -> Dict[str, Any]:
    """The token selection and layout fields of a request; an unknown keyword is a TypeError
    naming it."""
    unknown = sorted(set(given) - set(SELECTION_FIELDS))
    if unknown:
        raise TypeError(f"unknown argument {unknown[0]!r}: the extensions are {', '.join(SELECTION_FIELDS)}")
    body = {name: value for name, value in given.items() if value is not None}
    if "positions" in body:
        body["positions"] = [int(v) for v in body["positions"]]
    if "roles" in body:
        if isinstance(body["roles"], str):
            raise TypeError(f"roles must be a list of role names, not one string: wrap it as [{body['roles']!r}]")
        body["roles"] = [str(role) for role in body["roles"]]
        unknown = [role for role in body["roles"] if role not in TOKEN_ROLES]
        if unknown:
            raise ValueError(f"roles: {unknown[0]!r} is not a role: give any of {', '.join(TOKEN_ROLES)}, for example [\"assistant\"]")
    return body
