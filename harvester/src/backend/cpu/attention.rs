//! Causal grouped-query attention over a packed varlen batch, tiled over queries so that no
//! `[n, n]` score matrix ever exists: a tile holds at most `QUERY_TILE × sequence length` scores.
//!
//! Each layer first lays every key head out once for all the queries that read it: as bf16
//! panels for the `vdpbf16ps` product when the caller hands Q, K and V as bf16 bits (bf16
//! mode), else transposed, `[kv head][dim][token]`, so that `Q·Kᵀ` reads both operands in
//! place. In bf16 mode the value heads are packed as panels too, and `P·V` is a bf16 product:
//! each probability's exponential rounded to bf16 (the largest is 1), the output divided by
//! the sum of the rounded values, as the GPU's attention kernel does. Otherwise `P·V` runs in
//! f32 on V where it lies. Each score and output is one sum in an order fixed by the head width
//! or the keys alone, so a prompt's attention does not depend on the batch it is in or the
//! thread count.

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
    /// bf16 `P·V`: per sequence, per kv head, its values' panels (see [`bf16::pack_columns`]).
    values: Vec<u32>,
}

/// One tile's buffers, kept across tiles of a thread: its scores, and in bf16 mode its
/// probabilities as bf16 bits.
#[derive(Debug, Default)]
struct TileScratch {
    scores: Vec<f32>,
    probabilities: Vec<u16>,
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
    /// Q, K and V as bf16 bits, with their panels.
    Panels(PanelKeys<'a>),
}

/// Q, K and V as bf16 bits, and each sequence's key and value panels from
/// `starts[sequence]`, kv head by kv head.
#[derive(Clone, Copy)]
struct PanelKeys<'a> {
    bits: &'a [u16],
    panels: &'a [u32],
    values: &'a [u32],
    starts: &'a [Starts],
}

/// Where a sequence's key and value panels start.
#[derive(Debug, Clone, Copy)]
struct Starts {
    keys: usize,
    values: usize,
}

/// Computes softmax(Q Kᵀ / √d) V per sequence and head, writing `[tokens, heads × head_dim]` rows
/// into `out`. `qkv` holds `[tokens, (heads + 2 kv_heads) × head_dim]` rows with RoPE applied;
/// `qk_bits`, the same rows as bf16 bits (bf16 mode on a CPU with `vdpbf16ps`), makes `Q·Kᵀ`
/// and `P·V` bf16 products. Given `out_bits`, each tile also rounds its output rows to bf16 bits there
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
    let starts: Vec<Starts>;
    let keys = match qk_bits {
        Some(bits) => {
            starts = pack_heads(bits, batch, shape, scratch);
            Keys::Panels(PanelKeys {
                bits,
                panels: &scratch.panels,
                values: &scratch.values,
                starts: &starts,
            })
        }
        None => {
            transpose_keys(qkv, batch.num_tokens(), shape, &mut scratch.transposed);
            Keys::Transposed {
                data: &scratch.transposed,
                tokens: batch.num_tokens(),
            }
        }
    };
    tiles.par_iter().zip(chunks).for_each_init(
        TileScratch::default,
        |scratch, (tile, (out_rows, bits))| {
            attend_tile(qkv, keys, shape, *tile, scratch, out_rows);
            if let Some(bits) = bits {
                kernels::bf16_bits_rows(out_rows, bits);
            }
        },
    );
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

/// Each sequence's key heads as bf16 panels into `scratch.panels` ([`bf16::pack_rows`]) and
/// its value heads into `scratch.values` ([`bf16::pack_columns`]); returns where each
/// sequence's panels start.
fn pack_heads(
    bits: &[u16],
    batch: &Batch,
    shape: AttentionShape,
    scratch: &mut KeyScratch,
) -> Vec<Starts> {
    let (heads, kv_heads, head_dim) = (shape.num_heads, shape.num_kv_heads, shape.head_dim);
    let key_len = |tokens: usize| tokens.div_ceil(bf16::PANEL) * bf16::panel_len(head_dim);
    let value_len = |tokens: usize| bf16::column_panels_len(tokens, head_dim);
    let mut starts = Vec::with_capacity(batch.num_sequences());
    let (mut keys, mut values) = (0, 0);
    for sequence in 0..batch.num_sequences() {
        starts.push(Starts { keys, values });
        let tokens = batch.sequence(sequence).len();
        keys += kv_heads * key_len(tokens);
        values += kv_heads * value_len(tokens);
    }
    scratch.panels.resize(keys, 0);
    scratch.values.resize(values, 0);
    let mut jobs = Vec::with_capacity(batch.num_sequences() * kv_heads);
    let (mut key_rest, mut value_rest) = (&mut scratch.panels[..], &mut scratch.values[..]);
    for sequence in 0..batch.num_sequences() {
        let tokens = batch.sequence(sequence).len();
        for kv_head in 0..kv_heads {
            let (key_dst, key_tail) = key_rest.split_at_mut(key_len(tokens));
            let (value_dst, value_tail) = value_rest.split_at_mut(value_len(tokens));
            jobs.push((sequence, kv_head, key_dst, value_dst));
            (key_rest, value_rest) = (key_tail, value_tail);
        }
    }
    let width = shape.width();
    jobs.into_par_iter()
        .for_each(|(sequence, kv_head, key_dst, value_dst)| {
            let range = batch.sequence(sequence);
            let head = |first: usize| Bf16View {
                bits: &bits[range.start * width + (first + kv_head) * head_dim..],
                rows: range.len(),
                cols: head_dim,
                stride: width,
            };
            bf16::pack_rows(head(heads), key_dst);
            bf16::pack_columns(head(heads + kv_heads), value_dst);
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
    scratch: &mut TileScratch,
    out: &mut [f32],
) {
    let (first_query, end_query) = (tile.start - tile.seq_start, tile.end - tile.seq_start);
    // From a whole panel on: a window's earlier keys are masked below like later ones.
    let lowest_key = shape
        .window
        .map_or(0, |w| (first_query + 1).saturating_sub(w));
    let lowest_key = lowest_key - lowest_key % bf16::PANEL;
    let (queries, key_count) = (end_query - first_query, end_query - lowest_key);
    let TileScratch {
        scores,
        probabilities,
    } = scratch;
    scores.resize(queries * key_count, 0.0);
    let out_width = shape.num_heads * shape.head_dim;
    let group = shape.num_heads / shape.num_kv_heads;
    for head in 0..shape.num_heads {
        // Runs of queries, each summing only up to the last key its last query sees: past the
        // diagonal the scores would all be masked.
        for first in (0..queries).step_by(CAUSAL_RUN) {
            let rows = CAUSAL_RUN.min(queries - first);
            let run = Run {
                tile,
                head,
                kv_head: head / group,
                first,
                rows,
                lowest_key,
                seen: first_query + first + rows - lowest_key,
                key_count,
            };
            let scores = &mut scores[first * key_count..];
            let out = &mut out[first * out_width + head * shape.head_dim..];
            match keys {
                Keys::Panels(keys) => run.bf16(keys, shape, (scores, probabilities), out),
                Keys::Transposed { data, tokens } => {
                    run.f32((qkv, data, tokens), shape, scores, out);
                }
            }
        }
    }
}

/// Up to [`CAUSAL_RUN`] queries of a tile against one head.
#[derive(Debug, Clone, Copy)]
struct Run {
    tile: Tile,
    head: usize,
    kv_head: usize,
    /// The run's first query, from the tile's start, and its count.
    first: usize,
    rows: usize,
    /// The tile's first key (a whole panel), and the keys the run sums from it: up to the
    /// last one its last query sees.
    lowest_key: usize,
    seen: usize,
    /// The stride of the tile's scores.
    key_count: usize,
}

impl Run {
    /// The first and last key row `r` of the run sees, from the tile's lowest key.
    fn visible(&self, r: usize, window: Option<usize>) -> (usize, usize) {
        let query = self.tile.start - self.tile.seq_start + self.first + r;
        let first = window.map_or(0, |w| (query + 1).saturating_sub(w));
        (first - self.lowest_key, query - self.lowest_key)
    }

    /// Where the run's first query starts in the fused Q|K|V rows.
    fn query_at(&self, shape: AttentionShape) -> usize {
        (self.tile.start + self.first) * shape.width() + self.head * shape.head_dim
    }

    /// bf16 mode: `Q·Kᵀ` and `P·V` on `vdpbf16ps`, the probabilities rounded to bf16 and each
    /// output row divided by the sum of its rounded probabilities.
    fn bf16(
        &self,
        keys: PanelKeys<'_>,
        shape: AttentionShape,
        (scores, probabilities): (&mut [f32], &mut Vec<u16>),
        out: &mut [f32],
    ) {
        let (head_dim, tile, rows, seen) = (shape.head_dim, self.tile, self.rows, self.seen);
        let starts = keys.starts[tile.sequence];
        let queries = Bf16View {
            bits: &keys.bits[self.query_at(shape)..],
            rows,
            cols: head_dim,
            stride: shape.width(),
        };
        let panels_per_head = tile.seq_len.div_ceil(bf16::PANEL);
        let from = starts.keys
            + (self.kv_head * panels_per_head + self.lowest_key / bf16::PANEL)
                * bf16::panel_len(head_dim);
        bf16::product_packed(queries, &keys.panels[from..], seen, scores, self.key_count);
        // Each row's probabilities over an even count of keys, zero where masked.
        let stride = seen.next_multiple_of(2);
        probabilities.resize(rows * stride, 0);
        let mut sums = [0.0f32; CAUSAL_RUN];
        let scale = 1.0 / (head_dim as f32).sqrt();
        let rows_of_p = probabilities.chunks_exact_mut(stride);
        for (r, (row, p)) in scores
            .chunks_exact(self.key_count)
            .zip(rows_of_p)
            .enumerate()
        {
            let (first, last) = self.visible(r, shape.window);
            p[..first].fill(0);
            p[last + 1..].fill(0);
            kernels::softmax_bits(
                &row[first..=last],
                scale,
                &mut p[first..=last],
                &mut sums[r],
            );
        }
        let from = starts.values + self.kv_head * bf16::column_panels_len(tile.seq_len, head_dim);
        let values = (
            &keys.values[from..],
            tile.seq_len.div_ceil(2) * bf16::PANEL,
            self.lowest_key / 2,
        );
        let p = Bf16View::dense(&probabilities[..rows * stride], rows, stride);
        let out_width = shape.num_heads * head_dim;
        bf16::product_columns(p, values, head_dim, out, out_width);
        for (r, sum) in sums.iter().take(rows).enumerate() {
            let inverse = 1.0 / sum;
            let row = &mut out[r * out_width..][..head_dim];
            row.iter_mut().for_each(|v| *v *= inverse);
        }
    }

    /// f32: both products on the in-place kernel, K transposed and V where it lies.
    fn f32(
        &self,
        (qkv, keys, tokens): (&[f32], &[f32], usize),
        shape: AttentionShape,
        scores: &mut [f32],
        out: &mut [f32],
    ) {
        let (head_dim, width, seen) = (shape.head_dim, shape.width(), self.seen);
        let key_from = self.tile.seq_start + self.lowest_key;
        let queries = MatRef {
            data: &qkv[self.query_at(shape)..],
            rows: self.rows,
            cols: head_dim,
            row_stride: width,
        };
        let columns = MatRef {
            data: &keys[self.kv_head * head_dim * tokens + key_from..],
            rows: head_dim,
            cols: seen,
            row_stride: tokens,
        };
        in_place::product(queries, columns, scores, self.key_count);
        let scale = 1.0 / (head_dim as f32).sqrt();
        let rows = scores.chunks_exact_mut(self.key_count).take(self.rows);
        for (r, row) in rows.enumerate() {
            let (first, last) = self.visible(r, shape.window);
            row[..first].fill(0.0);
            row[last + 1..seen].fill(0.0);
            kernels::softmax_in_place(&mut row[first..=last], scale);
        }
        let value_head = shape.num_heads + shape.num_kv_heads + self.kv_head;
        let values = MatRef {
            data: &qkv[key_from * width + value_head * head_dim..],
            rows: seen,
            cols: head_dim,
            row_stride: width,
        };
        let probabilities = MatRef {
            data: scores,
            rows: self.rows,
            cols: seen,
            row_stride: self.key_count,
        };
        in_place::product(probabilities, values, out, shape.num_heads * head_dim);
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
    fn both_paths_match_a_float64_attention_over_ragged_sequences_and_a_window() {
        // Sequences shorter than, equal to and over a tile; odd head width; a window that
        // cuts inside the tiles.
        let lengths = [3, QUERY_TILE, 2 * QUERY_TILE + 9, 1];
        let tokens = lengths.iter().sum();
        let (qkv, bits) = rows(tokens, SHAPE, 0.37);
        for window in [None, Some(21)] {
            let shape = AttentionShape { window, ..SHAPE };
            let expected = reference(&qkv, &lengths, shape);
            // bf16 probabilities: each weight moves by at most 2⁻⁹ of itself in its rounding,
            // and as much again in the division by the rounded sum.
            let largest_value = qkv.iter().fold(0.0f64, |m, &v| m.max(f64::from(v).abs()));
            let bf16_bound = largest_value / 256.0;
            for (name, bits) in [("f32", None), ("bf16", Some(&bits[..]))] {
                let got = run(&qkv, bits, &lengths, shape);
                let bound = |want: f64| match bits {
                    None => 1e-5 * (1.0 + want.abs()),
                    Some(_) => bf16_bound,
                };
                for (i, (&got, &want)) in got.iter().zip(&expected).enumerate() {
                    assert!(
                        (f64::from(got) - want).abs() <= bound(want),
                        "{name} attention, window {window:?}, value {i}: {got} vs {want}"
                    );
                }
            }
        }
    }

    #[test]
    fn a_sequence_longer_than_a_block_of_keys_matches_a_float64_attention() {
        // Over `bf16::KC` keys the bf16 `P·V` sums in two blocks; a window starts it inside
        // the values' panels.
        let lengths = [bf16::KC + 70];
        let (qkv, bits) = rows(lengths[0], SHAPE, 0.23);
        let largest_value = qkv.iter().fold(0.0f64, |m, &v| m.max(f64::from(v).abs()));
        for window in [None, Some(300)] {
            let shape = AttentionShape { window, ..SHAPE };
            let expected = reference(&qkv, &lengths, shape);
            let got = run(&qkv, Some(&bits), &lengths, shape);
            for (i, (&got, &want)) in got.iter().zip(&expected).enumerate() {
                assert!(
                    (f64::from(got) - want).abs() <= largest_value / 256.0,
                    "window {window:?}, value {i}: {got} vs {want}"
                );
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
