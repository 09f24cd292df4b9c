"""A downloaded job as a Hugging Face ``datasets`` directory, written chunk by chunk so memory
stays bounded whatever the job's size (needs ``pip install harvest-client[export]``).

- ``saelens``: what SAELens's ``ActivationsStore`` reads from ``cached_activations_path``
  (checked against sae-lens 6.54.12, :data:`SAELENS_VERSION`): one row per ``context_size``
  tokens, a column named after the TransformerLens hook (``blocks.{layer}.hook_{site}``)
  holding float32 ``[context_size, d_in]`` and ``token_ids`` int32 ``[context_size]``, which
  SAELens uses to leave out special tokens. The job's prompts are laid end to end in prompt
  order and cut into rows, as SAELens cuts its own token stream; the tokens past the last
  full row are left out and counted.
- ``hf``: one row per token: ``prompt``, ``position`` and ``token_id`` (int32) and
  ``activation`` (float32 ``[width]``).

For a job of conversations, ``roles`` (for example ``["assistant"]``) keeps only those roles'
tokens, so a SAELens cache can hold the assistant's tokens alone.

Chunks are saved as separate datasets under ``OUT/.tmp_shards`` and their Arrow files are
then moved into ``OUT`` under one ``state.json``: the layout SAELens's own cache runner
writes, so nothing is copied twice."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np

from . import errors
from .reader import Reader

#: The sae-lens release whose loader this format was read from and tested against.
SAELENS_VERSION = "6.54.12"
#: The context size SAELens's configuration defaults to.
DEFAULT_CONTEXT_SIZE = 128
#: Bytes of activations held before a chunk is written.
CHUNK_BYTES = 128 << 20
#: TransformerLens's hook name for each of our hook sites.
HOOKS = {
    "resid_pre": "hook_resid_pre",
    "attn_out": "hook_attn_out",
    "resid_mid": "hook_resid_mid",
    "mlp_out": "hook_mlp_out",
    "resid_post": "hook_resid_post",
}
FORMATS = ("saelens", "hf")


def hook_name(layer: int, site: str) -> str:
    """The TransformerLens hook of hook site ``site`` at block ``layer``."""
    return f"blocks.{layer}.{HOOKS[site]}"


def _datasets():
    try:
        import datasets
    except ImportError:
        raise errors.HarvestError(
            "export writes Hugging Face datasets: install them with pip install 'harvest-client[export]'"
        ) from None
    return datasets


def _tokens(reader: Reader, layer: int, site: str, drop_bos: bool, roles: Optional[Sequence[str]] = None) -> Iterator[Tuple[int, np.ndarray, np.ndarray, np.ndarray]]:
    """Each prompt's kept rows at ``layer``: (prompt, positions, token ids, float32 rows)."""
    for i in range(reader.n_prompts):
        rows, positions = reader.rows(i, layer, site=site, drop_bos=drop_bos, roles=roles)
        yield i, positions, reader.tokens(i)[positions], rows


def export(
    directory: Union[str, Path],
    out: Union[str, Path],
    *,
    format: str,
    layer: int,
    site: str = "resid_post",
    context_size: int = DEFAULT_CONTEXT_SIZE,
    hook: Optional[str] = None,
    drop_bos: bool = True,
    chunk_bytes: int = CHUNK_BYTES,
    roles: Optional[Sequence[str]] = None,
) -> Dict[str, Any]:
    """Writes the downloaded job in ``directory`` to the new directory ``out`` in ``format``
    (``saelens`` or ``hf``) and returns what it wrote. ``hook`` renames the SAELens column
    (default ``blocks.{layer}.hook_{site}``); ``roles`` keeps only those roles' tokens of a
    job of conversations."""
    if format not in FORMATS:
        raise ValueError(f"format {format!r} is not one of {', '.join(FORMATS)}")
    reader = Reader(directory)
    if reader.layout != "by_prompt":
        raise errors.HarvestError(
            f"{directory} holds training files (the shuffled layout), which keep no token order: export a by_prompt job"
        )
    reader.layer_position(layer)
    if site not in reader.sites:
        raise ValueError(f"site {site!r} was not harvested: this job kept {reader.sites}")
    if format == "saelens" and reader.contents != "activations":
        raise errors.HarvestError(
            f"{directory} holds projections onto directions, not activations: SAELens trains on activations (use --format hf)"
        )
    if context_size < 1:
        raise ValueError(f"context_size={context_size} must be at least 1")
    reader._roles_wanted(roles)
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise errors.HarvestError(f"{out} is not empty: export into a new or empty directory (SAELens refuses the same)")
    datasets = _datasets()
    out.mkdir(parents=True, exist_ok=True)
    scratch = out / ".tmp_shards"
    scratch.mkdir()
    width = reader.width
    description = {
        "source": str(Path(directory).resolve()),
        "plan_fingerprint": reader.manifest.get("plan_fingerprint"),
        "model": reader.manifest.get("model", {}).get("name"),
        "layer": layer,
        "site": site,
        "drop_bos": drop_bos,
        "roles": list(roles) if roles is not None else None,
    }
    if format == "saelens":
        column = hook or hook_name(layer, site)
        summary = _saelens(datasets, reader, scratch, layer, site, column, context_size, (drop_bos, roles), chunk_bytes, description)
    else:
        summary = _hf(datasets, reader, scratch, layer, site, (drop_bos, roles), chunk_bytes, description)
    summary["files"] = _consolidate(datasets, scratch, out)
    summary.update(format=format, out=str(out), width=width)
    return summary


def _save(datasets, scratch: Path, index: int, columns: Dict[str, np.ndarray], features, description: Dict[str, Any]) -> None:
    info = datasets.DatasetInfo(description=json.dumps(description), features=features)
    chunk = datasets.Dataset.from_dict(columns, features=features, info=info)
    chunk.save_to_disk(str(scratch / f"shard_{index:05d}"), num_shards=1)


def _saelens(datasets, reader: Reader, scratch: Path, layer: int, site: str, column: str, context_size: int, kept: Tuple[bool, Optional[Sequence[str]]], chunk_bytes: int, description: Dict[str, Any]) -> Dict[str, Any]:
    width = reader.width
    features = datasets.Features(
        {
            column: datasets.Array2D(shape=(context_size, width), dtype="float32"),
            "token_ids": datasets.Sequence(datasets.Value("int32"), length=context_size),
        }
    )
    per_chunk = max(1, chunk_bytes // (context_size * width * 4))
    description = {**description, "context_size": context_size, "hook_name": column, "sae_lens": SAELENS_VERSION}
    acts = np.empty((per_chunk * context_size, width), dtype=np.float32)
    ids = np.empty(per_chunk * context_size, dtype=np.int32)
    filled = chunks = rows = tokens = 0
    for _, _, token_ids, values in _tokens(reader, layer, site, *kept):
        tokens += token_ids.size
        while token_ids.size:
            take = min(token_ids.size, acts.shape[0] - filled)
            acts[filled : filled + take] = values[:take]
            ids[filled : filled + take] = token_ids[:take]
            filled += take
            token_ids, values = token_ids[take:], values[take:]
            if filled == acts.shape[0]:
                _save(datasets, scratch, chunks, {column: acts.reshape(per_chunk, context_size, width), "token_ids": ids.reshape(per_chunk, context_size)}, features, description)
                chunks += 1
                rows += per_chunk
                filled = 0
    full = filled // context_size
    if full:
        n = full * context_size
        _save(datasets, scratch, chunks, {column: acts[:n].reshape(full, context_size, width), "token_ids": ids[:n].reshape(full, context_size)}, features, description)
        chunks += 1
        rows += full
    if not rows:
        shutil.rmtree(scratch.parent)
        raise errors.HarvestError(
            f"the job has {tokens} tokens at block {layer}, fewer than one row of context_size={context_size}: pass a smaller --context-size"
        )
    return {"hook_name": column, "context_size": context_size, "rows": rows, "tokens": rows * context_size, "left_out_tokens": tokens - rows * context_size}


def _hf(datasets, reader: Reader, scratch: Path, layer: int, site: str, kept: Tuple[bool, Optional[Sequence[str]]], chunk_bytes: int, description: Dict[str, Any]) -> Dict[str, Any]:
    width = reader.width
    features = datasets.Features(
        {
            "prompt": datasets.Value("int32"),
            "position": datasets.Value("int32"),
            "token_id": datasets.Value("int32"),
            "activation": datasets.Sequence(datasets.Value("float32"), length=width),
        }
    )
    per_chunk = max(1, chunk_bytes // (width * 4))
    pending: List[Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
    held = chunks = rows = 0

    def flush() -> None:
        nonlocal pending, held, chunks
        prompt, position, token_id, activation = (np.concatenate(parts) for parts in zip(*pending))
        _save(datasets, scratch, chunks, {"prompt": prompt, "position": position, "token_id": token_id, "activation": activation}, features, description)
        chunks += 1
        pending, held = [], 0

    for i, positions, token_ids, values in _tokens(reader, layer, site, *kept):
        pending.append((np.full(positions.size, i, dtype=np.int32), positions.astype(np.int32), token_ids.astype(np.int32), values))
        held += positions.size
        rows += positions.size
        if held >= per_chunk:
            flush()
    if held:
        flush()
    return {"rows": rows, "tokens": rows}


def _consolidate(datasets, scratch: Path, out: Path) -> List[str]:
    """Moves each chunk's Arrow files into ``out`` under one ``state.json``."""
    chunks = sorted(p for p in scratch.iterdir() if p.name.startswith("shard_"))
    arrow: List[Path] = []
    for chunk in chunks:
        state = json.loads((chunk / "state.json").read_text())
        arrow.extend(chunk / f["filename"] for f in state["_data_files"])
    shutil.move(str(chunks[0] / "dataset_info.json"), str(out / "dataset_info.json"))
    names = []
    for index, source in enumerate(arrow):
        name = f"data-{index:05d}-of-{len(arrow):05d}.arrow"
        shutil.move(str(source), str(out / name))
        names.append(name)
    state = {
        "_data_files": [{"filename": name} for name in names],
        "_fingerprint": None,
        "_format_columns": None,
        "_format_kwargs": {},
        "_format_type": None,
        "_output_all_columns": False,
        "_split": None,
    }
    (out / "state.json").write_text(json.dumps(state, indent=2))
    shutil.rmtree(scratch)
    from datasets.fingerprint import generate_fingerprint

    state["_fingerprint"] = generate_fingerprint(datasets.load_from_disk(str(out)))
    (out / "state.json").write_text(json.dumps(state, indent=2))
    return names + ["dataset_info.json", "state.json"]
