"""What the client does with answers a real server gives only under load (429s, declined
long-polls): a scripted session stands in for the network."""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import pytest
import requests

from harvest_client import Client, ConcurrencyExceeded, InvalidRequest, JobFailed
import harvest_client.client as client_module


class Scripted(requests.Session):
    """Answers each request with the next scripted (status, body, headers)."""

    def __init__(self, answers: List[tuple]) -> None:
        super().__init__()
        self.answers = list(answers)
        self.calls: List[Dict[str, Any]] = []

    def request(self, method, url, **kwargs):  # type: ignore[override]
        self.calls.append({"method": method, "url": url, **kwargs})
        status, body, headers = self.answers.pop(0)
        response = requests.Response()
        response.status_code = status
        response._content = __import__("json").dumps(body).encode()
        response.headers.update({"Content-Type": "application/json", **headers})
        return response


def envelope(code: str, message: str = "m") -> Dict[str, Any]:
    return {"error": {"code": code, "message": message, "job_id": None}}


def job(status: str, done: int = 0) -> Dict[str, Any]:
    return {
        "job_id": "01900000-0000-7000-8000-000000000000",
        "status": status,
        "model": "m",
        "n_prompts": 4,
        "progress": {"prompts_done": done, "prompts_total": 4, "tokens_done": 10} if status == "running" else None,
        "error": "the worker ran out of memory" if status == "failed" else None,
    }


@pytest.fixture
def no_sleep(monkeypatch):
    """Sleeps recorded, not slept: a fake clock that a sleep moves on."""
    slept: List[float] = []
    clock = [1000.0]

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        clock[0] += seconds

    monkeypatch.setattr(client_module.time, "sleep", sleep)
    monkeypatch.setattr(client_module.time, "monotonic", lambda: clock[0])
    return slept


def test_submit_with_retry_waits_out_a_full_lane_and_a_busy_count_then_succeeds(no_sleep):
    session = Scripted([
        (429, envelope("harvest_concurrency_exceeded"), {"Retry-After": "30"}),
        (429, envelope("harvest_count_busy"), {"Retry-After": "2"}),
        (202, job("pending"), {}),
    ])
    submitted = Client("http://h/v1", "k", session=session).submit(["a"], "m", retry=True)
    assert submitted.status == "pending" and no_sleep == [30.0, 2.0] and len(session.calls) == 3


def test_submit_without_retry_raises_the_429_with_its_retry_after(no_sleep):
    session = Scripted([(429, envelope("harvest_concurrency_exceeded", "the small lane is full"), {"Retry-After": "30"})])
    with pytest.raises(ConcurrencyExceeded) as caught:
        Client("http://h/v1", "k", session=session).submit(["a"], "m")
    assert caught.value.retry_after == 30.0 and "small lane" in str(caught.value) and no_sleep == []


def test_a_400_and_a_used_up_budget_are_never_retried(no_sleep):
    for code in ("invalid_request", "budget_exceeded"):
        session = Scripted([(400 if code == "invalid_request" else 429, envelope(code), {})])
        with pytest.raises(Exception) as caught:
            Client("http://h/v1", "k", session=session).submit(["a"], "m", retry=True)
        assert caught.value.code == code and len(session.calls) == 1 and no_sleep == []
    assert issubclass(InvalidRequest, Exception)


def test_retry_gives_up_when_the_next_wait_would_pass_its_deadline(no_sleep):
    session = Scripted([(429, envelope("harvest_concurrency_exceeded"), {"Retry-After": "30"})] * 3)
    with pytest.raises(ConcurrencyExceeded):
        Client("http://h/v1", "k", session=session).submit(["a"], "m", retry=True, retry_for=45)
    assert no_sleep == [30.0] and len(session.calls) == 2


def test_wait_long_polls_and_honours_a_declined_long_poll_before_asking_again(no_sleep):
    session = Scripted([
        (200, job("running", 1), {"X-Acs-Longpoll": "declined", "Retry-After": "3"}),
        (200, job("running", 3), {}),
        (200, job("done"), {}),
    ])
    client = Client("http://h/v1", "k", session=session)
    waited = client_module.Job(client, job("pending")).wait(progress=False)
    assert waited.status == "done"
    assert no_sleep == [3.0], "one pause, after the declined poll only"
    assert all(call["params"] == {"wait": 60} for call in session.calls)


def test_wait_raises_job_failed_with_the_servers_reason(no_sleep):
    session = Scripted([(200, job("failed"), {})])
    client = Client("http://h/v1", "k", session=session)
    with pytest.raises(JobFailed, match="ran out of memory"):
        client_module.Job(client, job("running")).wait(progress=False)


def test_an_unreachable_server_is_named_in_one_clear_error():
    from harvest_client import ConnectionFailed

    with pytest.raises(ConnectionFailed, match="127.0.0.1:9/v1/models"):
        Client("http://127.0.0.1:9/v1", "k", timeout=5).models()


def test_a_client_without_a_server_or_key_says_which_variable_to_set(monkeypatch):
    from harvest_client import HarvestError

    monkeypatch.delenv("ACS_API_BASE", raising=False)
    monkeypatch.delenv("ACS_API_KEY", raising=False)
    with pytest.raises(HarvestError, match="ACS_API_BASE"):
        Client()
    with pytest.raises(HarvestError, match="ACS_API_KEY"):
        Client("http://h/v1")
