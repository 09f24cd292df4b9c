"""Random K-quant super-blocks and gguf-py's dequantisation of them, for the importer's
bit-identity test (harvester/tests/gguf_kquants.rs).

    python kquants.py OUT_DIR SEED

writes, for each of Q4_K, Q5_K and Q6_K, NAME.blocks (the raw blocks) and NAME.f32 (gguf-py's
float32 values, little-endian)."""

import sys
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, quants

SIZES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
N_BLOCKS = 64


def random_blocks(rng, name):
    raw = rng.integers(0, 256, size=(N_BLOCKS, SIZES[name]), dtype=np.uint8)
    # The f16 scales: finite, both signs, a wide range of exponents (random bits could be NaN).
    scales = (rng.standard_normal((N_BLOCKS, 2)) * np.exp2(rng.integers(-12, 4, (N_BLOCKS, 2)))).astype(np.float16)
    scale_bytes = scales.view(np.uint8).reshape(N_BLOCKS, 4)
    if name == "Q6_K":
        raw[:, 208:210] = scale_bytes[:, :2]
    else:
        raw[:, 0:4] = scale_bytes
    return raw


def main():
    out, seed = Path(sys.argv[1]), int(sys.argv[2])
    rng = np.random.default_rng(seed)
    for name in SIZES:
        blocks = random_blocks(rng, name)
        values = quants.dequantize(blocks.reshape(-1), GGMLQuantizationType[name])
        assert values.dtype == np.float32 and values.size == N_BLOCKS * 256
        (out / f"{name}.blocks").write_bytes(blocks.tobytes())
        (out / f"{name}.f32").write_bytes(values.astype("<f4").tobytes())


if __name__ == "__main__":
    main()
