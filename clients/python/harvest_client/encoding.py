"""``project_onto`` from a numpy array or a torch tensor: checked here, before upload, then sent
as the API wants it (base64 of the raw little-endian buffer, its dtype and shape)."""

from __future__ import annotations

import base64
from typing import Any, Dict, Optional

import numpy as np

#: The most directions a job may project onto.
MAX_DIRECTIONS = 64


def _from_torch(tensor: Any) -> tuple[np.ndarray, str]:
    """A torch tensor's values as numpy, keeping bfloat16's bits as they are."""
    import torch  # only reached when a tensor was passed, so torch is installed

    tensor = tensor.detach().cpu().contiguous()
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(np.uint16), "bfloat16"
    if tensor.dtype == torch.float16:
        return tensor.numpy(), "float16"
    return tensor.to(torch.float32).numpy(), "float32"


def _is_torch(value: Any) -> bool:
    return type(value).__module__.startswith("torch")


def _as_float32(values: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        return (values.astype(np.uint32) << 16).view(np.float32)
    return values.astype(np.float32)


def encode_directions(directions: Any, hidden_size: Optional[int]) -> Dict[str, Any]:
    """``project_onto`` for ``directions`` (``[n_directions, hidden]``, or one direction as
    ``[hidden]``). Refuses, naming the problem: the wrong number of axes, no rows or more than
    64, the wrong width (when ``hidden_size`` is known), NaN or infinite values, a zero row."""
    if _is_torch(directions):
        values, dtype = _from_torch(directions)
    else:
        array = np.asarray(directions)
        if array.dtype == np.float16:
            values, dtype = array, "float16"
        elif array.dtype.kind in "fiu":
            values, dtype = array.astype(np.float32), "float32"
        else:
            raise TypeError(
                f"project_onto must hold numbers, not {array.dtype}: pass a float32, float16 or "
                "bfloat16 array or tensor"
            )
    if values.ndim == 1:
        values = values.reshape(1, -1)
    if values.ndim != 2:
        raise ValueError(
            f"project_onto must be [n_directions, hidden], but has shape {tuple(values.shape)}"
        )
    rows, width = values.shape
    if not 1 <= rows <= MAX_DIRECTIONS:
        raise ValueError(f"project_onto has {rows} directions: send 1 to {MAX_DIRECTIONS}")
    if hidden_size is not None and width != hidden_size:
        raise ValueError(
            f"project_onto is {width} wide, but the model's hidden size is {hidden_size}: "
            f"directions must be [n_directions, {hidden_size}]"
        )
    checked = _as_float32(values, dtype)
    bad = np.argwhere(~np.isfinite(checked))
    if bad.size:
        row, col = (int(x) for x in bad[0])
        raise ValueError(
            f"project_onto[{row}, {col}] is {checked[row, col]}: every value must be finite "
            f"({len(bad)} are not)"
        )
    norms = np.linalg.norm(checked.astype(np.float64), axis=1)
    zero = np.flatnonzero(norms == 0)
    if zero.size:
        raise ValueError(
            f"project_onto row {int(zero[0])} is all zeros: a direction needs a length to be "
            "normalised"
        )
    raw = np.ascontiguousarray(values).astype(values.dtype.newbyteorder("<"), copy=False)
    return {
        "data": base64.b64encode(raw.tobytes()).decode("ascii"),
        "dtype": dtype,
        "shape": [int(rows), int(width)],
        "compression": "none",
    }
