"""The installed `harvest` command, run as a user runs it, against the real server."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from conftest import MODEL, SEED


def harvest(server, *args: str, key: str = None):
    command = shutil.which("harvest")
    assert command, "the harvest command is installed with the package"
    env = {**os.environ, "ACS_API_BASE": server.base, "ACS_API_KEY": key or server.key}
    return subprocess.run([command, *args], capture_output=True, text=True, env=env, timeout=300)


def test_models_lists_the_catalogue_as_text_and_as_json(server):
    text = harvest(server, "models")
    assert text.returncode == 0 and MODEL in text.stdout and "576" in text.stdout
    as_json = json.loads(harvest(server, "--json", "models").stdout)
    assert as_json[0]["name"] == MODEL and as_json[0]["layers"] == 30


def test_submit_waits_and_downloads_a_jsonl_file_then_status_and_download_agree(server, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps(SEED[0]) + "\n" + json.dumps({"prompt": SEED[1]}) + "\n")
    out = tmp_path / "out"
    done = harvest(server, "--json", "submit", str(prompts), "--model", MODEL, "--layers", "2,7", "--download", str(out))
    assert done.returncode == 0, done.stderr
    job = json.loads(done.stdout)
    assert job["status"] == "done" and job["layers"] == [2, 7] and job["n_prompts"] == 2
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["layer_indices"] == [2, 7]
    status = harvest(server, "status", job["job_id"])
    assert status.returncode == 0 and "done" in status.stdout and job["job_id"] in status.stdout
    again = json.loads(harvest(server, "--json", "download", job["job_id"], str(out)).stdout)
    assert again["kept"] and not again["resumed"] and not again["refetched"]
    cancel = harvest(server, "cancel", job["job_id"])
    assert cancel.returncode == 1 and "harvest_not_cancellable" in cancel.stderr


def test_a_dry_run_prints_the_estimate_and_submits_nothing(server, client, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("one prompt\nanother prompt\n")
    before = len(list(client.jobs()))
    text = harvest(server, "submit", str(prompts), "--model", MODEL, "--layers", "3", "--dry-run")
    assert text.returncode == 0 and "2 prompts" in text.stdout and "bytes" in text.stdout, text.stdout
    as_json = json.loads(harvest(server, "--json", "submit", str(prompts), "--model", MODEL, "--dry-run").stdout)
    assert as_json["dry_run"] is True and as_json["total_bytes"] > 0
    assert len(list(client.jobs())) == before


def test_submit_passes_sites_selection_and_layout_and_names_a_bad_slice(server, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("one prompt with a few words\nanother prompt, a little longer than that\n")
    flags = ["--sites", "attn_out,resid_post", "--positions", "1:6", "--sample-rate", "0.9", "--seed", "4",
             "--layout", "shuffled", "--rows-per-file", "5", "--dry-run"]
    answer = harvest(server, "--json", "submit", str(prompts), "--model", MODEL, "--layers", "3", *flags)
    assert answer.returncode == 0, answer.stderr
    estimate = json.loads(answer.stdout)
    assert estimate["sites"] == ["attn_out", "resid_post"]
    assert 0 < estimate["kept_tokens"] <= 10
    assert estimate["files"]["shards"]["count"] == -(-estimate["kept_tokens"] // 5)
    bad = harvest(server, "submit", str(prompts), "--model", MODEL, "--positions", "1-6", "--dry-run")
    assert bad.returncode != 0 and "START:END" in bad.stderr


def test_submit_takes_text_and_json_files_and_directions_from_npy(server, tmp_path):
    text = tmp_path / "prompts.txt"
    text.write_text("first prompt\n\nsecond prompt\n")
    job = json.loads(harvest(server, "--json", "submit", str(text), "--model", MODEL, "--layers", "1", "--wait").stdout)
    assert job["status"] == "done" and job["n_prompts"] == 2
    as_json = tmp_path / "prompts.json"
    as_json.write_text(json.dumps({"prompts": SEED}))
    directions = tmp_path / "dirs.npy"
    np.save(directions, np.random.default_rng(0).standard_normal((2, 576)).astype(np.float32))
    job = json.loads(harvest(server, "--json", "submit", str(as_json), "--model", MODEL, "--layers", "1",
                             "--project-onto", str(directions), "--wait").stdout)
    assert job["status"] == "done" and job["result"]["contents"] == "projections"


@pytest.mark.parametrize(
    "name, content, needle",
    [
        ("bad.jsonl", b'"one"\n{"prompt": "two"\n"three"\n', "line 2: not JSON"),
        ("blob.bin", b"ok line\n\xff\xfe\x00binary", "line 2: not UTF-8"),
        ("nul.txt", b"fine\nalso fine\nbad\x00line\n", "line 3: a NUL byte"),
        ("list.json", b'["a",\n 7]\n', "item 1: a int"),
        ("broken.json", b'["a",\n "b"\n', "line 3: not JSON"),
        ("fields.jsonl", b'{"prompt": "a"}\n{"body": "b"}\n', "line 2: an object without"),
    ],
)
def test_submit_on_a_file_that_does_not_parse_names_the_line_and_submits_nothing(server, client, tmp_path, name, content, needle):
    path = tmp_path / name
    path.write_bytes(content)
    before = len(list(client.jobs()))
    result = harvest(server, "submit", str(path), "--model", MODEL)
    assert result.returncode == 1 and needle in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    assert len(list(client.jobs())) == before


def test_a_wrong_key_is_one_clear_line(server):
    result = harvest(server, "models", key="sk-hv-" + "1" * 48)
    assert result.returncode == 1 and "invalid_api_key" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr


def test_progress_reads_as_the_weights_being_read_then_as_prompts_done():
    from harvest_client.cli import describe_progress

    loading = {"phase": "loading", "bytes_loaded": 3_100_000_000, "bytes_total": 16_100_000_000,
               "prompts_done": 0, "prompts_total": 8, "tokens_done": 0}
    assert describe_progress(loading) == "loading the model's weights, 3.1/16.1 GB"
    running = {"phase": "running", "prompts_done": 3, "prompts_total": 8, "tokens_done": 90}
    assert describe_progress(running) == "3/8 prompts, 90 tokens"
    assert describe_progress({"prompts_done": 1, "prompts_total": 2, "tokens_done": 5}) == "1/2 prompts, 5 tokens"


def test_submit_takes_a_jsonl_file_of_conversations_with_the_generation_prompt(server, tmp_path):
    chats = tmp_path / "chats.jsonl"
    lines = [
        {"messages": [{"role": "user", "content": "What is a probe?"}]},
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "And an SAE?"}]},
    ]
    chats.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    dry = json.loads(harvest(server, "--json", "submit", str(chats), "--model", MODEL, "--add-generation-prompt", "--dry-run").stdout)
    assert dry["n_prompts"] == 2 and dry["tokens"] > 0
    users = json.loads(harvest(server, "--json", "submit", str(chats), "--model", MODEL, "--roles", "user,system", "--dry-run").stdout)
    assert 0 < users["kept_tokens"] < dry["tokens"], users
    done = harvest(server, "--json", "submit", str(chats), "--model", MODEL, "--layers", "3", "--add-generation-prompt", "--wait")
    assert done.returncode == 0, done.stderr
    job = json.loads(done.stdout)
    assert job["status"] == "done" and job["tokens"] == dry["tokens"]
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text(json.dumps({"text": "a"}) + "\n" + json.dumps(lines[0]) + "\n")
    refused = harvest(server, "submit", str(mixed), "--model", MODEL)
    assert refused.returncode != 0 and "mixes prompts and conversations" in refused.stderr
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("one\n")
    refused = harvest(server, "submit", str(prompts), "--model", MODEL, "--add-generation-prompt")
    assert refused.returncode != 0 and "--add-generation-prompt applies to a file of conversations" in refused.stderr
