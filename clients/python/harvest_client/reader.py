"""Reading a downloaded job: single prompts, the statistics, and shuffled token batches for SAE
training or probes. Shards are memory-mapped, so memory stays bounded by the batch (plus an
index of 8 bytes per token), whatever the job's size."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np

from . import errors

_DTYPES = {
    "BF16": np.uint16,  # widened to float32 on read
    "F16": np.float16,
    "F32": np.float32,
    "F64": np.float64,
    "I32": np.int32,
    "I64": np.int64,
    "U8": np.uint8,
    "U16": np.uint16,
}

#: Each role's id in ``roles_i`` (the manifest's ``roles.ids`` lists the same).
ROLE_IDS = {"template": 0, "system": 1, "user": 2, "assistant": 3, "tool": 4}


def role_ids(roles: Sequence[str], known: Optional[Dict[str, int]] = None) -> np.ndarray:
    """The ids of the named roles (uint8), refusing an unknown name or one string."""
    known = known or ROLE_IDS
    if isinstance(roles, (str, bytes)):
        raise TypeError(f"roles must be a list of role names, not one string: wrap it as [{roles!r}]")
    ids = []
    for role in roles:
        if role not in known:
            raise ValueError(f"roles: {role!r} is not a role: give any of {', '.join(known)}, for example ['assistant']")
        ids.append(known[role])
    if not ids:
        raise ValueError("roles is empty, which keeps no token: name the roles to keep, or pass None for every token")
    return np.array(sorted(set(ids)), dtype=np.uint8)


def kept_by_role(file: "SafetensorsFile", i: int, ids: np.ndarray) -> np.ndarray:
    """Which of prompt ``i``'s activation rows in ``file`` are of a role in ``ids`` (bool
    ``[n_kept]``): ``roles_i`` is over every token that ran, the rows over ``positions_i``."""
    name = f"roles_{i}"
    if name not in file.header:
        raise errors.HarvestError(
            f"{file.path.name} has no {name}: roles belong to jobs of conversations, and this job's prompts are plain text"
        )
    roles = np.array(file.raw(name))
    if f"positions_{i}" in file.header:
        roles = roles[np.array(file.raw(f"positions_{i}"))]
    return np.isin(roles, ids)


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) as float32 values, exactly."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


class SafetensorsFile:
    """A safetensors file, memory-mapped: tensors are views until they are converted."""

    def __init__(self, path: Union[str, Path]) -> None:
        self.path = Path(path)
        size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            head = f.read(8)
            if len(head) != 8:
                raise errors.HarvestError(f"{self.path} is not a safetensors file (too short)")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                raise errors.HarvestError(f"{self.path} is not a safetensors file (header of {n} bytes)")
            header = json.loads(f.read(n))
        self.metadata: Dict[str, str] = header.pop("__metadata__", {}) or {}
        self.header: Dict[str, Dict[str, Any]] = header
        self._base = 8 + n
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        for name, info in header.items():
            start, end = info["data_offsets"]
            if self._base + end > size:
                raise errors.HarvestError(f"{self.path}: tensor {name} runs past the end of the file")

    def names(self) -> List[str]:
        return list(self.header)

    def dtype(self, name: str) -> str:
        return self.header[name]["dtype"]

    def raw(self, name: str) -> np.ndarray:
        """The tensor as stored (bfloat16 as its uint16 bits), a view of the mapped file."""
        try:
            info = self.header[name]
        except KeyError:
            raise KeyError(f"{self.path.name} has no tensor {name!r}") from None
        dtype = _DTYPES.get(info["dtype"])
        if dtype is None:
            raise errors.HarvestError(f"{self.path.name}: tensor {name} has dtype {info['dtype']}, which this reader does not read")
        start, end = info["data_offsets"]
        return self._map[self._base + start : self._base + end].view(dtype).reshape(info["shape"])

    def float32(self, name: str) -> np.ndarray:
        """The tensor as float32 (a new array)."""
        raw = self.raw(name)
        return bf16_to_f32(raw) if self.dtype(name) == "BF16" else np.array(raw, dtype=np.float32)


class Reader:
    """A job's files in one directory, as :meth:`Job.download` leaves them."""

    def __init__(self, directory: Union[str, Path]) -> None:
        self.directory = Path(directory)
        manifest_path = self.directory / "manifest.json"
        if not manifest_path.exists():
            raise errors.HarvestError(
                f"{manifest_path} is missing: the download is incomplete (run job.download again)"
            )
        self.manifest: Dict[str, Any] = json.loads(manifest_path.read_text())
        #: The kept blocks, ascending: the first axis of every activation tensor.
        self.layer_indices: List[int] = list(self.manifest["layer_indices"])
        #: Prompts in the job.
        self.n_prompts: int = int(self.manifest["n_prompts"])
        #: "activations" or "projections".
        self.contents: str = self.manifest["contents"]
        #: The kept hook sites, in block order (manifests from before sites kept resid_post alone).
        self.sites: List[str] = [entry["site"] for entry in self.manifest.get("sites") or []] or ["resid_post"]
        #: The token selection block, when the job selected tokens (activations then hold the
        #: positions ``positions_i`` lists).
        self.selection: Optional[Dict[str, Any]] = self.manifest.get("selection")
        #: "by_prompt" or "shuffled" (training files, read with :meth:`train_batches`).
        self.layout: str = self.manifest.get("layout", "by_prompt")
        #: For a job of conversations: each role's id in ``roles_i`` (None for plain prompts).
        self.role_ids: Optional[Dict[str, int]] = None
        if self.manifest.get("roles"):
            self.role_ids = {name: int(i) for i, name in self.manifest["roles"]["ids"].items()}
        #: For a job that kept the ``router`` site: its block (``layer_indices``, the MoE blocks
        #: of the kept layers; ``experts``; ``experts_per_token``; ``logits``), else None.
        self.router: Optional[Dict[str, Any]] = self.manifest.get("router")
        self._where: Dict[int, Tuple[str, int]] = {}
        for shard in self.manifest["shards"]:
            counts = shard["kept_counts"] if self.selection else shard["token_counts"]
            prompts = shard.get("prompts") or list(range(shard["first_prompt"], shard["first_prompt"] + len(counts)))
            for prompt, n_tokens in zip(prompts, counts):
                self._where[int(prompt)] = (shard["file"], int(n_tokens))
        self._files: Dict[str, SafetensorsFile] = {}

    def __len__(self) -> int:
        return self.n_prompts

    def __repr__(self) -> str:
        return f"Reader({str(self.directory)!r}, prompts={self.n_prompts}, layers={self.layer_indices}, {self.contents})"

    @property
    def width(self) -> int:
        """The last axis: the hidden size, or the number of directions for projections."""
        projection = self.manifest.get("projection")
        return int(projection["n_directions"]) if projection else int(self.manifest["model"]["hidden_size"])

    def _file(self, name: str) -> SafetensorsFile:
        if name not in self._files:
            self._files[name] = SafetensorsFile(self.directory / name)
        return self._files[name]

    def _shard_of(self, i: int) -> SafetensorsFile:
        if self.layout == "shuffled":
            raise errors.HarvestError(
                "this job's layout is shuffled: it has training files, not prompts; read them with train_batches"
            )
        if i not in self._where:
            raise IndexError(f"prompt {i} is not in this job (it has prompts 0 to {self.n_prompts - 1})")
        return self._file(self._where[i][0])

    def layer_position(self, layer: int) -> int:
        """Where block ``layer`` sits on the first axis (it must be one of ``layer_indices``)."""
        try:
            return self.layer_indices.index(layer)
        except ValueError:
            raise ValueError(
                f"layer {layer} was not harvested: this job kept blocks {self.layer_indices} "
                "(pass a block index, not a position in that list)"
            ) from None

    def _tensor_name(self, site: str, i: int) -> str:
        """Prompt ``i``'s tensor of hook site ``site`` (``prompt_i`` for ``resid_post``)."""
        if site not in self.sites:
            raise ValueError(f"site {site!r} was not harvested: this job kept {self.sites}")
        return f"prompt_{i}" if site == "resid_post" else f"{site}_{i}"

    def tokens(self, i: int) -> np.ndarray:
        """Prompt ``i``'s token ids (int32), every one that ran."""
        return np.array(self._shard_of(i).raw(f"tokens_{i}"))

    def _roles_wanted(self, roles: Optional[Sequence[str]]) -> Optional[np.ndarray]:
        if roles is None:
            return None
        if self.role_ids is None:
            raise errors.HarvestError(
                "roles belong to jobs of conversations, and this job's prompts are plain text: leave roles out"
            )
        return role_ids(roles, self.role_ids)

    def roles(self, i: int) -> np.ndarray:
        """Prompt ``i``'s role id of every token that ran (uint8, beside :meth:`tokens`; names
        in :attr:`role_ids`), for a job of conversations."""
        if self.role_ids is None:
            raise errors.HarvestError("this job's prompts are plain text: only conversations have roles")
        return np.array(self._shard_of(i).raw(f"roles_{i}"))

    def turns(self, i: int) -> np.ndarray:
        """Prompt ``i``'s message index of every token that ran (uint16, beside :meth:`tokens`;
        the template's markup before message k is turn k), for a job of conversations."""
        if self.role_ids is None:
            raise errors.HarvestError("this job's prompts are plain text: only conversations have turns")
        return np.array(self._shard_of(i).raw(f"turns_{i}"))

    def positions(self, i: int) -> np.ndarray:
        """The positions of prompt ``i`` its activations hold, in the order of their token axis
        (every position unless the job selected tokens)."""
        if self.selection is None:
            return np.arange(self.tokens(i).size, dtype=np.int32)
        return np.array(self._shard_of(i).raw(f"positions_{i}"))

    def experts(self, i: int, layer: int, *, logits: bool = False) -> Tuple[np.ndarray, ...]:
        """Prompt ``i``'s expert choices at mixture-of-experts block ``layer``, one row per
        activation row (:meth:`positions`): int32 ``[n_kept, k]`` expert ids in the router's
        rank order (highest score plus bias first) and float32 ``[n_kept, k]`` gate weights;
        with ``logits=True`` also the float32 ``[n_kept, experts]`` router logits."""
        if self.router is None:
            raise errors.HarvestError(
                "this job kept no expert choices: submit it with sites including 'router' (a mixture-of-experts model)"
            )
        blocks = list(self.router["layer_indices"])
        if layer not in blocks:
            raise ValueError(f"layer {layer} has no expert choices: this job kept them at blocks {blocks}")
        if logits and not self.router.get("logits"):
            raise errors.HarvestError("this job kept no router logits: submit it with the site 'router_logits'")
        at = blocks.index(layer)
        shard = self._shard_of(i)
        names = ["router_ids", "router_weights"] + (["router_logits"] if logits else [])
        return tuple(np.array(shard.raw(f"{name}_{i}")[at]) for name in names)

    def prompt(self, i: int, *, torch: bool = False, site: str = "resid_post") -> Tuple[Any, Any]:
        """Prompt ``i``: its tokens ``[n_tokens]`` and activations ``[n_layers_kept, n_tokens,
        width]`` of hook site ``site``. As numpy (bfloat16 widened to float32 exactly), or with
        ``torch=True`` as torch tensors, bfloat16 kept as bfloat16."""
        shard = self._shard_of(i)
        name = self._tensor_name(site, i)
        if torch:
            import torch as th

            tokens = th.from_numpy(np.array(shard.raw(f"tokens_{i}")))
            raw = np.array(shard.raw(name))
            if shard.dtype(name) == "BF16":
                return tokens, th.from_numpy(raw.view(np.int16)).view(th.bfloat16)
            return tokens, th.from_numpy(raw)
        return self.tokens(i), shard.float32(name)

    def rows(
        self, i: int, layer: int, *, site: str = "resid_post", drop_bos: bool = False, roles: Optional[Sequence[str]] = None
    ) -> Tuple[np.ndarray, np.ndarray]:
        """Prompt ``i`` at block ``layer`` alone: float32 ``[n_kept, width]`` rows of hook
        site ``site`` and the int32 ``[n_kept]`` positions they hold. ``drop_bos`` leaves out
        a leading BOS by the statistics' rule (as :meth:`token_batches` does); ``roles`` keeps
        only those roles' tokens (a job of conversations)."""
        position = self.layer_position(layer)
        wanted = self._roles_wanted(roles)
        shard = self._shard_of(i)
        name = self._tensor_name(site, i)
        raw = shard.raw(name)[position]
        positions = self.positions(i)
        keep = np.ones(positions.size, dtype=bool)
        if drop_bos and self._leading_bos(i):
            keep[0] = False
        if wanted is not None:
            keep &= kept_by_role(shard, i, wanted)
        values = raw[keep] if not keep.all() else raw
        return (bf16_to_f32(values) if shard.dtype(name) == "BF16" else np.array(values, dtype=np.float32)), positions[keep]

    def _leading_bos(self, i: int) -> bool:
        """Whether prompt ``i``'s activations start with the BOS the statistics leave out."""
        bos = self.manifest.get("tokenizer", {}).get("bos_token_id")
        if bos is None or self._where[i][1] == 0:
            return False
        shard = self._shard_of(i)
        leading = self.selection is None or int(shard.raw(f"positions_{i}")[0]) == 0
        return leading and int(shard.raw(f"tokens_{i}")[0]) == bos

    def stats(self, site: str = "resid_post") -> Dict[str, Any]:
        """``mean`` and ``std`` of hook site ``site`` (float32 ``[n_layers_kept, width]``) and
        ``count`` (tokens counted: all but each prompt's leading BOS)."""
        self._tensor_name(site, 0)
        stats = SafetensorsFile(self.directory / "stats.safetensors")
        prefix = "" if site == "resid_post" else f"{site}_"
        return {
            "mean": stats.float32(f"{prefix}mean"),
            "std": stats.float32(f"{prefix}std"),
            "count": int(np.array(stats.raw("count")).reshape(-1)[0]),
        }

    def _index(self, drop_bos: bool, roles: Optional[Sequence[str]] = None) -> Tuple[np.ndarray, np.ndarray]:
        """Every kept row as (prompt, row), leaving out each leading BOS when asked, by the
        same rule as the statistics (a prompt whose first id is the tokenizer's BOS), and the
        rows of other roles than ``roles``."""
        wanted = self._roles_wanted(roles)
        prompts: List[np.ndarray] = []
        positions: List[np.ndarray] = []
        for i in range(self.n_prompts):
            n = self._where[i][1]
            first = 1 if drop_bos and self._leading_bos(i) else 0
            rows = np.arange(first, n, dtype=np.int32)
            if wanted is not None and n:
                rows = rows[kept_by_role(self._shard_of(i), i, wanted)[first:]]
            positions.append(rows)
            prompts.append(np.full(rows.size, i, dtype=np.int32))
        if not prompts:
            return np.zeros(0, np.int32), np.zeros(0, np.int32)
        return np.concatenate(prompts), np.concatenate(positions)

    def n_tokens(self, drop_bos: bool = True, roles: Optional[Sequence[str]] = None) -> int:
        """Tokens :meth:`token_batches` yields per epoch (for the shuffled layout, the rows of
        the training files)."""
        if self.layout == "shuffled":
            return int(self.manifest["train"]["rows"])
        return int(self._index(drop_bos, roles)[0].size)

    def train_batches(
        self, layer: int, batch_size: int, *, site: str = "resid_post", roles: Optional[Sequence[str]] = None
    ) -> Iterator[Tuple[np.ndarray, np.ndarray]]:
        """The shuffled layout's rows in file order (already a seeded uniform permutation of the
        whole job): float32 ``[batch, width]`` of hook site ``site`` at block ``layer``, with the
        ``[batch, 2]`` (prompt, position) of each row. The training files hold every kept
        token, BOS included unless the job excluded special tokens; for a job of
        conversations, ``roles=["assistant"]`` yields only those roles' rows (each file's
        ``roles`` tensor)."""
        if self.layout != "shuffled":
            raise errors.HarvestError("this job's layout is by_prompt: read it with token_batches")
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be at least 1")
        self.layer_position(layer)
        self._tensor_name(site, 0)
        wanted = self._roles_wanted(roles)
        name = f"{site}.{layer}"
        pending: List[Tuple[np.ndarray, np.ndarray]] = []
        held = 0
        for entry in self.manifest["train"]["files"]:
            file = self._file(entry["file"])
            values, index = file.float32(name), np.array(file.raw("index"))
            if wanted is not None:
                keep = np.isin(np.array(file.raw("roles")), wanted)
                values, index = values[keep], index[keep]
            pending.append((values, index))
            held += values.shape[0]
            while held >= batch_size:
                values = np.concatenate([v for v, _ in pending])
                index = np.concatenate([i for _, i in pending])
                yield values[:batch_size], index[:batch_size]
                pending, held = [(values[batch_size:], index[batch_size:])], values.shape[0] - batch_size
        if held:
            yield np.concatenate([v for v, _ in pending]), np.concatenate([i for _, i in pending])

    def token_batches(
        self,
        layer: int,
        batch_size: int,
        shuffle: bool = True,
        seed: int = 0,
        drop_bos: bool = True,
        normalize: bool = False,
        *,
        drop_last: bool = False,
        site: str = "resid_post",
        roles: Optional[Sequence[str]] = None,
    ) -> Iterator[np.ndarray]:
        """One epoch of float32 ``[batch, width]`` rows of block ``layer`` (one of
        ``layer_indices``), every token once, in an order drawn from ``seed`` across all shards
        when ``shuffle``. ``drop_bos`` leaves out each prompt's leading BOS (as the statistics
        do); ``normalize`` subtracts the statistics' mean and divides by their std. The last
        batch may be short unless ``drop_last``. ``site`` picks the hook site (default
        ``resid_post``). For a job of conversations, ``roles=["assistant"]`` yields only those
        roles' tokens (the statistics, for ``normalize``, stay those of every kept token)."""
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be at least 1")
        position = self.layer_position(layer)
        self._tensor_name(site, 0)
        prompts, positions = self._index(drop_bos, roles)
        order = np.random.default_rng(seed).permutation(prompts.size) if shuffle else np.arange(prompts.size)
        mean = std = None
        if normalize:
            stats = self.stats(site)
            mean = stats["mean"][position]
            std = np.where(stats["std"][position] > 0, stats["std"][position], 1.0).astype(np.float32)
        width = self.width
        for start in range(0, order.size, batch_size):
            rows = order[start : start + batch_size]
            if drop_last and rows.size < batch_size:
                return
            batch = np.empty((rows.size, width), dtype=np.float32)
            # Gather prompt by prompt (rows of one prompt are one mapped tensor), in place.
            by_prompt = np.argsort(prompts[rows], kind="stable")
            sorted_prompts = prompts[rows][by_prompt]
            cuts = np.flatnonzero(np.diff(sorted_prompts)) + 1
            for group in np.split(by_prompt, cuts):
                i = int(prompts[rows[group[0]]])
                shard = self._shard_of(i)
                name = self._tensor_name(site, i)
                raw = shard.raw(name)[position]
                taken = raw[positions[rows[group]]]
                batch[group] = bf16_to_f32(taken) if shard.dtype(name) == "BF16" else taken
            if normalize:
                batch -= mean
                batch /= std
            yield batch
