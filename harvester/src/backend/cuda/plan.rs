//! Host-side plans for the CUDA backend, pure and unit-tested here: the attention kernel's work
//! list over a packed batch, and how much device memory a batch's activations take (how a
//! model's blocks split into pipeline stages is `backend::stages`).

use super::kernels::{ATTENTION_MAX_HEAD_DIM, ATTENTION_MMA_HEAD_DIMS};
use crate::error::{CudaError, Result};

/// The attention kernel's blocks for a packed batch: `(sequence, first query)` pairs, each
/// covering up to `queries_per_block` queries of one sequence (8 for the CUDA-core kernel, 64
/// on tensor cores), flattened
/// as the kernel reads them.
pub fn attention_tiles(cu_seq_lengths: &[u32], queries_per_block: u32, tiles: &mut Vec<u32>) {
    tiles.clear();
    for (seq, bounds) in cu_seq_lengths.windows(2).enumerate() {
        let length = bounds[1] - bounds[0];
        let mut first = 0;
        while first < length {
            tiles.extend([seq as u32, first]);
            first += queries_per_block;
        }
    }
}

/// The environment variable that forces the CUDA-core attention kernel (`simple`).
pub const ATTENTION_VARIABLE: &str = "HARVEST_CUDA_ATTENTION";

/// Whether attention of width `head_dim` runs on tensor cores: when the width has a
/// tensor-core kernel and `forced` (the value of [`ATTENTION_VARIABLE`]) is not `simple`.
pub fn uses_tensor_cores(head_dim: usize, forced: Option<&str>) -> bool {
    ATTENTION_MMA_HEAD_DIMS.contains(&head_dim) && forced.map(str::trim) != Some("simple")
}

/// Checks the head shape the attention kernel supports.
pub fn check_heads(q_heads: usize, kv_heads: usize, head_dim: usize) -> Result<()> {
    let reason = if head_dim == 0
        || !head_dim.is_multiple_of(2)
        || head_dim > ATTENTION_MAX_HEAD_DIM
    {
        format!(
            "head_dim {head_dim} (its attention kernel takes even widths up to {ATTENTION_MAX_HEAD_DIM})"
        )
    } else if kv_heads == 0 || !q_heads.is_multiple_of(kv_heads) {
        format!("{q_heads} query heads over {kv_heads} key/value heads (they must group evenly)")
    } else {
        return Ok(());
    };
    Err(CudaError::Unsupported { reason }.into())
}

/// Refuses a batch of `tokens` that needs `needed` device bytes when `free` of `total` are
/// free, keeping a tenth of what is free for cuBLAS's workspace and the allocator's rounding.
pub fn check_fits(tokens: usize, needed: u64, free: u64, total: u64) -> Result<()> {
    if needed > free - free / 10 {
        return Err(CudaError::DoesNotFit {
            tokens,
            needed,
            free,
            total,
        }
        .into());
    }
    Ok(())
}

/// The shape that sizes a batch's activations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shape {
    /// Residual width.
    pub hidden: usize,
    /// MLP width.
    pub intermediate: usize,
    /// Query heads.
    pub q_heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Width of a head.
    pub head_dim: usize,
}

impl Shape {
    /// Device bytes of the activations of a batch of `tokens`, reused by every block: the f32
    /// residual and the f32 GEMM output added to it, and the normed input, fused QKV, attention
    /// output, fused gate/up and SwiGLU output in the mode's `value_bytes` (2 for bf16, 4 for
    /// f32).
    pub fn activation_bytes(&self, tokens: usize, value_bytes: usize) -> u64 {
        let qkv = (self.q_heads + 2 * self.kv_heads) * self.head_dim;
        let per_token = 4 * self.hidden * 2
            + value_bytes
                * (self.hidden + qkv + self.q_heads * self.head_dim + 3 * self.intermediate);
        (per_token * tokens) as u64
    }

    /// The most bf16-mode tokens a batch may hold within `free_bytes` after the captured rows
    /// (`capture_bytes_per_token`, f32, all kept layers) are set aside.
    pub fn max_tokens(&self, free_bytes: u64, capture_bytes_per_token: u64) -> usize {
        let per_token = self.activation_bytes(1, 2) + capture_bytes_per_token;
        usize::try_from(free_bytes / per_token.max(1)).unwrap_or(usize::MAX)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cuda::kernels::{
        ATTENTION_MMA_QUERIES_PER_BLOCK, ATTENTION_QUERIES_PER_BLOCK,
    };

    #[test]
    fn tiles_cover_every_query_of_every_sequence_once() {
        let mut tiles = Vec::new();
        attention_tiles(&[0, 3, 20, 21], ATTENTION_QUERIES_PER_BLOCK, &mut tiles);
        // 3 queries: one tile; 17 queries: three tiles (0, 8, 16); 1 query: one tile.
        assert_eq!(tiles, [0, 0, 1, 0, 1, 8, 1, 16, 2, 0]);
        let covered: u32 = tiles
            .chunks(2)
            .map(|t| {
                let length = [3, 17, 1][t[0] as usize];
                (length - t[1]).min(ATTENTION_QUERIES_PER_BLOCK)
            })
            .sum();
        assert_eq!(covered, 21);
    }

    #[test]
    fn tensor_core_tiles_hold_sixty_four_queries_each() {
        let mut tiles = Vec::new();
        attention_tiles(
            &[0, 64, 65, 200],
            ATTENTION_MMA_QUERIES_PER_BLOCK,
            &mut tiles,
        );
        assert_eq!(tiles, [0, 0, 1, 0, 2, 0, 2, 64, 2, 128]);
        assert!(uses_tensor_cores(128, None) && uses_tensor_cores(64, Some("")));
        assert!(
            !uses_tensor_cores(96, None),
            "96 is not a tensor-core width yet"
        );
        assert!(!uses_tensor_cores(128, Some("simple")));
    }

    #[test]
    fn head_shapes_outside_the_kernel_are_refused_by_value() {
        check_heads(32, 8, 128).unwrap();
        check_heads(9, 3, 64).unwrap();
        // Narrower than a warp, or not a multiple of 32: some lanes own no dimension.
        check_heads(4, 2, 16).unwrap();
        check_heads(4, 2, 80).unwrap();
        let odd = check_heads(4, 2, 15).unwrap_err().to_string();
        assert!(odd.contains("head_dim 15") && odd.contains("even"), "{odd}");
        // Up to Gemma's 256 on the CUDA-core kernel.
        check_heads(8, 4, 256).unwrap();
        let wide = check_heads(32, 8, 288).unwrap_err().to_string();
        assert!(
            wide.contains("head_dim 288") && wide.contains("up to 256"),
            "{wide}"
        );
        assert!(check_heads(10, 4, 64).is_err());
    }

    #[test]
    fn a_batch_larger_than_the_free_memory_is_refused_naming_the_bytes() {
        check_fits(4096, 900, 1000, 2000).unwrap();
        let error = check_fits(8192, 950, 1000, 2000).unwrap_err().to_string();
        assert!(
            error.contains("8192 tokens")
                && error.contains("950 bytes")
                && error.contains("1000 of the device's 2000"),
            "{error}"
        );
        assert_eq!(
            crate::Error::from(CudaError::DoesNotFit {
                tokens: 1,
                needed: 2,
                free: 1,
                total: 2
            })
            .kind(),
            harvest_core::worker::ErrorKind::BadInput
        );
    }

    #[test]
    fn activation_memory_of_an_8b_shape_batch_is_what_the_buffers_add_up_to() {
        let llama_8b = Shape {
            hidden: 4096,
            intermediate: 14336,
            q_heads: 32,
            kv_heads: 8,
            head_dim: 128,
        };
        // Per token: 2 f32 hidden rows (32 KiB), bf16 normed 8 KiB, QKV 12 KiB, attention out
        // 8 KiB, gate/up and SwiGLU 84 KiB.
        assert_eq!(
            llama_8b.activation_bytes(1, 2),
            32_768 + 8_192 + 12_288 + 8_192 + 86_016
        );
        // The f32 mode doubles all but the two f32 rows.
        assert_eq!(
            llama_8b.activation_bytes(1, 4),
            32_768 + 2 * (8_192 + 12_288 + 8_192 + 86_016)
        );
        let capture = 3 * 4096 * 4;
        let tokens = llama_8b.max_tokens(8 << 30, capture as u64);
        assert!(
            llama_8b.activation_bytes(tokens, 2) + (capture * tokens) as u64 <= 8 << 30,
            "{tokens}"
        );
        assert!(
            tokens > 40_000,
            "8 GiB holds a batch of several thousand tokens: {tokens}"
        );
    }
}
