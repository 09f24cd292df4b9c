//! Causal grouped-query attention over a packed varlen batch, tiled over queries so that no
//! `[n, n]` score matrix ever exists: a tile holds at most `QUERY_TILE × sequence length` scores.
//!
//! Each layer first lays every key head out once for all the queries that read it: as bf16
//! panels for the `vdpbf16ps` product when the caller hands Q and K as bf16 bits (bf16 mode),
//! else transposed, `[kv head][dim][token]`, so that `Q·Kᵀ` reads both operands in place.
//! `P·V` always runs in f32 on V where it lies. Each score and output is one sum in an order
//! fixed by the head width or the keys alone, so a prompt's attention does not depend on the
//! batch it is in or the thread count.

use rayon::prelude::*;

use super::bf16::{self, Bf16View};
use super::matmul::MatRef;
use super::{in_place, kernels};
use crate::backend::Batch;

/// Queries per tile. Small enough that a tile's scores stay in cache for typical prompts, large
/// enough that each key read serves many queries.
pub const QUERY_TILE: usize = 64;

/// Queries whose scores are summed together up to the last key the last of them sees: a
/// multiple of the register blocks' heights (8 rows with AVX-512 and bf16).
const CAUSAL_RUN: usize = 16;

// A tile's first key, rounded down to a whole panel, is where its keys' panels start.
const _: () = assert!(QUERY_TILE.is_multiple_of(bf16::PANEL));

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

impl AttentionShape {
    fn width(&self) -> usize {
        (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
    }
}

/// The keys as laid out for one layer, kept across layers so steady state allocates nothing.
#[derive(Debug, Default)]
pub struct KeyScratch {
    /// f32 scores: `[kv head][dim][token]`.
    transposed: Vec<f32>,
    /// bf16 scores: per sequence, per kv head, its keys' panels (see [`bf16::pack_rows`]).
    panels: Vec<u32>,
}

#[derive(Debug, Clone, Copy)]
struct Tile {
    sequence: usize,
    seq_start: usize,
    seq_len: usize,
    start: usize,
    end: usize,
}

/// The keys of every sequence and kv head, as a tile reads them.
#[derive(Clone, Copy)]
enum Keys<'a> {
    /// `[kv head][dim][token]` over the batch's `tokens`.
    Transposed { data: &'a [f32], tokens: usize },
    /// Q and K as bf16 bits, and each sequence's panels from `starts[sequence]`, kv head by kv
    /// head.
    Panels {
        bits: &'a [u16],
        panels: &'a [u32],
        starts: &'a [usize],
    },
}

/// Computes softmax(Q Kᵀ / √d) V per sequence and head, writing `[tokens, heads × head_dim]` rows
/// into `out`. `qkv` holds `[tokens, (heads + 2 kv_heads) × head_dim]` rows with RoPE applied;
/// `qk_bits`, the same rows as bf16 bits (bf16 mode on a CPU with `vdpbf16ps`), makes `Q·Kᵀ`
/// a bf16 product. Given `out_bits`, each tile also rounds its output rows to bf16 bits there
/// while they are in cache: the input of the output projection in bf16 mode.
pub fn attention(
    qkv: &[f32],
    qk_bits: Option<&[u16]>,
    batch: &Batch,
    shape: AttentionShape,
    scratch: &mut KeyScratch,
    (out, out_bits): (&mut [f32], Option<&mut [u16]>),
) {
    let tiles: Vec<Tile> = (0..batch.num_sequences())
        .flat_map(|sequence| {
            let range = batch.sequence(sequence);
            (range.start..range.end)
                .step_by(QUERY_TILE)
                .map(move |start| Tile {
                    sequence,
                    seq_start: range.start,
                    seq_len: range.len(),
                    start,
                    end: (start + QUERY_TILE).min(range.end),
                })
        })
        .collect();
    let out_width = shape.num_heads * shape.head_dim;
    let mut chunks = Vec::with_capacity(tiles.len());
    let mut rest = &mut out[..batch.num_tokens() * out_width];
    let mut rest_bits = out_bits.map(|b| &mut b[..batch.num_tokens() * out_width]);
    for tile in &tiles {
        let len = (tile.end - tile.start) * out_width;
        let (head, tail) = rest.split_at_mut(len);
        let bits = rest_bits.take().map(|b| {
            let (head, tail) = b.split_at_mut(len);
            rest_bits = Some(tail);
            head
        });
        chunks.push((head, bits));
        rest = tail;
    }
    let qk_bits = qk_bits.filter(|_| scores_from_bits(shape));
    let starts: Vec<usize>;
    let keys = match qk_bits {
        Some(bits) => {
            starts = pack_keys(bits, batch, shape, &mut scratch.panels);
            Keys::Panels {
                bits,
                panels: &scratch.panels,
                starts: &starts,
            }
        }
        None => {
            transpose_keys(qkv, batch.num_tokens(), shape, &mut scratch.transposed);
            Keys::Transposed {
                data: &scratch.transposed,
                tokens: batch.num_tokens(),
            }
        }
    };
    tiles
        .par_iter()
        .zip(chunks)
        .for_each_init(Vec::new, |scores, (tile, (out_rows, bits))| {
            attend_tile(qkv, keys, shape, *tile, scores, out_rows);
            if let Some(bits) = bits {
                kernels::bf16_bits_rows(out_rows, bits);
            }
        });
}

/// Whether [`attention`] takes its scores from the bits it is handed (else from the f32 rows):
/// the kernel level allows `vdpbf16ps`, and the packed product reads each pair of Q as one
/// 32-bit word, in one block of `k`. [`attention`] asks this itself, so bits handed to it on a
/// CPU without the instruction are ignored rather than reaching the packed product.
pub fn scores_from_bits(shape: AttentionShape) -> bool {
    bf16::has_dot_instructions()
        && shape.head_dim.is_multiple_of(2)
        && shape.width().is_multiple_of(2)
        && shape.head_dim <= bf16::KC
}

/// Each sequence's key heads as bf16 panels into `panels`; returns where each sequence's
/// panels start.
fn pack_keys(
    bits: &[u16],
    batch: &Batch,
    shape: AttentionShape,
    panels: &mut Vec<u32>,
) -> Vec<usize> {
    let (heads, kv_heads, head_dim) = (shape.num_heads, shape.num_kv_heads, shape.head_dim);
    let panel_len = bf16::panel_len(head_dim);
    let per_head =
        |sequence: usize| batch.sequence(sequence).len().div_ceil(bf16::PANEL) * panel_len;
    let mut starts = Vec::with_capacity(batch.num_sequences());
    let mut total = 0;
    for sequence in 0..batch.num_sequences() {
        starts.push(total);
        total += kv_heads * per_head(sequence);
    }
    panels.resize(total, 0);
    let mut jobs = Vec::with_capacity(batch.num_sequences() * kv_heads);
    let mut rest = &mut panels[..];
    for sequence in 0..batch.num_sequences() {
        for kv_head in 0..kv_heads {
            let (dst, tail) = rest.split_at_mut(per_head(sequence));
            jobs.push((sequence, kv_head, dst));
            rest = tail;
        }
    }
    let width = shape.width();
    jobs.into_par_iter().for_each(|(sequence, kv_head, dst)| {
        let range = batch.sequence(sequence);
        let keys = Bf16View {
            bits: &bits[range.start * width + (heads + kv_head) * head_dim..],
            rows: range.len(),
            cols: head_dim,
            stride: width,
        };
        bf16::pack_rows(keys, dst);
    });
    starts
}

/// The key heads of all `tokens`, transposed: `[kv head][dim][token]`.
fn transpose_keys(qkv: &[f32], tokens: usize, shape: AttentionShape, dst: &mut Vec<f32>) {
    let (heads, kv_heads, head_dim) = (shape.num_heads, shape.num_kv_heads, shape.head_dim);
    let width = shape.width();
    dst.resize(kv_heads * head_dim * tokens, 0.0);
    if tokens == 0 {
        return;
    }
    dst.par_chunks_mut(tokens)
        .enumerate()
        .for_each(|(row, dst)| {
            let column = heads * head_dim + row;
            for (t, cell) in dst.iter_mut().enumerate() {
                *cell = qkv[t * width + column];
            }
        });
}

fn attend_tile(
    qkv: &[f32],
    keys: Keys<'_>,
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
    let width = shape.width();
    let group = num_heads / num_kv_heads;
    let scale = 1.0 / (head_dim as f32).sqrt();
    let (first_query, end_query) = (tile.start - tile.seq_start, tile.end - tile.seq_start);
    // From a whole panel on: a window's earlier keys are masked below like later ones.
    let lowest_key = window.map_or(0, |w| (first_query + 1).saturating_sub(w));
    let lowest_key = lowest_key - lowest_key % bf16::PANEL;
    let (queries, key_count) = (end_query - first_query, end_query - lowest_key);
    scores.resize(queries * key_count, 0.0);
    let out_width = num_heads * head_dim;
    for head in 0..num_heads {
        let kv_head = head / group;
        // Runs of queries, each summing only up to the last key its last query sees: past the
        // diagonal the scores would all be masked.
        for run in (0..queries).step_by(CAUSAL_RUN) {
            let rows = CAUSAL_RUN.min(queries - run);
            let seen = first_query + run + rows - lowest_key;
            let q_at = (tile.start + run) * width + head * head_dim;
            let scores = &mut scores[run * key_count..];
            match keys {
                Keys::Panels {
                    bits,
                    panels,
                    starts,
                } => {
                    let queries = Bf16View {
                        bits: &bits[q_at..],
                        rows,
                        cols: head_dim,
                        stride: width,
                    };
                    let panels_per_head = tile.seq_len.div_ceil(bf16::PANEL);
                    let from = starts[tile.sequence]
                        + (kv_head * panels_per_head + lowest_key / bf16::PANEL)
                            * bf16::panel_len(head_dim);
                    bf16::product_packed(queries, &panels[from..], seen, scores, key_count);
                }
                Keys::Transposed { data, tokens } => {
                    let queries = MatRef {
                        data: &qkv[q_at..],
                        rows,
                        cols: head_dim,
                        row_stride: width,
                    };
                    let columns = MatRef {
                        data: &data[kv_head * head_dim * tokens + tile.seq_start + lowest_key..],
                        rows: head_dim,
                        cols: seen,
                        row_stride: tokens,
                    };
                    in_place::product(queries, columns, scores, key_count);
                }
            }
            for (r, row) in scores.chunks_exact_mut(key_count).take(rows).enumerate() {
                let query = first_query + run + r;
                let first_visible =
                    window.map_or(0, |w| (query + 1).saturating_sub(w)) - lowest_key;
                let last_visible = query - lowest_key;
                row[..first_visible].fill(0.0);
                row[last_visible + 1..seen].fill(0.0);
                kernels::softmax_in_place(&mut row[first_visible..=last_visible], scale);
            }
            let values = MatRef {
                data: &qkv[(tile.seq_start + lowest_key) * width
                    + (num_heads + num_kv_heads + kv_head) * head_dim..],
                rows: seen,
                cols: head_dim,
                row_stride: width,
            };
            let probabilities = MatRef {
                data: scores,
                rows,
                cols: seen,
                row_stride: key_count,
            };
            let out = &mut out[run * out_width + head * head_dim..];
            in_place::product(probabilities, values, out, out_width);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SHAPE: AttentionShape = AttentionShape {
        num_heads: 4,
        num_kv_heads: 2,
        head_dim: 18,
        window: None,
    };

    /// Fused Q|K|V rows of bf16 values (so both paths read the same inputs), and their bits.
    fn rows(tokens: usize, shape: AttentionShape, seed: f32) -> (Vec<f32>, Vec<u16>) {
        let width = (shape.num_heads + 2 * shape.num_kv_heads) * shape.head_dim;
        let values: Vec<f32> = (0..tokens * width)
            .map(|i| crate::dtype::round_bf16((i as f32 * seed).sin() * 2.5))
            .collect();
        let bits = values.iter().map(|&v| bf16::to_bf16_bits(v)).collect();
        (values, bits)
    }

    /// softmax(q·k / √d) v in float64, one query at a time.
    fn reference(qkv: &[f32], lengths: &[usize], shape: AttentionShape) -> Vec<f64> {
        let AttentionShape {
            num_heads: heads,
            num_kv_heads: kv_heads,
            head_dim: d,
            window,
        } = shape;
        let width = (heads + 2 * kv_heads) * d;
        let at = |t: usize, i: usize| f64::from(qkv[t * width + i]);
        let mut out = Vec::new();
        let mut start = 0;
        for &length in lengths {
            for query in 0..length {
                for head in 0..heads {
                    let kv = head / (heads / kv_heads);
                    let first = window.map_or(0, |w| (query + 1).saturating_sub(w));
                    let scores: Vec<f64> = (first..=query)
                        .map(|key| {
                            let dot: f64 = (0..d)
                                .map(|i| {
                                    at(start + query, head * d + i)
                                        * at(start + key, (heads + kv) * d + i)
                                })
                                .sum();
                            dot / (d as f64).sqrt()
                        })
                        .collect();
                    let max = scores.iter().cloned().fold(f64::MIN, f64::max);
                    let weights: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                    let total: f64 = weights.iter().sum();
                    for i in 0..d {
                        let value: f64 = (first..=query)
                            .zip(&weights)
                            .map(|(key, w)| w * at(start + key, (heads + kv_heads + kv) * d + i))
                            .sum();
                        out.push(value / total);
                    }
                }
            }
            start += length;
        }
        out
    }

    fn run(
        qkv: &[f32],
        bits: Option<&[u16]>,
        lengths: &[usize],
        shape: AttentionShape,
    ) -> Vec<f32> {
        let sequences: Vec<Vec<u32>> = lengths.iter().map(|&n| vec![0; n]).collect();
        let batch = Batch::from_sequences(&sequences);
        let mut out = vec![f32::NAN; batch.num_tokens() * shape.num_heads * shape.head_dim];
        let mut out_bits = vec![0; out.len()];
        let mut keys = KeyScratch::default();
        attention(
            qkv,
            bits,
            &batch,
            shape,
            &mut keys,
            (&mut out, Some(&mut out_bits)),
        );
        let rounded: Vec<u16> = out.iter().map(|&v| bf16::to_bf16_bits(v)).collect();
        assert!(
            out_bits == rounded,
            "the output's bits are its values rounded"
        );
        out
    }

    #[test]
    fn both_score_products_match_a_float64_attention_over_ragged_sequences_and_a_window() {
        // Sequences shorter than, equal to and over a tile; odd head width; a window that
        // cuts inside the tiles.
        let lengths = [3, QUERY_TILE, 2 * QUERY_TILE + 9, 1];
        let tokens = lengths.iter().sum();
        let (qkv, bits) = rows(tokens, SHAPE, 0.37);
        for window in [None, Some(21)] {
            let shape = AttentionShape { window, ..SHAPE };
            let expected = reference(&qkv, &lengths, shape);
            for (name, bits) in [("f32", None), ("bf16", Some(&bits[..]))] {
                let got = run(&qkv, bits, &lengths, shape);
                for (i, (&got, &want)) in got.iter().zip(&expected).enumerate() {
                    assert!(
                        (f64::from(got) - want).abs() <= 1e-5 * (1.0 + want.abs()),
                        "{name} scores, window {window:?}, value {i}: {got} vs {want}"
                    );
                }
            }
        }
    }

    #[test]
    fn a_sequence_gives_the_same_bits_alone_as_in_a_batch_on_any_thread_count() {
        let lengths = [QUERY_TILE + 5, 2 * QUERY_TILE + 30, 7];
        let tokens: usize = lengths.iter().sum();
        let shape = AttentionShape {
            head_dim: 64,
            ..SHAPE
        };
        let (qkv, bits) = rows(tokens, shape, 0.11);
        let width = (shape.num_heads + 2 * shape.num_kv_heads) * shape.head_dim;
        let out_width = shape.num_heads * shape.head_dim;
        for bits in [None, Some(&bits[..])] {
            let on = |threads: usize| {
                let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build();
                pool.unwrap().install(|| run(&qkv, bits, &lengths, shape))
            };
            let all = on(2);
            assert_eq!(on(1), all, "one thread or two");
            let (from, to) = (lengths[0], lengths[0] + lengths[1]);
            let alone = run(
                &qkv[from * width..to * width],
                bits.map(|b| &b[from * width..to * width]),
                &lengths[1..2],
                shape,
            );
            assert_eq!(alone, all[from * out_width..to * out_width]);
        }
    }
}
