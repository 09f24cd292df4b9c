"""The real embedded server for the client's tests: the `harvest-api` and `harvester` binaries
that cargo built, the real SmolLM2 checkpoint that scripts/fetch-model.sh imported, on
loopback. `scripts/test.sh` sets HARVEST_BIN_DIR and runs these after `cargo test`."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterator, List, Optional

import pytest
import requests

MODEL = "smollm2-135m"
#: A tiny random mixture-of-experts checkpoint (AFMoE, 8 experts, 2 a token, blocks 2 to 4 sparse).
MOE_MODEL = "tiny-afmoe"
MOE_DIR = Path(__file__).resolve().parents[3] / "harvester/tests/fixtures/tiny-afmoe-bf16"
SEED = [
    "The quick brown fox jumps over the lazy dog.",
    "Interpretability research reads the residual stream.",
]


def _bin_dir() -> Path:
    if os.environ.get("HARVEST_BIN_DIR"):
        return Path(os.environ["HARVEST_BIN_DIR"])
    target = os.environ.get("CARGO_TARGET_DIR") or str(Path(__file__).resolve().parents[3] / "target")
    return Path(target) / "debug"


def _model_dir() -> Path:
    cache = Path(os.environ.get("HARVEST_CACHE") or Path.home() / ".cache/harvest")
    model = cache / "models/smollm2-135m"
    if not (model / "model.safetensors").exists():
        pytest.exit(f"{model} is missing: run scripts/fetch-model.sh", returncode=2)
    return model


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(what, timeout: float = 60.0, interval: float = 0.05, message: str = "condition"):
    """Polls ``what()`` until it returns something truthy, or fails after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = what()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {message}")
        time.sleep(interval)


@dataclass
class Server:
    process: subprocess.Popen
    root: str
    base: str
    config: Path
    key: str
    other_key: str
    log: Path

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def start_server(directory: Path, extra: Optional[Dict] = None) -> Server:
    directory.mkdir(parents=True, exist_ok=True)
    bins = _bin_dir()
    api, harvester = bins / "harvest-api", bins / "harvester"
    for binary in (api, harvester):
        if not binary.exists():
            pytest.exit(f"{binary} is missing: build it (scripts/test.sh runs cargo test first)", returncode=2)
    port = _free_port()
    root = f"http://127.0.0.1:{port}"
    config = {
        "data_dir": str(directory / "data"),
        "harvester": str(harvester),
        "max_workers": 1,
        "worker_threads": 1,
        "public_url": root,
        "models": [
            {"name": MODEL, "path": str(_model_dir()), "lane": "small"},
            {"name": MOE_MODEL, "path": str(MOE_DIR), "lane": "small"},
        ],
        "accounts": [{"name": "lab"}, {"name": "other"}],
    }
    config.update(extra or {})
    path = directory / "config.json"
    path.write_text(json.dumps(config))

    def key(account: str) -> str:
        out = subprocess.run(
            [str(api), "--config", str(path), "create-key", "--account", account],
            check=True, capture_output=True, text=True,
        )
        return out.stdout.strip()

    keys = key("lab"), key("other")
    log = directory / "server.log"
    process = subprocess.Popen(
        [str(api), "--config", str(path), "serve", "--listen", f"127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=open(log, "wb"), env={**os.environ, "RUST_LOG": "warn"},
    )

    def up() -> bool:
        if process.poll() is not None:
            raise AssertionError(f"the server exited at start: {log.read_text()}")
        try:
            return requests.get(f"{root}/readyz", timeout=2).status_code == 200
        except requests.ConnectionError:
            return False

    wait_until(up, timeout=60, message="the server to be ready")
    return Server(process, root, f"{root}/v1", path, keys[0], keys[1], log)


@pytest.fixture(scope="session")
def server(tmp_path_factory) -> Iterator[Server]:
    running = start_server(tmp_path_factory.mktemp("server"))
    yield running
    running.stop()


@pytest.fixture(scope="session")
def client(server):
    from harvest_client import Client

    return Client(server.base, server.key)


def corpus(n: int, words: int = 6) -> List[str]:
    """``n`` distinct prompts of a few words each."""
    vocabulary = "residual stream sparse autoencoder feature probe layer token attention head".split()
    return [
        f"Prompt {i}: " + " ".join(vocabulary[(i * 7 + j) % len(vocabulary)] for j in range(words))
        for i in range(n)
    ]
