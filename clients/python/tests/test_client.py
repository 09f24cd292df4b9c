"""The client against the real embedded server with SmolLM2: submit, wait, download, verify,
resume, re-fetch, renew links, read back, and shuffled token batches."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import requests

from harvest_client import Client, HarvestError, IntegrityError, InvalidApiKey, InvalidRequest, NotFound
from harvest_client.reader import SafetensorsFile

from conftest import MODEL, MOE_MODEL, SEED, corpus, start_server, wait_until


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def harvested(client, tmp_path_factory):
    """A done job of ten prompts over four shards, downloaded once. SmolLM2's tokenizer adds no
    BOS, so every third prompt starts with the BOS token's text: its first id is BOS, which the
    statistics and the token batches leave out."""
    prompts = [("<|im_start|>" if i % 3 == 0 else "") + p for i, p in enumerate(corpus(10))]
    job = client.submit(prompts, MODEL, layers=[3, 10], shard_size=3).wait(progress=False)
    directory = tmp_path_factory.mktemp("harvested")
    report = job.download(directory)
    return job, directory, report


def test_a_job_submitted_waited_and_downloaded_matches_its_manifest_file_by_file(harvested):
    job, directory, report = harvested
    assert job.status == "done" and job.result["n_shards"] == 4
    manifest = json.loads((directory / "manifest.json").read_text())
    for shard in manifest["shards"]:
        path = directory / shard["file"]
        assert path.stat().st_size == shard["bytes"]
        assert sha256(path) == shard["sha256"]
    stats = manifest["stats_file"]
    assert sha256(directory / "stats.safetensors") == stats["sha256"]
    assert not list(directory.glob("*.part"))
    total = sum(p.stat().st_size for p in directory.iterdir())
    assert report.fetched_bytes == total
    assert report.kept == [] and report.resumed == [] and report.refetched == []


def test_a_second_download_keeps_every_verified_file_and_fetches_only_the_manifest(harvested):
    job, directory, _ = harvested
    again = job.download(directory)
    assert sorted(again.kept) == sorted(p.name for p in directory.glob("*.safetensors"))
    assert again.fetched_bytes == (directory / "manifest.json").stat().st_size


def test_a_corrupted_file_is_detected_and_fetched_again(harvested):
    job, directory, _ = harvested
    shard = directory / "shard_00001.safetensors"
    good = sha256(shard)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    report = job.download(directory)
    assert report.refetched == ["shard_00001.safetensors"]
    assert sha256(shard) == good


def test_an_interrupted_download_resumes_with_a_range_request(harvested):
    job, directory, _ = harvested
    shard = directory / "shard_00002.safetensors"
    whole = shard.read_bytes()
    shard.unlink()
    # What an interrupted download leaves: the first part of the file, under .part.
    (directory / "shard_00002.safetensors.part").write_bytes(whole[: len(whole) // 3])
    report = job.download(directory)
    assert report.resumed == ["shard_00002.safetensors"]
    manifest_size = (directory / "manifest.json").stat().st_size
    assert report.fetched_bytes == manifest_size + len(whole) - len(whole) // 3
    assert shard.read_bytes() == whole


def test_a_part_file_that_is_not_a_prefix_is_refetched_whole_after_the_check_fails(harvested):
    job, directory, _ = harvested
    shard = directory / "shard_00003.safetensors"
    whole = shard.read_bytes()
    shard.unlink()
    (directory / "shard_00003.safetensors.part").write_bytes(b"\0" * (len(whole) // 2))
    report = job.download(directory)
    assert report.resumed == ["shard_00003.safetensors"]
    assert report.refetched == ["shard_00003.safetensors"]
    assert shard.read_bytes() == whole


def test_prompts_read_back_with_their_tokens_layers_and_shapes(harvested):
    job, directory, _ = harvested
    reader = job.open(directory)
    manifest = reader.manifest
    assert len(reader) == 10 and reader.layer_indices == [3, 10] and reader.width == 576
    counts = [n for shard in manifest["shards"] for n in shard["token_counts"]]
    bos = manifest["tokenizer"]["bos_token_id"]
    for i in (0, 4, 9):
        tokens, activations = reader.prompt(i)
        assert tokens.dtype == np.int32 and tokens.shape == (counts[i],)
        assert (tokens[0] == bos) == (i % 3 == 0), tokens[:3]
        assert activations.dtype == np.float32 and activations.shape == (2, counts[i], 576)
        assert np.isfinite(activations).all()
    with pytest.raises(IndexError, match="prompt 10"):
        reader.prompt(10)


def test_token_batches_cover_every_non_bos_token_once_per_epoch_and_their_mean_is_the_stats_mean(harvested):
    job, directory, _ = harvested
    reader = job.open(directory)
    stats = reader.stats()
    for layer, position in ((3, 0), (10, 1)):
        batches = list(reader.token_batches(layer, batch_size=7, shuffle=True, seed=1))
        assert all(b.shape == (7, 576) for b in batches[:-1]) and 1 <= len(batches[-1]) <= 7
        rows = np.concatenate(batches)
        assert rows.shape[0] == stats["count"]
        bos = reader.manifest["tokenizer"]["bos_token_id"]
        kept = []
        for i in range(len(reader)):
            tokens, activations = reader.prompt(i)
            kept.append(activations[position, 1:] if tokens[0] == bos else activations[position])
        expected = np.concatenate(kept)
        assert expected.shape[0] == reader.manifest["total_tokens"] - 4, "four prompts lead with BOS"
        # The same rows, each exactly once: equal after sorting both the same way.
        assert np.array_equal(rows[np.lexsort(rows.T)], expected[np.lexsort(expected.T)])
        # Not in prompt order: shuffled across shards.
        assert not np.array_equal(rows, expected)
        # Statistics are accumulated before bf16 rounding, the rows after it.
        mean = rows.astype(np.float64).mean(axis=0)
        scale = np.abs(stats["mean"][position]).max() + stats["std"][position].mean()
        assert np.abs(mean - stats["mean"][position]).max() <= 1e-3 * scale
    again = np.concatenate(list(reader.token_batches(10, batch_size=7, seed=1)))
    other = np.concatenate(list(reader.token_batches(10, batch_size=7, seed=2)))
    assert np.array_equal(again, rows) and not np.array_equal(other, rows)
    normalized = np.concatenate(list(reader.token_batches(10, batch_size=64, normalize=True)))
    assert np.abs(normalized.astype(np.float64).mean(axis=0)).max() < 0.05
    with pytest.raises(ValueError, match=r"\[3, 10\]"):
        next(reader.token_batches(5, batch_size=4))


def test_projections_submitted_from_numpy_are_the_activations_times_the_unit_directions(client, tmp_path):
    rng = np.random.default_rng(7)
    directions = rng.standard_normal((3, 576)).astype(np.float32) * 4.0
    raw = client.submit(SEED, MODEL, layers=[5]).wait(progress=False)
    projected = client.submit(SEED, MODEL, layers=[5], project_onto=directions).wait(progress=False)
    raw.download(tmp_path / "raw")
    projected.download(tmp_path / "projected")
    activations = raw.open(tmp_path / "raw")
    projections = projected.open(tmp_path / "projected")
    assert projections.contents == "projections" and projections.width == 3
    unit = directions / np.linalg.norm(directions, axis=1, keepdims=True)
    for i in range(2):
        tokens, values = projections.prompt(i)
        raw_tokens, acts = activations.prompt(i)
        assert np.array_equal(tokens, raw_tokens)
        expected = acts[0].astype(np.float64) @ unit.T.astype(np.float64)
        # The server projects the f32 residual; the stored activations are bf16-rounded.
        bound = 1e-2 * np.linalg.norm(acts[0], axis=1, keepdims=True)
        assert (np.abs(values[0] - expected) <= bound).all()


def test_directions_with_nan_or_the_wrong_width_are_refused_before_upload(client):
    before = len(list(client.jobs()))
    bad = np.ones((2, 576), dtype=np.float32)
    bad[1, 17] = np.nan
    with pytest.raises(ValueError, match=r"project_onto\[1, 17\] is nan"):
        client.submit(SEED, MODEL, project_onto=bad)
    with pytest.raises(ValueError, match="hidden size is 576"):
        client.submit(SEED, MODEL, project_onto=np.ones((2, 512), dtype=np.float32))
    with pytest.raises(ValueError, match="row 0 is all zeros"):
        client.submit(SEED, MODEL, project_onto=np.zeros((1, 576), dtype=np.float32))
    with pytest.raises(TypeError, match="not one string"):
        client.submit("one prompt", MODEL)
    assert len(list(client.jobs())) == before


def test_a_wrong_key_raises_a_clear_exception_without_http_internals(server):
    with pytest.raises(InvalidApiKey) as caught:
        Client(server.base, "sk-hv-" + "0" * 48).models()
    error = caught.value
    assert error.status == 401 and error.code == "invalid_api_key"
    assert "invalid_api_key" in str(error) and error.__cause__ is None and error.__context__ is None


def test_server_errors_arrive_as_typed_exceptions_with_the_servers_message(client):
    with pytest.raises(InvalidRequest, match="unknown model"):
        client.submit(SEED, "no-such-model")
    with pytest.raises(InvalidRequest, match="layer"):
        client.submit(SEED, MODEL, layers=[99])
    with pytest.raises(NotFound):
        client.job("00000000-0000-4000-8000-000000000000")


def test_the_job_list_has_the_accounts_jobs_newest_first_and_not_another_accounts(client, server):
    first = client.submit(SEED, MODEL, layers=[1])
    second = client.submit(SEED, MODEL, layers=[1])
    listed = [job.id for job in client.jobs(page_size=1)]
    assert listed.index(second.id) < listed.index(first.id)
    theirs = Client(server.base, server.other_key)
    assert not {first.id, second.id} & {job.id for job in theirs.jobs()}
    for job in (first, second):
        job.wait(progress=False)
    assert {first.id, second.id} <= {job.id for job in client.jobs(status="done")}
    usage = client.account()
    assert usage["account"] == "lab" and usage["lanes"]["small"]["limit"] == 3


def test_expired_links_are_renewed_by_the_download(tmp_path):
    server = start_server(tmp_path / "server", {"url_ttl_seconds": 3})
    try:
        client = Client(server.base, server.key)
        job = client.submit(SEED, MODEL, layers=[2]).wait(progress=False)
        stale = job.result["stats_url"]
        wait_until(lambda: requests.get(stale, timeout=10).status_code == 403, timeout=30,
                   interval=0.25, message="the links to expire")
        report = job.download(tmp_path / "files")
        assert report.renewed_links >= 1
        manifest = json.loads((tmp_path / "files/manifest.json").read_text())
        assert sha256(tmp_path / "files/stats.safetensors") == manifest["stats_file"]["sha256"]
    finally:
        server.stop()


def test_the_memory_mapped_reader_reads_what_the_safetensors_library_reads(harvested):
    from safetensors import safe_open

    _, directory, _ = harvested
    path = directory / "stats.safetensors"
    ours = SafetensorsFile(path)
    with safe_open(str(path), framework="numpy") as theirs:
        for name in theirs.keys():
            assert np.array_equal(np.asarray(ours.raw(name)), theirs.get_tensor(name)), name


def test_a_file_the_server_itself_holds_corrupted_fails_the_check_twice_and_is_named(client, server, tmp_path):
    job = client.submit(SEED, MODEL, layers=[4]).wait(progress=False)
    served = Path(json.loads(server.config.read_text())["data_dir"]) / "jobs" / job.id / "out"
    shard = served / "shard_00000.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match="shard_00000.safetensors does not match the manifest"):
        job.download(tmp_path)
    assert not (tmp_path / "shard_00000.safetensors").exists()
    assert not (tmp_path / "manifest.json").exists(), "an unverified download has no manifest"


def test_an_estimate_predicts_the_bytes_the_job_then_writes_and_makes_no_job(client):
    before = len(list(client.jobs()))
    prompts = corpus(9)
    estimate = client.estimate(prompts, MODEL, layers=[2, 20], shard_size=4)
    assert estimate["dry_run"] is True and estimate["files"]["shards"]["count"] == 3
    assert len(list(client.jobs())) == before
    job = client.submit(prompts, MODEL, layers=[2, 20], shard_size=4)
    assert job.data["estimate"]["bytes"] == estimate["total_bytes"]
    job.wait(progress=False)
    written = job.result["bytes_written"]
    assert abs(written - estimate["total_bytes"]) <= written / 100


def test_a_job_with_hook_sites_reads_back_each_site_with_its_own_statistics(client, tmp_path):
    sites = ["resid_pre", "attn_out", "resid_mid", "mlp_out", "resid_post"]
    job = client.submit(corpus(3), MODEL, layers=[4, 9], sites=["mlp_out", "resid_pre", "attn_out", "resid_mid", "resid_post"])
    assert job.data["sites"] == sites, "the job lists its sites in block order"
    job.wait(progress=False).download(tmp_path)
    reader = job.open(tmp_path)
    assert reader.sites == sites
    tokens, post = reader.prompt(1)
    _, pre = reader.prompt(1, site="resid_pre")
    _, attn = reader.prompt(1, site="attn_out")
    _, mid = reader.prompt(1, site="resid_mid")
    _, mlp = reader.prompt(1, site="mlp_out")
    assert pre.shape == attn.shape == mid.shape == mlp.shape == post.shape == (2, tokens.size, 576)
    # The shards hold bf16, so the sums hold to bf16 rounding of each term.
    for a, b, total in [(pre, attn, mid), (mid, mlp, post)]:
        error = np.linalg.norm(a + b - total, axis=-1) / np.linalg.norm(total, axis=-1)
        assert error.max() < 1e-2, error.max()
    rows = np.concatenate([b for b in reader.token_batches(layer=9, batch_size=64, shuffle=False, site="mlp_out")])
    # The statistics are of the f32 values, the rows bf16: close to their own site's mean, far
    # from another site's.
    mean = reader.stats("mlp_out")["mean"][1]
    own = np.linalg.norm(rows.mean(axis=0) - mean) / np.linalg.norm(mean)
    other = np.linalg.norm(rows.mean(axis=0) - reader.stats()["mean"][1]) / np.linalg.norm(mean)
    assert own < 1e-2 and other > 10 * own, (own, other)
    with pytest.raises(ValueError, match="was not harvested"):
        job.open(tmp_path).prompt(0, site="resid_prex")


def test_an_unknown_site_is_a_400_that_names_it_and_the_choices(client):
    with pytest.raises(InvalidRequest, match=r"sites\[0\] \"attn\".*attn_out"):
        client.submit(corpus(1), MODEL, sites=["attn"])


def test_a_router_job_reads_back_each_rows_expert_choices_beside_its_activations(client, tmp_path):
    job = client.submit(corpus(3), MOE_MODEL, layers=[1, 3], sites=["resid_post", "router_logits"], positions=[1, 9])
    job.wait(progress=False).download(tmp_path)
    reader = job.open(tmp_path)
    assert reader.router["layer_indices"] == [3], "the kept MoE blocks: block 1 is dense"
    assert (reader.router["experts"], reader.router["experts_per_token"]) == (8, 2)
    for i in range(len(reader)):
        ids, weights, logits = reader.experts(i, 3, logits=True)
        rows, positions = reader.rows(i, 3)
        assert ids.shape == weights.shape == (positions.size, 2) and logits.shape == (positions.size, 8)
        assert ((ids >= 0) & (ids < 8)).all() and (ids[:, 0] != ids[:, 1]).all()
        # The gate weights are the chosen experts' sigmoid scores, normalised to route_scale (2.5).
        scores = 1 / (1 + np.exp(-np.take_along_axis(logits, ids, axis=1)))
        assert np.allclose(weights, scores / scores.sum(axis=1, keepdims=True) * 2.5, atol=1e-5)
    with pytest.raises(ValueError, match=r"blocks \[3\]"):
        reader.experts(0, 1)
    with pytest.raises(InvalidRequest, match="smollm2-135m is dense"):
        client.submit(corpus(1), MODEL, sites=["resid_post", "router"])


def test_a_token_selection_is_estimated_within_one_percent_and_read_back_by_position(client, tmp_path):
    prompts = ["<|im_start|>" + p for p in corpus(6, words=20)]
    selection = dict(exclude_special_tokens=True, positions=(0, 16), sample_rate=0.5, seed=3)
    estimate = client.estimate(prompts, MODEL, layers=[5], **selection)
    job = client.submit(prompts, MODEL, layers=[5], **selection).wait(progress=False)
    written = job.result["bytes_written"]
    assert abs(written - estimate["total_bytes"]) <= written / 100, (written, estimate["total_bytes"])
    job.download(tmp_path)
    reader = job.open(tmp_path)
    assert reader.selection["kept_tokens"] == estimate["kept_tokens"] == reader.n_tokens()
    assert reader.selection["dropped"]["special"] == len(prompts), "each prompt's BOS"
    for i in range(len(prompts)):
        tokens, rows = reader.prompt(i)
        positions = reader.positions(i)
        assert rows.shape[1] == positions.size and tokens.size > 16
        assert positions.min() >= 1 and positions.max() < 16
    batches = list(reader.token_batches(layer=5, batch_size=7, shuffle=True, seed=1))
    assert sum(b.shape[0] for b in batches) == estimate["kept_tokens"]
    with pytest.raises(TypeError, match="sample_rat"):
        client.submit(prompts, MODEL, sample_rat=0.5)


def test_max_prompt_tokens_cuts_each_long_prompt_and_the_manifest_lists_the_cut_ones(client, tmp_path):
    prompts = corpus(3, words=30) + ["Hi."]
    estimate = client.estimate(prompts, MODEL, layers=[3], max_prompt_tokens=8)
    job = client.submit(prompts, MODEL, layers=[3], max_prompt_tokens=8).wait(progress=False)
    job.download(tmp_path)
    reader = job.open(tmp_path)
    lengths = [reader.prompt(i)[0].size for i in range(len(prompts))]
    assert lengths[:3] == [8, 8, 8] and 1 < lengths[3] < 8, lengths
    assert sum(lengths) == estimate["tokens"] == reader.manifest["total_tokens"]
    assert reader.manifest["tokenizer"]["max_tokens"] == 8
    cut = reader.manifest["truncated_prompts"]
    assert [c["prompt"] for c in cut] == [0, 1, 2] and all(c["original_tokens"] > 8 for c in cut)
    with pytest.raises(InvalidRequest, match="max_prompt_tokens must be between 1 and 1048576, got 0"):
        client.submit(prompts, MODEL, max_prompt_tokens=0)


def test_a_shuffled_job_downloads_its_training_files_and_reads_every_token_once(client, tmp_path):
    prompts = corpus(8, words=12)
    estimate = client.estimate(prompts, MODEL, layers=[3], layout="shuffled", rows_per_file=40, seed=2)
    job = client.submit(prompts, MODEL, layers=[3], layout="shuffled", rows_per_file=40, seed=2).wait(progress=False)
    assert job.result["layout"] == "shuffled"
    assert job.result["n_shards"] == estimate["files"]["shards"]["count"]
    written = job.result["bytes_written"]
    assert abs(written - estimate["total_bytes"]) <= written / 100
    job.download(tmp_path)
    reader = job.open(tmp_path)
    assert reader.layout == "shuffled" and sorted(p.name for p in tmp_path.glob("train_*")) == [
        f"train_{i:05d}.safetensors" for i in range(job.result["n_shards"])
    ]
    seen = [tuple(row) for _, index in reader.train_batches(layer=3, batch_size=33) for row in index.tolist()]
    assert len(seen) == len(set(seen)) == reader.n_tokens() == estimate["tokens"]
    assert [p for p, _ in seen[:20]] != sorted(p for p, _ in seen[:20]), "rows are not in prompt order"
    with pytest.raises(HarvestError, match="train_batches"):
        reader.prompt(0)


def test_a_bf16_job_says_so_in_its_manifest_and_stays_close_to_f32(client, tmp_path):
    prompts = corpus(2)
    runs = {}
    for precision in ("f32", "bf16"):
        job = client.submit(prompts, MODEL, layers=[4], precision=precision).wait(progress=False)
        job.download(tmp_path / precision)
        runs[precision] = job.open(tmp_path / precision)
    assert runs["bf16"].manifest["precision"] == "bf16" and runs["f32"].manifest["precision"] == "f32"
    _, f32 = runs["f32"].prompt(0)
    _, bf16 = runs["bf16"].prompt(0)
    error = np.linalg.norm(bf16 - f32, axis=-1) / np.linalg.norm(f32, axis=-1)
    assert 0 < np.median(error) < 2e-2, np.median(error)


def chat_reference(with_roles: bool = False):
    """SmolLM2's conversations and their token ids as transformers' apply_chat_template makes
    them (harvester/tests/fixtures/chat/reference.json), and each token's role id."""
    path = Path(__file__).resolve().parents[3] / "harvester/tests/fixtures/chat/reference.json"
    reference = json.loads(path.read_text())
    cases = [c for c in reference["families"]["smollm2"]["cases"] if c["add_generation_prompt"]]
    found = [reference["conversations"][c["conversation"]] for c in cases], [c["ids"] for c in cases]
    return (*found, [c["roles"] for c in cases]) if with_roles else found


def test_an_assistant_only_job_and_the_readers_role_filter_keep_exactly_the_assistants_rows(client, tmp_path):
    conversations, expected, roles = chat_reference(with_roles=True)
    assistant = sum(r == 3 for row in roles for r in row)
    full = client.submit(conversations=conversations, model=MODEL, add_generation_prompt=True, layers=[3]).wait(progress=False)
    assert full.status == "done", full.error
    full.download(tmp_path / "full")
    reader = full.open(tmp_path / "full")
    assert reader.role_ids["assistant"] == 3
    for i, ids in enumerate(expected):
        assert reader.roles(i).tolist() == roles[i]
        assert reader.turns(i).size == len(ids)
    assert reader.n_tokens(roles=["assistant"]) == assistant
    client_side = np.concatenate(list(reader.token_batches(3, 5, shuffle=False, roles=["assistant"])))
    estimate = client.estimate(conversations=conversations, model=MODEL, add_generation_prompt=True, layers=[3], roles=["assistant"])
    assert estimate["kept_tokens"] == assistant
    kept = client.submit(conversations=conversations, model=MODEL, add_generation_prompt=True, layers=[3], roles=["assistant"]).wait(progress=False)
    assert kept.status == "done", kept.error
    kept.download(tmp_path / "kept")
    server_side = kept.open(tmp_path / "kept")
    assert server_side.manifest["selection"]["kept_tokens"] == assistant
    rows = np.concatenate(list(server_side.token_batches(3, 5, shuffle=False)))
    np.testing.assert_array_equal(rows, client_side)
    for i in range(len(expected)):
        values, positions = reader.rows(i, 3, roles=["assistant"])
        assert positions.tolist() == [p for p, r in enumerate(roles[i]) if r == 3]
        np.testing.assert_array_equal(server_side.rows(i, 3)[0], values)
    streamed = np.concatenate(list(full.stream(3, 5, shuffle_buffer=0, roles=["assistant"])))
    np.testing.assert_array_equal(streamed, client_side)
    from harvest_client.export import export

    summary = export(tmp_path / "full", tmp_path / "hf", format="hf", layer=3, roles=["assistant"])
    assert summary["rows"] == assistant
    shuffled = client.submit(conversations=conversations, model=MODEL, add_generation_prompt=True, layers=[3], layout="shuffled").wait(progress=False)
    assert shuffled.status == "done", shuffled.error
    shuffled.download(tmp_path / "shuffled")
    train = shuffled.open(tmp_path / "shuffled")
    batches = list(train.train_batches(3, 7, roles=["assistant"]))
    rows = np.concatenate([values for values, _ in batches])
    index = np.concatenate([pairs for _, pairs in batches])
    assert rows.shape[0] == assistant
    assert all(roles[p][q] == 3 for p, q in index.tolist())
    order = np.lexsort((index[:, 1], index[:, 0]))
    np.testing.assert_array_equal(rows[order], client_side)
    # Only conversations have roles; a role name is checked before anything is read or sent.
    plain = client.submit(["no roles here"], MODEL, layers=[3]).wait(progress=False)
    plain.download(tmp_path / "plain")
    with pytest.raises(HarvestError, match="plain text"):
        plain.open(tmp_path / "plain").n_tokens(roles=["assistant"])
    with pytest.raises(ValueError, match="'assistent' is not a role"):
        reader.n_tokens(roles=["assistent"])
    with pytest.raises(ValueError, match="'narrator' is not a role"):
        client.submit(conversations=conversations, model=MODEL, roles=["narrator"])
    with pytest.raises(InvalidRequest, match="roles"):
        client.submit(["a"], MODEL, roles=["assistant"])


def test_conversations_submitted_are_harvested_as_the_chat_template_tokenizes_them(client, tmp_path):
    conversations, expected = chat_reference()
    estimate = client.estimate(conversations=conversations, model=MODEL, add_generation_prompt=True, layers=[3])
    assert estimate["tokens"] == sum(len(ids) for ids in expected)
    job = client.submit(conversations=conversations, model=MODEL, add_generation_prompt=True, layers=[3]).wait(progress=False)
    assert job.status == "done", job.error
    job.download(tmp_path)
    reader = job.open(tmp_path)
    assert len(reader) == len(expected)
    for i, ids in enumerate(expected):
        assert reader.tokens(i).tolist() == ids


def test_bad_conversations_are_refused_before_anything_is_sent(client):
    with pytest.raises(ValueError, match=r"conversations\[0\]\[0\]: role 'narrator'"):
        client.submit(conversations=[[{"role": "narrator", "content": "x"}]], model=MODEL)
    with pytest.raises(TypeError, match="not both"):
        client.submit(["a"], MODEL, conversations=[[{"role": "user", "content": "x"}]])
    with pytest.raises(TypeError, match="add_generation_prompt applies to conversations"):
        client.submit(["a"], MODEL, add_generation_prompt=True)
    with pytest.raises(ValueError, match="has no messages"):
        client.estimate(conversations=[[]], model=MODEL)
