//! Shard assembly: per-prompt tensors in prompt order, per-shard statistics, the shard file
//! itself, and the partial record that marks a shard durable for resume.

use std::collections::HashMap;

use harvest_core::format::{Contents, Truncation};
use harvest_core::partial::{RECORD_KEY, RecordMeta};
use harvest_core::selection::{Dropped, NormHistogram};
use harvest_core::{RunningStats, Sites};
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};

use crate::backend::{Captured, RouteShape, Routes, Values, widen_bf16};
use crate::error::{Error, Result};
use crate::tokenizer::Encoded;

/// One prompt's captured tensors, ready to serialise.
#[derive(Debug)]
struct PromptTensors {
    index: usize,
    ids: Vec<u8>,
    /// For a conversation: `roles_i` (uint8) and `turns_i` (uint16), beside `ids`.
    roles: Option<(Vec<u8>, Vec<u8>)>,
    /// The kept positions, int32, when the job selects tokens.
    positions: Option<Vec<u8>>,
    /// Per kept site, in block order.
    values: Vec<Vec<u8>>,
    shape: [usize; 3],
    /// The kept rows' expert choices, when the job keeps the router.
    routes: Option<PromptRoutes>,
}

/// One prompt's `router_ids_i`, `router_weights_i` and `router_logits_i`, little-endian.
#[derive(Debug)]
struct PromptRoutes {
    ids: Vec<u8>,
    weights: Vec<u8>,
    logits: Vec<u8>,
    /// `[route layers, kept rows, k]`.
    shape: [usize; 3],
    /// Logits per row (0 when not kept).
    experts: usize,
}

impl PromptRoutes {
    /// The rows at `positions` of the batch rows `rows`, from every route slot of `routes`.
    fn gather(routes: &Routes, rows: std::ops::Range<usize>, positions: &[u32]) -> Option<Self> {
        let RouteShape { layers, k, experts } = routes.shape;
        if layers == 0 {
            return None;
        }
        let n = positions.len();
        let mut out = Self {
            ids: Vec::with_capacity(layers * n * k * 4),
            weights: Vec::with_capacity(layers * n * k * 4),
            logits: Vec::with_capacity(layers * n * experts * 4),
            shape: [layers, n, k],
            experts,
        };
        for slot in 0..layers {
            let (ids, weights, logits) = routes.rows(slot, rows.clone());
            for &p in positions {
                let p = p as usize;
                out.ids
                    .extend(ids[p * k..(p + 1) * k].iter().flat_map(|v| v.to_le_bytes()));
                out.weights.extend(
                    weights[p * k..(p + 1) * k]
                        .iter()
                        .flat_map(|v| v.to_le_bytes()),
                );
                let logits = &logits[p * experts..(p + 1) * experts];
                out.logits
                    .extend(logits.iter().flat_map(|v| v.to_le_bytes()));
            }
        }
        Some(out)
    }

    /// Adds prompt `index`'s router tensors to `views`.
    fn views<'a>(&'a self, index: usize, views: &mut Vec<(String, TensorView<'a>)>) -> Result<()> {
        let [layers, rows, _] = self.shape;
        views.push((
            format!("router_ids_{index}"),
            tensor(Dtype::I32, self.shape.to_vec(), &self.ids)?,
        ));
        views.push((
            format!("router_weights_{index}"),
            tensor(Dtype::F32, self.shape.to_vec(), &self.weights)?,
        ));
        if self.experts > 0 {
            let shape = vec![layers, rows, self.experts];
            views.push((
                format!("router_logits_{index}"),
                tensor(Dtype::F32, shape, &self.logits)?,
            ));
        }
        Ok(())
    }
}

/// A shard being filled, prompt by prompt, in order.
#[derive(Debug)]
pub struct ShardAssembly {
    /// Shard number.
    pub shard: usize,
    first_prompt: usize,
    expected: usize,
    contents: Contents,
    sites: Sites,
    prompts: Vec<PromptTensors>,
    token_counts: Vec<usize>,
    truncations: Vec<Truncation>,
    stats: Vec<RunningStats>,
    /// Whether the job selects tokens (prompts then carry `positions_i`).
    selecting: bool,
    kept_counts: Vec<usize>,
    dropped: Dropped,
    /// The candidate norms of this shard's prompts, when the job filters on norms.
    pub norms: Option<NormHistogram>,
    /// `0, 1, 2, …`: the positions of a prompt that keeps every token, grown to the longest.
    every_position: Vec<u32>,
}

/// What every shard of a job holds.
#[derive(Debug, Clone, Copy)]
pub struct ShardShape<'a> {
    /// Activations or projections.
    pub contents: Contents,
    /// The kept hook sites.
    pub sites: &'a Sites,
    /// Kept sites times kept layers.
    pub slots: usize,
    /// Values per row.
    pub width: usize,
    /// Whether the job selects tokens.
    pub selecting: bool,
    /// Whether it filters on norms (shards then carry their norm histograms).
    pub norms: bool,
}

/// Which of a prompt's rows a shard keeps.
#[derive(Debug, Clone, Copy)]
pub enum KeptRows<'a> {
    /// Every row (no token selection).
    All,
    /// These positions, ascending, and what the selection dropped.
    Positions(&'a [u32], Dropped),
}

/// What a shard contributes to the manifest and the statistics, kept beside the shard (under
/// `partial/`) until the manifest is written, so a resumed run can skip the shard.
#[derive(Debug, Clone, PartialEq)]
pub struct ShardRecord {
    /// What the record's header holds (its `counts` are the statistics' own, written from
    /// `stats` when the record is serialised).
    pub meta: RecordMeta,
    /// Per slot: each kept site's kept layers, site by site.
    pub stats: Vec<RunningStats>,
    /// The shard's candidate norms, when the job filters on norms.
    pub norms: Option<NormHistogram>,
}

impl ShardAssembly {
    /// An empty shard expecting `expected` prompts from `first_prompt` on.
    pub fn new(shard: usize, first_prompt: usize, expected: usize, shape: &ShardShape<'_>) -> Self {
        let ShardShape {
            contents,
            sites,
            slots,
            width,
            selecting,
            norms,
        } = *shape;
        Self {
            shard,
            first_prompt,
            expected,
            contents,
            sites: sites.clone(),
            prompts: Vec::with_capacity(expected),
            token_counts: Vec::with_capacity(expected),
            truncations: Vec::new(),
            stats: (0..slots).map(|_| RunningStats::new(width)).collect(),
            selecting,
            kept_counts: Vec::new(),
            dropped: Dropped::default(),
            norms: norms.then(NormHistogram::default),
            every_position: Vec::new(),
        }
    }

    /// Adds the next prompt, `encoded`, whose rows are `rows` of `captured`, keeping `kept` of
    /// them. `skip_bos` leaves its first token (a BOS) out of the statistics.
    pub fn push(
        &mut self,
        index: usize,
        encoded: &Encoded,
        captured: &Captured,
        rows: std::ops::Range<usize>,
        skip_bos: bool,
        kept: KeptRows<'_>,
    ) {
        debug_assert_eq!(
            index,
            self.first_prompt + self.prompts.len(),
            "prompts arrive in order"
        );
        let Encoded {
            ids,
            truncated_from,
            roles,
        } = encoded;
        let width = captured.width;
        let positions: Option<&[u32]> = match kept {
            KeptRows::All => None,
            KeptRows::Positions(positions, dropped) => {
                self.dropped.add(&dropped);
                Some(positions)
            }
        };
        let n_kept = positions.map_or(rows.len(), <[u32]>::len);
        let per_site = captured.layers * n_kept * width * self.contents_itemsize();
        let mut values: Vec<Vec<u8>> = (0..captured.sites)
            .map(|_| Vec::with_capacity(per_site))
            .collect();
        if self.every_position.len() < rows.len() {
            self.every_position = (0..rows.len() as u32).collect();
        }
        let positions = positions.unwrap_or(&self.every_position[..rows.len()]);
        for (slot, stats) in self.stats.iter_mut().enumerate() {
            let block = captured.values(slot, rows.clone());
            let values = &mut values[slot / captured.layers];
            for &position in positions {
                let at = position as usize * width;
                let row = block.slice(at..at + width);
                encode_row(self.contents, row, values);
                if !(skip_bos && position == 0) {
                    push_stats(stats, row);
                }
            }
        }
        if let &Some(original) = truncated_from {
            self.truncations.push(Truncation {
                prompt: index,
                original_tokens: original,
                kept_tokens: ids.len(),
            });
        }
        self.token_counts.push(ids.len());
        if self.selecting {
            self.kept_counts.push(n_kept);
        }
        self.prompts.push(PromptTensors {
            index,
            ids: ids
                .iter()
                .flat_map(|&id| (id as i32).to_le_bytes())
                .collect(),
            roles: roles.as_ref().map(|r| {
                let turns = r.turns.iter().flat_map(|t| t.to_le_bytes()).collect();
                (r.roles.clone(), turns)
            }),
            positions: self.selecting.then(|| {
                positions
                    .iter()
                    .flat_map(|&p| (p as i32).to_le_bytes())
                    .collect()
            }),
            values,
            shape: [captured.layers, n_kept, width],
            routes: PromptRoutes::gather(&captured.routes, rows, positions),
        });
    }

    fn contents_itemsize(&self) -> usize {
        match self.contents {
            Contents::Activations => 2,
            Contents::Projections => 4,
        }
    }

    /// Whether every expected prompt has arrived.
    pub fn is_complete(&self) -> bool {
        self.prompts.len() == self.expected
    }

    /// The shard file's bytes and its record (the hash is filled in by [`ShardRecord::seal`]).
    pub fn finish(self, fingerprint: &str) -> Result<(Vec<u8>, ShardRecord)> {
        let dtype = match self.contents {
            Contents::Activations => Dtype::BF16,
            Contents::Projections => Dtype::F32,
        };
        let mut views = Vec::with_capacity((1 + self.sites.len()) * self.prompts.len());
        for p in &self.prompts {
            for (site, values) in self.sites.as_slice().iter().zip(&p.values) {
                views.push((
                    format!("{}_{}", site.tensor_prefix(), p.index),
                    tensor(dtype, p.shape.to_vec(), values)?,
                ));
            }
            views.push((
                format!("tokens_{}", p.index),
                tensor(Dtype::I32, vec![p.ids.len() / 4], &p.ids)?,
            ));
            if let Some((roles, turns)) = &p.roles {
                views.push((
                    format!("roles_{}", p.index),
                    tensor(Dtype::U8, vec![roles.len()], roles)?,
                ));
                views.push((
                    format!("turns_{}", p.index),
                    tensor(Dtype::U16, vec![turns.len() / 2], turns)?,
                ));
            }
            if let Some(positions) = &p.positions {
                views.push((
                    format!("positions_{}", p.index),
                    tensor(Dtype::I32, vec![p.shape[1]], positions)?,
                ));
            }
            if let Some(routes) = &p.routes {
                routes.views(p.index, &mut views)?;
            }
        }
        // One metadata key only: safetensors writes the map in hash order, and a second key
        // would make identical shards differ byte for byte between runs.
        let metadata = HashMap::from([("harvest_plan".to_owned(), fingerprint.to_owned())]);
        let bytes =
            safetensors::serialize(views, Some(metadata)).map_err(|e| Error::InvalidBatch {
                reason: format!("serialising shard {}: {e}", self.shard),
            })?;
        let record = ShardRecord {
            meta: RecordMeta {
                shard: self.shard,
                first_prompt: self.first_prompt,
                token_counts: self.token_counts,
                truncations: self.truncations,
                sha256: String::new(),
                bytes: 0,
                counts: self.stats.iter().map(RunningStats::count).collect(),
                fingerprint: fingerprint.to_owned(),
                kept_counts: self.kept_counts,
                dropped: self.dropped,
                bos_token_id: None,
            },
            stats: self.stats,
            norms: self.norms,
        };
        Ok((bytes, record))
    }
}

/// A tensor of a shard over `data`.
fn tensor(dtype: Dtype, shape: Vec<usize>, data: &[u8]) -> Result<TensorView<'_>> {
    TensorView::new(dtype, shape, data).map_err(|e| Error::InvalidBatch {
        reason: e.to_string(),
    })
}

/// Adds `row` to `stats`, bf16 widened exactly.
fn push_stats(stats: &mut RunningStats, row: Values<'_>) {
    match row {
        Values::F32(row) => stats.push(row),
        Values::Bf16(bits) => stats.push_values(bits.iter().map(|&b| widen_bf16(b))),
    }
}

/// Appends `row` as the shard stores it: bf16 activations or f32 projections. Values held as
/// bf16 are stored as their f32 widening would be (rounding an exact bf16 changes nothing).
fn encode_row(contents: Contents, row: Values<'_>, values: &mut Vec<u8>) {
    let bf16 = |v: f32| half::bf16::from_f32(v).to_bits().to_le_bytes();
    match (contents, row) {
        (Contents::Activations, Values::F32(row)) => {
            values.extend(row.iter().flat_map(|&v| bf16(v)));
        }
        (Contents::Activations, Values::Bf16(bits)) => {
            values.extend(bits.iter().flat_map(|&b| bf16(widen_bf16(b))));
        }
        (Contents::Projections, row) => values.extend(row.iter().flat_map(f32::to_le_bytes)),
    }
}

/// Hex sha256 of `bytes`.
pub fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::{Digest, Sha256};
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

impl ShardRecord {
    /// Records the hash and size of the shard file.
    pub fn seal(&mut self, shard_bytes: &[u8]) {
        self.meta.sha256 = sha256_hex(shard_bytes);
        self.meta.bytes = shard_bytes.len() as u64;
    }

    /// The record's file name under the output prefix.
    pub fn file_name(shard: usize) -> String {
        harvest_core::partial::record_file_name(shard)
    }

    /// Serialises the record: f64 tensors for the statistics (exact), JSON metadata for the rest.
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        let layers = self.stats.len();
        let width = self.stats.first().map_or(0, |s| s.mean().len());
        let f64_bytes = |pick: &dyn Fn(&RunningStats) -> &[f64]| -> Vec<u8> {
            self.stats
                .iter()
                .flat_map(|s| {
                    pick(s)
                        .iter()
                        .flat_map(|v| v.to_le_bytes())
                        .collect::<Vec<_>>()
                })
                .collect()
        };
        let mean = f64_bytes(&|s| s.mean());
        let m2 = f64_bytes(&|s| s.m2());
        let norms: Vec<u8> = self
            .stats
            .iter()
            .flat_map(|s| s.norm_sum().to_le_bytes())
            .collect();
        let meta = RecordMeta {
            counts: self.stats.iter().map(RunningStats::count).collect(),
            ..self.meta.clone()
        };
        let invalid = |e: safetensors::SafeTensorError| Error::InvalidBatch {
            reason: e.to_string(),
        };
        let histogram: Vec<u8> = self
            .norms
            .iter()
            .flat_map(|h| h.counts().iter().flat_map(|c| c.to_le_bytes()))
            .collect();
        let mut views = vec![
            (
                "mean",
                TensorView::new(Dtype::F64, vec![layers, width], &mean).map_err(invalid)?,
            ),
            (
                "m2",
                TensorView::new(Dtype::F64, vec![layers, width], &m2).map_err(invalid)?,
            ),
            (
                "norm_sum",
                TensorView::new(Dtype::F64, vec![layers], &norms).map_err(invalid)?,
            ),
        ];
        if !histogram.is_empty() {
            let bins = histogram.len() / 8;
            let view = TensorView::new(Dtype::U64, vec![bins], &histogram).map_err(invalid)?;
            views.push(("norm_histogram", view));
        }
        let meta = serde_json::to_string(&meta).map_err(|e| Error::InvalidBatch {
            reason: e.to_string(),
        })?;
        safetensors::serialize(views, Some(HashMap::from([(RECORD_KEY.to_owned(), meta)])))
            .map_err(invalid)
    }

    /// Parses a record; `None` if it is unreadable (it is then treated as absent).
    pub fn from_bytes(bytes: &[u8]) -> Option<Self> {
        let st = SafeTensors::deserialize(bytes).ok()?;
        let (_, header) = SafeTensors::read_metadata(bytes).ok()?;
        let meta: RecordMeta =
            serde_json::from_str(header.metadata().as_ref()?.get(RECORD_KEY)?).ok()?;
        let f64s = |name: &str| -> Option<(Vec<usize>, Vec<f64>)> {
            let view = st.tensor(name).ok()?;
            let values = view
                .data()
                .chunks_exact(8)
                .map(|b| f64::from_le_bytes(b.try_into().unwrap_or([0; 8])))
                .collect();
            Some((view.shape().to_vec(), values))
        };
        let (shape, mean) = f64s("mean")?;
        let (_, m2) = f64s("m2")?;
        let (_, norms) = f64s("norm_sum")?;
        let width = *shape.get(1)?;
        let stats = (0..*shape.first()?)
            .map(|l| {
                RunningStats::from_parts(
                    *meta.counts.get(l)?,
                    mean.get(l * width..(l + 1) * width)?.to_vec(),
                    m2.get(l * width..(l + 1) * width)?.to_vec(),
                    *norms.get(l)?,
                )
            })
            .collect::<Option<Vec<_>>>()?;
        let norms = match st.tensor("norm_histogram") {
            Err(_) => None,
            Ok(view) => Some(NormHistogram::from_counts(
                view.data()
                    .chunks_exact(8)
                    .map(|b| u64::from_le_bytes(b.try_into().unwrap_or([0; 8])))
                    .collect(),
            )?),
        };
        Some(Self { meta, stats, norms })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::Held;

    fn captured() -> Captured {
        let mut c = Captured::default();
        c.reset(1, 2, 3, 2);
        c.data = (0..12).map(|v| v as f32).collect();
        c
    }

    fn shape(contents: Contents, sites: &Sites, slots: usize, selecting: bool) -> ShardShape<'_> {
        ShardShape {
            contents,
            sites,
            slots,
            width: 2,
            selecting,
            norms: selecting,
        }
    }

    fn plain(ids: &[u32], truncated_from: Option<usize>) -> Encoded {
        Encoded {
            ids: ids.to_vec(),
            truncated_from,
            roles: None,
        }
    }

    #[test]
    fn a_conversations_shard_carries_each_tokens_role_and_turn_beside_its_id() {
        let mut shard = ShardAssembly::new(
            0,
            0,
            1,
            &shape(Contents::Activations, &Sites::default(), 2, true),
        );
        let encoded = Encoded {
            ids: vec![1, 2, 3],
            truncated_from: None,
            roles: Some(harvest_core::chat::TokenRoles {
                roles: vec![0, 2, 3],
                turns: vec![0, 0, 300],
            }),
        };
        let kept = KeptRows::Positions(&[2], Dropped::default());
        shard.push(0, &encoded, &captured(), 0..3, false, kept);
        let (bytes, _) = shard.finish("fp").unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let roles = st.tensor("roles_0").unwrap();
        assert_eq!((roles.dtype(), roles.data()), (Dtype::U8, &[0u8, 2, 3][..]));
        let turns = st.tensor("turns_0").unwrap();
        assert_eq!(turns.dtype(), Dtype::U16);
        assert_eq!(
            turns.data(),
            [0u8, 0, 0, 0, 44, 1],
            "little-endian, every token"
        );
    }

    fn bf16s(bytes: &[u8]) -> Vec<f32> {
        bytes
            .chunks_exact(2)
            .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect()
    }

    #[test]
    fn a_shard_holds_each_prompt_with_its_tokens_in_layer_token_order() {
        let mut shard = ShardAssembly::new(
            0,
            4,
            2,
            &shape(Contents::Activations, &Sites::default(), 2, false),
        );
        let c = captured();
        shard.push(4, &plain(&[7, 8], None), &c, 0..2, false, KeptRows::All);
        assert!(!shard.is_complete());
        shard.push(5, &plain(&[9], Some(10)), &c, 2..3, true, KeptRows::All);
        assert!(shard.is_complete());
        let (bytes, record) = shard.finish("fp").unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let p4 = st.tensor("prompt_4").unwrap();
        assert_eq!(p4.shape(), [2, 2, 2]);
        assert_eq!(p4.dtype(), Dtype::BF16);
        assert_eq!(bf16s(p4.data()), [0.0, 1.0, 2.0, 3.0, 6.0, 7.0, 8.0, 9.0]);
        assert_eq!(st.tensor("tokens_5").unwrap().data(), 9i32.to_le_bytes());
        assert_eq!(record.meta.token_counts, [2, 1]);
        assert_eq!(
            record.meta.truncations,
            [Truncation {
                prompt: 5,
                original_tokens: 10,
                kept_tokens: 1
            }]
        );
        assert_eq!(
            record.stats[0].count(),
            2,
            "prompt 5's only token was a skipped BOS"
        );
    }

    #[test]
    fn each_site_gets_its_own_tensor_and_its_own_statistics() {
        let sites = Sites::parse(&["attn_out", "resid_post"]).unwrap();
        let mut c = Captured::default();
        c.reset(2, 1, 2, 2);
        c.data = vec![1.0, 2.0, 3.0, 4.0, 10.0, 20.0, 30.0, 40.0];
        let mut shard =
            ShardAssembly::new(0, 0, 1, &shape(Contents::Activations, &sites, 2, false));
        shard.push(0, &plain(&[5, 6], None), &c, 0..2, false, KeptRows::All);
        let (bytes, record) = shard.finish("fp").unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let mut names = st.names();
        names.sort();
        assert_eq!(names, ["attn_out_0", "prompt_0", "tokens_0"]);
        assert_eq!(
            bf16s(st.tensor("attn_out_0").unwrap().data()),
            [1.0, 2.0, 3.0, 4.0]
        );
        assert_eq!(
            bf16s(st.tensor("prompt_0").unwrap().data()),
            [10.0, 20.0, 30.0, 40.0]
        );
        assert_eq!(st.tensor("prompt_0").unwrap().shape(), [1, 2, 2]);
        assert_eq!(record.stats.len(), 2);
        assert_eq!(record.stats[0].mean(), [2.0, 3.0]);
        assert_eq!(record.stats[1].mean(), [20.0, 30.0]);
    }

    #[test]
    fn a_capture_held_as_bf16_gives_the_shard_and_statistics_of_its_f32_widening() {
        // bf16 values (as a GPU's rows are), with a selection that keeps rows 0 and 2.
        let sites = Sites::parse(&["attn_out", "resid_post"]).unwrap();
        let values: Vec<f32> = (0..2 * 2 * 3 * 2)
            .map(|i| half::bf16::from_f32((i as f32 - 11.0) * 0.73).to_f32())
            .collect();
        let mut wide = Captured::default();
        wide.reset(2, 2, 3, 2);
        wide.data.clone_from(&values);
        let mut narrow = Captured::default();
        narrow.reset_held(Held::Bf16, (2, 2, 3, 2));
        narrow.bits = values
            .iter()
            .map(|&v| half::bf16::from_f32(v).to_bits())
            .collect();
        let assembled = |c: &Captured| {
            let shape = shape(Contents::Activations, &sites, 4, true);
            let mut shard = ShardAssembly::new(0, 0, 1, &shape);
            let kept = KeptRows::Positions(&[0, 2], Dropped::default());
            shard.push(0, &plain(&[5, 6, 7], None), c, 0..3, true, kept);
            let (bytes, record) = shard.finish("fp").unwrap();
            (bytes, record.to_bytes().unwrap())
        };
        let (from_f32, from_bf16) = (assembled(&wide), assembled(&narrow));
        assert_eq!(from_f32.0, from_bf16.0, "the shard");
        assert_eq!(
            from_f32.1, from_bf16.1,
            "the record, its statistics included"
        );
        assert_eq!(narrow.widened().data, wide.data);
    }

    #[test]
    fn records_round_trip_exactly() {
        let mut shard = ShardAssembly::new(
            3,
            0,
            1,
            &shape(Contents::Projections, &Sites::default(), 2, true),
        );
        let dropped = Dropped {
            sampled: 1,
            ..Dropped::default()
        };
        shard.push(
            0,
            &plain(&[1, 2, 3], None),
            &captured(),
            0..3,
            false,
            KeptRows::Positions(&[0, 2], dropped),
        );
        if let Some(norms) = shard.norms.as_mut() {
            norms.push(3.5);
        }
        let (bytes, mut record) = shard.finish("fp").unwrap();
        assert_eq!(
            (
                record.meta.kept_counts.as_slice(),
                record.meta.dropped.sampled
            ),
            (&[2][..], 1)
        );
        let st = SafeTensors::deserialize(&bytes).unwrap();
        assert_eq!(
            st.tensor("positions_0").unwrap().data(),
            [0i32, 2].map(i32::to_le_bytes).concat()
        );
        assert_eq!(st.tensor("prompt_0").unwrap().shape(), [2, 2, 2]);
        assert_eq!(st.tensor("tokens_0").unwrap().shape(), [3]);
        record.seal(&bytes);
        let back = ShardRecord::from_bytes(&record.to_bytes().unwrap()).unwrap();
        assert_eq!(back, record);
        assert_eq!(back.meta.bytes, bytes.len() as u64);
        assert!(ShardRecord::from_bytes(b"garbage").is_none());
    }
}
