"""Training while it harvests, against the real server: the stream started mid-job, the
SAELens and Hugging Face exports of the finished job, and their refusals."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import MODEL, corpus, wait_until
from harvest_client import HarvestError
from harvest_client.stream import ShuffleBuffer, StreamReport
from test_cli import harvest


def offline(*args: str):
    """The installed ``harvest`` command, for what needs no server (export)."""
    import os
    import shutil
    import subprocess

    env = {k: v for k, v in os.environ.items() if not k.startswith("ACS_")}
    return subprocess.run([shutil.which("harvest"), *args], capture_output=True, text=True, env=env, timeout=300)

LAYERS = [3, 17]


def sorted_rows(rows: np.ndarray) -> np.ndarray:
    """``rows`` in lexicographic order: a multiset compares as one array."""
    return rows[np.lexsort(rows.T[::-1])]


@pytest.fixture(scope="module")
def streamed(client, tmp_path_factory):
    """A job of 40 prompts in 20 shards, streamed from its first ready shard on, then
    downloaded once done."""
    prompts = [f"{p} " + "and the residual stream carries it on " * 8 for p in corpus(40)]
    job = client.submit(prompts, model=MODEL, layers=LAYERS, shard_size=2)

    def first_shard_ready():
        data = client._json("GET", f"/harvest/{job.id}", params={"partial": "true"})
        assert data["status"] in ("pending", "running"), f"the job ended before a shard was seen: {data}"
        return data.get("ready_shard_urls")

    wait_until(first_shard_ready, timeout=180, interval=0.02, message="the first ready shard")
    report = StreamReport()
    batches = list(job.stream(17, 64, shuffle_buffer=300, seed=5, poll_s=0.05, report=report))
    directory = tmp_path_factory.mktemp("streamed")
    job.wait(progress=False).download(directory)
    return job, batches, report, job.open(directory)


def test_a_stream_started_mid_job_yields_the_rows_token_batches_reads_from_the_finished_job(streamed):
    _, batches, report, reader = streamed
    print(f"\nstream: {report.early_shards} of {report.shards} shards read while the job ran, {report.rows} rows, {report.rows_per_second():,.0f} rows/s")
    assert report.early_shards >= 1, "some shards were read while the job ran"
    assert report.shards == 20 and report.rows == reader.n_tokens()
    assert all(b.shape == (64, 576) and b.dtype == np.float32 for b in batches[:-1])
    got = np.concatenate(batches)
    want = np.concatenate(list(reader.token_batches(17, 1000, shuffle=False)))
    assert np.array_equal(sorted_rows(got), sorted_rows(want)), "every token exactly once"
    assert not np.array_equal(got, want), "the buffer mixed them"


def test_a_stream_of_the_done_job_with_the_same_seed_gives_the_same_batches(streamed):
    job, batches, _, _ = streamed
    again = list(job.stream(17, 64, shuffle_buffer=300, seed=5))
    assert len(again) == len(batches) and all(np.array_equal(a, b) for a, b in zip(again, batches))


def test_a_stream_of_a_layer_or_site_the_job_did_not_keep_names_what_it_kept(streamed):
    job = streamed[0]
    with pytest.raises(ValueError, match=r"layer 4 was not harvested: .* kept blocks \[3, 17\]"):
        next(job.stream(4, 8))
    with pytest.raises(ValueError, match=r"site 'mlp_out' was not harvested: .* kept \['resid_post'\]"):
        next(job.stream(3, 8, site="mlp_out"))


def test_a_job_cancelled_while_it_streams_raises_job_cancelled(client):
    from harvest_client import JobCancelled

    prompts = [f"{p} " + "a long and winding residual stream " * 12 for p in corpus(64)]
    job = client.submit(prompts, model=MODEL, layers=[3], shard_size=1)
    batches = job.stream(3, 16, shuffle_buffer=0, poll_s=0.05)
    next(batches)
    client.job(job.id).cancel()
    with pytest.raises(JobCancelled, match=job.id):
        for _ in batches:
            pass


def test_the_shuffle_buffer_lets_every_row_out_exactly_once_within_its_memory():
    rng = np.random.default_rng(0)
    buffer = ShuffleBuffer(7, 1, rng)
    rows = np.arange(40, dtype=np.float32).reshape(-1, 1)
    out = [leaving for start in range(0, 40, 3) for leaving in buffer.push(rows[start : start + 3])]
    assert buffer.rows.shape == (7, 1) and buffer.held == 7
    out.append(buffer.drain())
    assert sorted(np.concatenate(out)[:, 0].tolist()) == list(range(40)) and buffer.held == 0


def test_harvest_stream_reports_rows_per_second(server, streamed):
    job = streamed[0]
    done = harvest(server, "--json", "stream", job.id, "--layer", "3", "--batch-size", "100")
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert summary["rows"] == streamed[3].n_tokens() and summary["rows_per_s"] > 0 and summary["shards"] == 20


def saelens_batch(path, hook, context_size, d_in, batch_size, row):
    """What SAELens 6.54.12's ActivationsStore does with ``cached_activations_path``
    (``load_cached_activation_dataset`` and ``_load_raw_llm_batch_from_cached``), with numpy
    in place of torch: load, check the column and its shape, slice ``batch_size`` rows from
    ``row``, and flatten them to ``[batch_size * context_size, d_in]`` with their token ids."""
    import datasets

    dataset = datasets.load_from_disk(str(path))
    columns = [hook]
    if "token_ids" in dataset.column_names:
        columns.append("token_ids")
    dataset.set_format(type="numpy", columns=columns)
    assert set([hook]).issubset(dataset.column_names)
    if dataset.features[hook].shape != (context_size, d_in):
        raise ValueError(f"Given dataset of shape {dataset.features[hook].shape} does not match")
    sliced = dataset[row : row + batch_size]
    acts = sliced[hook]
    assert acts.shape == (batch_size, context_size, d_in)
    ids = sliced["token_ids"]
    assert ids.shape == (batch_size, context_size)
    return acts.reshape(batch_size * context_size, d_in), ids.reshape(batch_size * context_size), len(dataset)


def our_tokens(reader, layer, site="resid_post"):
    """Every kept token at ``layer`` in prompt order, BOS dropped: (ids, rows)."""
    ids, rows = [], []
    for i in range(reader.n_prompts):
        values, positions = reader.rows(i, layer, site=site, drop_bos=True)
        ids.append(reader.tokens(i)[positions])
        rows.append(values)
    return np.concatenate(ids), np.concatenate(rows)


def test_a_saelens_export_loads_as_its_activations_store_reads_it_and_holds_our_rows(streamed, tmp_path):
    reader = streamed[3]
    out = tmp_path / "saelens"
    done = offline("--json", "export", str(reader.directory), "--format", "saelens", "--site", "resid_post",
                   "--layer", "17", "--out", str(out), "--context-size", "32")
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert summary["hook_name"] == "blocks.17.hook_resid_post" and summary["width"] == 576
    ids, rows = our_tokens(reader, 17)
    assert summary["rows"] == ids.size // 32 and summary["left_out_tokens"] == ids.size % 32
    acts, token_ids, n = saelens_batch(out, "blocks.17.hook_resid_post", 32, 576, 4, 2)
    assert n == summary["rows"]
    assert np.array_equal(acts, rows[64:192]) and np.array_equal(token_ids, ids[64:192])


def test_an_hf_export_has_one_row_per_token_with_its_prompt_position_and_id(streamed, tmp_path):
    import datasets

    from harvest_client.export import export

    reader = streamed[3]
    summary = export(reader.directory, tmp_path / "hf", format="hf", layer=3, chunk_bytes=576 * 4 * 100)
    dataset = datasets.load_from_disk(str(tmp_path / "hf"))
    assert len(dataset) == summary["rows"] == reader.n_tokens() and len(summary["files"]) > 3, "written in chunks"
    dataset.set_format("numpy")
    row = dataset[len(dataset) - 1]
    last = reader.n_prompts - 1
    values, positions = reader.rows(last, 3, drop_bos=True)
    assert row["prompt"] == last and row["position"] == positions[-1]
    assert row["token_id"] == reader.tokens(last)[positions[-1]]
    assert np.array_equal(row["activation"], values[-1])


def test_an_export_refuses_a_full_directory_and_a_layer_or_site_not_kept(streamed, tmp_path):
    reader = streamed[3]
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine")
    refused = offline("export", str(reader.directory), "--format", "saelens", "--layer", "3", "--out", str(full))
    assert refused.returncode == 1 and "is not empty" in refused.stderr and (full / "keep.txt").exists()
    for args, named in ((["--layer", "4"], "kept blocks [3, 17]"), (["--layer", "3", "--site", "attn_out"], "kept ['resid_post']")):
        refused = offline("export", str(reader.directory), "--format", "hf", "--out", str(tmp_path / "new"), *args)
        assert refused.returncode == 1 and named in refused.stderr, refused.stderr
    assert not (tmp_path / "new").exists()
