//! The trickiest kernels replayed on the CPU, loop for loop, against plain reference maths: the
//! attention kernel's tiling and online softmax over the host's tile list, and the hand-written
//! bf16 rounding. This checks the algorithms without a GPU; whether the CUDA C compiles is the
//! NVRTC test's job, and whether it runs is the GPU check's.

use super::plan::attention_tiles;

/// Mirrors `#define QUERIES` and `KEYS` in `kernels.cu` (checked against the source below).
const QUERIES: usize = 8;
const KEYS: usize = 32;
/// Mirrors `#define MMA_QUERIES` and `MMA_KEYS`: the tensor-core kernel's queries per block
/// (16 a warp) and keys per shared tile.
const MMA_QUERIES: usize = 64;
const MMA_KEYS: usize = 64;

#[cfg(test)]
/// SHA-256 of the kernel functions this file and `replay` replay, whitespace-collapsed: a change to the
/// CUDA C fails [`the_replayed_kernels_are_the_ones_in_kernels_cu`] until the replay here is
/// brought in line and these are updated.
const MIRRORED: [(&str, &str); 21] = [
    (
        "f32_to_bf16",
        "cf110c3fbd9029c7be42bc38fca22b370bedf7bb64baffeae0ad9c9177c3e0cd",
    ),
    // The two modes' reads and writes of an activation (the f32 mode's are exact).
    (
        "widened",
        "2174d3d61b7874c80ef00be5f29bf026d885e3f453094ca69bf8de156da19153",
    ),
    (
        "stored<bf16>",
        "7546edeaaeb4fbea2911f42b0e3ae37015d75033df1c5eefcc45da47f6e14cc5",
    ),
    (
        "stored<float>",
        "b507e01c6a5668bdc512af903a98f9b1182383eee2ec382a43906755db384350",
    ),
    // Replayed by `replay` (`--device cuda-replay`), in either mode.
    (
        "gather_rows",
        "8b7e0d19855e6ca2cf12b20ccfb31fe5dd1de637f55b0c1a48055016cc4858be",
    ),
    (
        "warp_sum",
        "b7e86d48686efa9435a884df1cfaa9d007142df27c270775ec23df8344ab3f40",
    ),
    (
        "norm_rows",
        "120d9c6bf07007033ed3f63dfd3bf2e7dea9a2aac2d3a3a69008a3f32bc4ad7a",
    ),
    (
        "rotate_heads",
        "a8bd4715f7e6c2c10d7a488c85724b797585f42cb6d37d2bd61f3c0339b24e84",
    ),
    (
        "silu_times",
        "c2ba4458f4afd24f881b7ebed214bbd329181f63351eae053f38507a3e8e61ed",
    ),
    (
        "swiglu",
        "e0910800fd13705af88fedbf0de05b11ac19dc7b56eeb856409b248d28ab11b4",
    ),
    (
        "swiglu_f32",
        "f47ce3c0c73fc9e8678715930c2641a29df6c6a07c4b43a6071ba05ad4174ae4",
    ),
    (
        "add_rows",
        "a93641e68a6a5905f2490ed36f69c18a5795b951d4dd408ba90fc6f83defd71d",
    ),
    (
        "round_bf16",
        "ac5bf07099ed96361c187d97008b29862b883c60d5dfdccda605ae4b4c695839",
    ),
    (
        "project",
        "0d496b80888824f113c3fdf323687a6a154fe66a5d4eabde34207a4320c86edb",
    ),
    // AFMoE (replay/afmoe.rs), and the norm they share with `rms_norm`.
    (
        "block_sum",
        "e6ad61c91e0e0eb81e8fcf563229ad9cac975bc49f71df796be4fac8a082102d",
    ),
    (
        "norm_heads",
        "1c4193462a80f0ef950c194b7f42a4ba5f152722a53f2190b721b987727dcb88",
    ),
    (
        "gate_values",
        "6c30b42391aeeb604a579ffce6f9405340280ab0b3acaf743eef3ce6a308de69",
    ),
    (
        "group_rows",
        "306b163ad9ee05ee64259ccf437ca6088854f0dc1b6da6047d610079473e7123",
    ),
    (
        "moe_scatter",
        "5a1615e987389dd9050382ada842f444c952e17e79cec271962d691351984ee7",
    ),
    (
        "attend_varlen",
        "40d951b9f2c68542393435d9f08453993657f26a6dc2874c8d5c885b57ad73fc",
    ),
    (
        "attention_mma",
        "363a1feb6b3c9e2f69811b33215f238b983aa59113f8b8e3dcb062ecde58720e",
    ),
];

/// The text of function `name` in `kernels.cu`, from the start of its signature's line to its
/// closing brace.
#[cfg(test)]
fn kernel_function(name: &str) -> &'static str {
    let source = super::kernels::SOURCE;
    let at = source
        .find(&format!("{name}("))
        .unwrap_or_else(|| panic!("{name} is not in kernels.cu"));
    let start = source[..at].rfind('\n').map_or(0, |n| n + 1);
    let mut depth = 0usize;
    for (offset, byte) in source[at..].bytes().enumerate() {
        match byte {
            b'{' => depth += 1,
            b'}' if depth == 1 => return &source[start..=at + offset],
            b'}' => depth -= 1,
            _ => {}
        }
    }
    panic!("{name} has no closing brace in kernels.cu")
}

/// The value of `#define name N` in `kernels.cu`.
#[cfg(test)]
fn kernel_define(name: &str) -> usize {
    super::kernels::SOURCE
        .lines()
        .find_map(|line| line.strip_prefix(&format!("#define {name} ")))
        .and_then(|value| value.trim().parse().ok())
        .unwrap_or_else(|| panic!("no numeric #define {name} in kernels.cu"))
}

/// A warp's lanes.
pub(super) const WARP: usize = 32;

/// `warp_sum`: each lane adds the lane `offset` away, for offsets 16, 8, 4, 2, 1; every lane
/// ends with the same total (lane 0's is returned).
pub(super) fn warp_sum(mut lanes: [f32; WARP]) -> f32 {
    let mut offset = WARP / 2;
    while offset > 0 {
        let before = lanes;
        for (lane, value) in lanes.iter_mut().enumerate() {
            *value = before[lane] + before[lane ^ offset];
        }
        offset /= 2;
    }
    lanes[0]
}

/// The attention heads: query heads, key/value heads, head width.
#[derive(Clone, Copy)]
pub(super) struct Heads(pub(super) usize, pub(super) usize, pub(super) usize);

impl Heads {
    /// Values per token of the fused QKV buffer.
    fn row_width(self) -> usize {
        (self.0 + 2 * self.1) * self.2
    }

    /// An output buffer for the tokens `cu` spans, filled with `fill`.
    fn output(self, cu: &[u32], fill: f32) -> Vec<f32> {
        vec![fill; *cu.last().unwrap_or(&0) as usize * self.0 * self.2]
    }
}

/// `attention_varlen` as the kernel computes it: one (tile, head) block at a time, one "warp"
/// per query, each score summed as its lanes sum it, keys in chunks of `KEYS` from the block's
/// oldest visible key, running max and sum; a key a query's `window` leaves out is skipped.
pub(super) fn kernel_attention(
    qkv: &[f32],
    cu: &[u32],
    heads: Heads,
    window: Option<usize>,
) -> Vec<f32> {
    let Heads(q_heads, kv_heads, head_dim) = heads;
    let row_width = heads.row_width();
    let mut out = heads.output(cu, f32::NAN);
    let mut tiles = Vec::new();
    attention_tiles(cu, QUERIES as u32, &mut tiles);
    let scale = 1.0 / (head_dim as f32).sqrt();
    for tile in tiles.chunks(2) {
        let (seq, first) = (tile[0] as usize, tile[1] as usize);
        for head in 0..q_heads {
            let kv_head = head / (q_heads / kv_heads);
            let start = cu[seq] as usize;
            let length = cu[seq + 1] as usize - start;
            let last_query = (first + QUERIES).min(length) - 1;
            let k_offset = q_heads * head_dim + kv_head * head_dim;
            let v_offset = (q_heads + kv_heads) * head_dim + kv_head * head_dim;
            for warp in 0..QUERIES {
                let query = first + warp;
                if query >= length {
                    continue;
                }
                let q: Vec<f32> = (0..head_dim)
                    .map(|d| qkv[(start + query) * row_width + head * head_dim + d] * scale)
                    .collect();
                let mut acc = vec![0.0f32; head_dim];
                let (mut running_max, mut running_sum) = (-3.0e38f32, 0.0f32);
                let mut key0 = window.map_or(0, |w| (first + 1).saturating_sub(w));
                while key0 <= last_query {
                    let keys = KEYS.min(last_query + 1 - key0);
                    let mut j = 0;
                    while j < keys && key0 + j <= query {
                        if window.is_some_and(|w| key0 + j + w <= query) {
                            j += 1;
                            continue;
                        }
                        let row = (start + key0 + j) * row_width;
                        // Lane `l` sums dimensions l, l + 32, ... (fused), then the butterfly.
                        let mut lanes = [0.0f32; WARP];
                        for (lane, sum) in lanes.iter_mut().enumerate() {
                            for d in (lane..head_dim).step_by(WARP) {
                                *sum = q[d].mul_add(qkv[row + k_offset + d], *sum);
                            }
                        }
                        let score = warp_sum(lanes);
                        let new_max = running_max.max(score);
                        let correction = (running_max - new_max).exp();
                        let weight = (score - new_max).exp();
                        running_sum = running_sum * correction + weight;
                        for d in 0..head_dim {
                            acc[d] = acc[d] * correction + weight * qkv[row + v_offset + d];
                        }
                        running_max = new_max;
                        j += 1;
                    }
                    key0 += KEYS;
                }
                let dst = (start + query) * q_heads * head_dim + head * head_dim;
                let inv = 1.0 / running_sum;
                for d in 0..head_dim {
                    out[dst + d] = acc[d] * inv;
                }
            }
        }
    }
    out
}

/// `attention_mma<D>` as the kernel computes it on bf16 inputs: blocks of `MMA_QUERIES`
/// queries in warps of 16, keys in shared tiles of `MMA_KEYS` up to the block's last query,
/// scores scaled into base 2 and masked (causal, the window, and past the sequence), tiles
/// wholly below a warp's window skipped, each tile's row max
/// folded into the running max, P rounded to bf16 for the P·V product and summed as rounded,
/// the output divided by the sum at the end. The products' summation order is the tensor
/// cores' own, so a replay agrees with the kernel to rounding, not to the bit.
pub(super) fn kernel_attention_mma(
    qkv: &[f32],
    cu: &[u32],
    heads: Heads,
    window: Option<usize>,
) -> Vec<f32> {
    let Heads(q_heads, kv_heads, head_dim) = heads;
    let row_width = heads.row_width();
    let round = |v: f32| f32::from_bits(u32::from(kernel_bf16(v)) << 16);
    let mut out = heads.output(cu, f32::NAN);
    let mut tiles = Vec::new();
    attention_tiles(cu, MMA_QUERIES as u32, &mut tiles);
    let scale_log2 = 1.0 / (head_dim as f32).sqrt() * std::f32::consts::LOG2_E;
    for tile in tiles.chunks(2) {
        let (seq, first) = (tile[0] as usize, tile[1] as usize);
        let start = cu[seq] as usize;
        let length = cu[seq + 1] as usize - start;
        let kv_end = (first + MMA_QUERIES).min(length);
        let kv_start = window.map_or(0, |w| (first + 1).saturating_sub(w)) / MMA_KEYS * MMA_KEYS;
        for head in 0..q_heads {
            let kv_head = head / (q_heads / kv_heads);
            let k_offset = q_heads * head_dim + kv_head * head_dim;
            let v_offset = (q_heads + kv_heads) * head_dim + kv_head * head_dim;
            for warp in 0..MMA_QUERIES / 16 {
                let q0 = first + warp * 16;
                if q0 >= length {
                    continue;
                }
                for query in (q0..q0 + 16).filter(|&q| q < length) {
                    let q = &qkv[(start + query) * row_width + head * head_dim..][..head_dim];
                    let mut o = vec![0.0f32; head_dim];
                    let (mut running_max, mut running_sum) = (f32::NEG_INFINITY, 0.0f32);
                    for kb in (kv_start..kv_end).step_by(MMA_KEYS) {
                        if kb > q0 + 15 || window.is_some_and(|w| kb + MMA_KEYS + w <= q0 + 1) {
                            continue;
                        }
                        let keys = kb..(kb + MMA_KEYS).min(kv_end);
                        let scores: Vec<f32> = keys
                            .clone()
                            .map(|key| {
                                if key > query || window.is_some_and(|w| key + w <= query) {
                                    return f32::NEG_INFINITY;
                                }
                                let k = &qkv[(start + key) * row_width + k_offset..][..head_dim];
                                q.iter().zip(k).map(|(a, b)| a * b).sum::<f32>() * scale_log2
                            })
                            .collect();
                        let tile_max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                        let new_max = running_max.max(tile_max);
                        let correction = if new_max == f32::NEG_INFINITY {
                            1.0
                        } else {
                            (running_max - new_max).exp2()
                        };
                        running_max = new_max;
                        running_sum *= correction;
                        o.iter_mut().for_each(|v| *v *= correction);
                        for (key, score) in keys.zip(scores) {
                            let p = if running_max == f32::NEG_INFINITY {
                                0.0
                            } else {
                                round((score - running_max).exp2())
                            };
                            running_sum += p;
                            let v = &qkv[(start + key) * row_width + v_offset..][..head_dim];
                            o.iter_mut()
                                .zip(v)
                                .for_each(|(acc, value)| *acc += p * value);
                        }
                    }
                    let dst = (start + query) * q_heads * head_dim + head * head_dim;
                    let inv = 1.0 / running_sum;
                    for d in 0..head_dim {
                        out[dst + d] = round(o[d] * inv);
                    }
                }
            }
        }
    }
    out
}

/// Causal GQA attention the plain way: softmax(q·kᵀ / √d) · v over each sequence's past, or
/// its last `window` positions.
#[cfg(test)]
fn reference_attention(qkv: &[f32], cu: &[u32], heads: Heads, window: Option<usize>) -> Vec<f32> {
    let Heads(q_heads, kv_heads, head_dim) = heads;
    let row_width = heads.row_width();
    let mut out = heads.output(cu, 0.0);
    for bounds in cu.windows(2) {
        let (start, end) = (bounds[0] as usize, bounds[1] as usize);
        for t in start..end {
            let oldest = window.map_or(start, |w| (t + 1).saturating_sub(w).max(start));
            for head in 0..q_heads {
                let kv = head / (q_heads / kv_heads);
                let q = &qkv[t * row_width + head * head_dim..][..head_dim];
                let scores: Vec<f64> = (oldest..=t)
                    .map(|s| {
                        let k = &qkv[s * row_width + (q_heads + kv) * head_dim..][..head_dim];
                        let dot: f64 = q.iter().zip(k).map(|(a, b)| f64::from(a * b)).sum();
                        dot / (head_dim as f64).sqrt()
                    })
                    .collect();
                let max = scores.iter().copied().fold(f64::MIN, f64::max);
                let weights: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                let total: f64 = weights.iter().sum();
                for d in 0..head_dim {
                    let value: f64 = (oldest..=t)
                        .zip(&weights)
                        .map(|(s, w)| {
                            w * f64::from(
                                qkv[s * row_width + (q_heads + kv_heads + kv) * head_dim + d],
                            )
                        })
                        .sum();
                    out[t * q_heads * head_dim + head * head_dim + d] = (value / total) as f32;
                }
            }
        }
    }
    out
}

/// `f32_to_bf16` of `kernels.cu`, bit for bit.
pub(super) fn kernel_bf16(value: f32) -> u16 {
    let mut u = value.to_bits();
    if (u & 0x7fff_ffff) > 0x7f80_0000 {
        return 0x7fc0;
    }
    u = u.wrapping_add(0x7fff + ((u >> 16) & 1));
    (u >> 16) as u16
}

#[test]
fn the_replayed_kernels_are_the_ones_in_kernels_cu() {
    use sha2::{Digest, Sha256};
    assert_eq!(kernel_define("QUERIES"), QUERIES);
    assert_eq!(kernel_define("KEYS"), KEYS);
    assert_eq!(kernel_define("MMA_QUERIES"), MMA_QUERIES);
    assert_eq!(kernel_define("MMA_KEYS"), MMA_KEYS);
    assert_eq!(
        MMA_QUERIES,
        super::kernels::ATTENTION_MMA_QUERIES_PER_BLOCK as usize
    );
    assert_eq!(
        kernel_define("QUERIES"),
        super::kernels::ATTENTION_QUERIES_PER_BLOCK as usize
    );
    assert_eq!(
        kernel_define("MAX_HEAD_DIM"),
        super::kernels::ATTENTION_MAX_HEAD_DIM
    );
    for (name, pinned) in MIRRORED {
        let text = kernel_function(name);
        let collapsed = text.split_whitespace().collect::<Vec<_>>().join(" ");
        let digest: String = Sha256::digest(collapsed.as_bytes())
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        assert_eq!(
            digest, pinned,
            "{name} in kernels.cu changed: bring its replay (emulation.rs, replay.rs) in line, then pin the new digest"
        );
    }
}

#[test]
fn the_attention_kernels_tiles_and_online_softmax_equal_plain_causal_gqa_with_or_without_a_window()
{
    // Sequences shorter than a tile, spanning several tiles and several key chunks; heads
    // narrower than a warp, odd multiples of it and the widest; windows of one key, of less
    // than a key chunk and of more than one.
    let cu = [0u32, 5, 22, 23, 63, 133];
    for heads in [
        Heads(4, 2, 64),
        Heads(2, 2, 16),
        Heads(2, 1, 96),
        Heads(2, 1, 256),
    ] {
        let row_width = heads.row_width();
        let mut state = 11u64;
        let qkv: Vec<f32> = (0..133 * row_width)
            .map(|_| {
                state = state
                    .wrapping_mul(6_364_136_223_846_793_005)
                    .wrapping_add(1_442_695_040_888_963_407);
                ((state >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 2.0
            })
            .collect();
        for window in [None, Some(1), Some(21), Some(45)] {
            let kernel = kernel_attention(&qkv, &cu, heads, window);
            let reference = reference_attention(&qkv, &cu, heads, window);
            let worst = kernel
                .iter()
                .zip(&reference)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0f32, f32::max);
            assert!(
                worst < 1e-5,
                "head width {}, window {window:?}: worst difference {worst}",
                heads.2
            );
            assert!(
                kernel.iter().all(|v| v.is_finite()),
                "every query was written"
            );
        }
    }
}

#[test]
fn the_tensor_core_attention_replay_equals_plain_causal_gqa_to_bf16_rounding() {
    // Sequences shorter than a warp's 16 queries, spanning several blocks of 64 and several
    // key tiles, and one of a single token; inputs in bf16, as the kernel reads them.
    // Windows of one key, and of less and more than a key tile (so whole tiles are skipped).
    let cu = [0u32, 5, 75, 76, 216];
    for (heads, window) in [
        (Heads(4, 2, 64), None),
        (Heads(2, 1, 128), None),
        (Heads(4, 2, 64), Some(1)),
        (Heads(4, 2, 64), Some(40)),
        (Heads(2, 1, 128), Some(70)),
    ] {
        let row_width = heads.row_width();
        let mut state = 17u64;
        let qkv: Vec<f32> = (0..216 * row_width)
            .map(|_| {
                state = state
                    .wrapping_mul(6_364_136_223_846_793_005)
                    .wrapping_add(1_442_695_040_888_963_407);
                let value = ((state >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 2.0;
                f32::from_bits(u32::from(kernel_bf16(value)) << 16)
            })
            .collect();
        let kernel = kernel_attention_mma(&qkv, &cu, heads, window);
        let reference = reference_attention(&qkv, &cu, heads, window);
        assert!(
            kernel.iter().all(|v| v.is_finite()),
            "every query was written"
        );
        // Per output row: P and the output rounded to bf16 (2^-9 relative each).
        let width = heads.2;
        let worst = kernel
            .chunks(width)
            .zip(reference.chunks(width))
            .map(|(a, b)| {
                let diff: f32 = a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum();
                let norm: f32 = b.iter().map(|y| y * y).sum();
                (diff / norm.max(1e-30)).sqrt()
            })
            .fold(0.0f32, f32::max);
        assert!(
            worst < 1e-2,
            "head width {}, window {window:?}: worst relative row error {worst}",
            heads.2
        );
    }
}

#[test]
fn the_kernels_bf16_rounding_is_round_to_nearest_even_like_the_half_crate() {
    let mut state = 5u64;
    let mut values = vec![
        0.0f32,
        -0.0,
        1.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::MAX,
        1e-40,
    ];
    // Exact ties between two bf16 values, both ways.
    values.extend([f32::from_bits(0x3f80_8000), f32::from_bits(0x3f81_8000)]);
    for _ in 0..100_000 {
        state = state
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        values.push(f32::from_bits((state >> 32) as u32));
    }
    for value in values {
        let expected = half::bf16::from_f32(value);
        if value.is_nan() {
            assert!(half::bf16::from_bits(kernel_bf16(value)).is_nan());
        } else {
            assert_eq!(kernel_bf16(value), expected.to_bits(), "{value:e}");
        }
    }
}
