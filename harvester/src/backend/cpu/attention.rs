//! Causal grouped-query attention over a packed varlen batch, tiled over queries so that no
//! `[n, n]` score matrix ever exists: a tile holds at most `QUERY_TILE × sequence length` scores.

use gemm::Parallelism;
use rayon::prelude::*;

use super::kernels;
use super::matmul::{MatRef, matmul, matmul_transposed};
use crate::backend::Batch;

/// Queries per tile. Small enough that a tile's scores stay in cache for typical prompts, large
/// enough to give gemm real matrices.
pub const QUERY_TILE: usize = 64;

/// The head layout of the fused Q|K|V rows.
#[derive(Debug, Clone, Copy)]
pub struct AttentionShape {
    /// Query heads.
    pub num_heads: usize,
    /// Key/value heads.
    pub num_kv_heads: usize,
    /// Head width.
    pub head_dim: usize,
    /// Keys more than this many positions back are masked.
    pub window: Option<usize>,
}

#[derive(Debug, Clone, Copy)]
struct Tile {
    seq_start: usize,
    start: usize,
    end: usize,
}

/// Computes softmax(Q Kᵀ / √d) V per sequence and head, writing `[tokens, heads × head_dim]` rows
/// into `out`. `qkv` holds `[tokens, (heads + 2 kv_heads) × head_dim]` rows with RoPE applied.
pub fn attention(qkv: &[f32], batch: &Batch, shape: AttentionShape, out: &mut [f32]) {
    let tiles: Vec<Tile> = (0..batch.num_sequences())
        .flat_map(|s| {
            let range = batch.sequence(s);
            (range.start..range.end)
                .step_by(QUERY_TILE)
                .map(move |start| Tile {
                    seq_start: range.start,
                    start,
                    end: (start + QUERY_TILE).min(range.end),
                })
        })
        .collect();
    let out_width = shape.num_heads * shape.head_dim;
    let mut chunks = Vec::with_capacity(tiles.len());
    let mut rest = &mut out[..batch.num_tokens() * out_width];
    for tile in &tiles {
        let (head, tail) = rest.split_at_mut((tile.end - tile.start) * out_width);
        chunks.push(head);
        rest = tail;
    }
    tiles
        .par_iter()
        .zip(chunks)
        .for_each_init(Vec::new, |scores, (tile, out_rows)| {
            attend_tile(qkv, shape, *tile, scores, out_rows);
        });
}

fn attend_tile(
    qkv: &[f32],
    shape: AttentionShape,
    tile: Tile,
    scores: &mut Vec<f32>,
    out: &mut [f32],
) {
    let AttentionShape {
        num_heads,
        num_kv_heads,
        head_dim,
        window,
    } = shape;
    let width = (num_heads + 2 * num_kv_heads) * head_dim;
    let group = num_heads / num_kv_heads;
    let scale = 1.0 / (head_dim as f32).sqrt();
    let (first_query, end_query) = (tile.start - tile.seq_start, tile.end - tile.seq_start);
    let lowest_key = window.map_or(0, |w| (first_query + 1).saturating_sub(w));
    let (rows, keys) = (end_query - first_query, end_query - lowest_key);
    scores.resize(rows * keys, 0.0);
    let key_row = (tile.seq_start + lowest_key) * width;
    for head in 0..num_heads {
        let kv_head = head / group;
        let q = MatRef {
            data: &qkv[tile.start * width + head * head_dim..],
            rows,
            cols: head_dim,
            row_stride: width,
        };
        let k = MatRef {
            data: &qkv[key_row + (num_heads + kv_head) * head_dim..],
            rows: keys,
            cols: head_dim,
            row_stride: width,
        };
        matmul_transposed(q, k, scores, keys, scale, false, Parallelism::None);
        for (r, row) in scores.chunks_exact_mut(keys).enumerate() {
            let query = first_query + r;
            let first_visible = window.map_or(0, |w| (query + 1).saturating_sub(w)) - lowest_key;
            let last_visible = query - lowest_key;
            row[..first_visible].fill(0.0);
            row[last_visible + 1..].fill(0.0);
            kernels::softmax_in_place(&mut row[first_visible..=last_visible]);
        }
        let v = MatRef {
            data: &qkv[key_row + (num_heads + num_kv_heads + kv_head) * head_dim..],
            rows: keys,
            cols: head_dim,
            row_stride: width,
        };
        let out_width = num_heads * head_dim;
        matmul(
            MatRef::dense(scores, rows, keys),
            v,
            &mut out[head * head_dim..],
            out_width,
            Parallelism::None,
        );
    }
}
