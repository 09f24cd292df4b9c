//! The shuffled layout's second phase: the run's shards (written and resumable as for the
//! by-prompt layout) become training files of `rows_per_file` rows in a seeded uniform order.
//!
//! ```text
//! shards ──scatter by key range──► BUCKETS spill files (local disk, one record per row)
//!        ──each bucket: sort by (key, prompt, position)──► train_NNNNN.safetensors, in order
//! ```
//! Memory holds one bucket (at most [`BUCKET_BYTES`], about) and one training file, whatever
//! the job's size. The order depends only on the seed and the rows kept
//! ([`harvest_core::layout::shuffle_key`]), so a rerun writes the same files.

use std::collections::{BTreeMap, HashMap};
use std::io::{BufWriter, Write};
use std::num::NonZeroUsize;
use std::path::{Path, PathBuf};

use bytes::Bytes;
use harvest_core::format::{Contents, FileDigest, RouterPart};
use harvest_core::layout::{bucket_of, shuffle_key, train_file_name, train_tensor_name};
use harvest_core::plan::shard_file_name;
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};

use crate::error::{Error, ModelError, Result, StoreError};
use crate::pipeline::Job;
use crate::pipeline::assembly::shard::{ShardRecord, sha256_hex};
use crate::pipeline::output::store::Store;

/// Spill bytes per bucket the scatter aims for: what one bucket's sort holds in memory.
pub const BUCKET_BYTES: u64 = harvest_core::layout::SHUFFLE_BUCKET_BYTES;
/// Bytes of a spill record before its values: key (u64), prompt (u32), position (u32).
const RECORD_HEAD: usize = harvest_core::layout::SPILL_RECORD_HEAD;

/// A row's role byte after its values in a spill record, for a job of conversations.
const ROLE_BYTES: usize = 1;

/// The training files written, in order.
pub(in crate::pipeline) struct TrainFiles {
    /// Each file's name, size and checksum.
    pub files: Vec<FileDigest>,
    /// Rows of each file.
    pub rows: Vec<usize>,
    /// The tensor names of every file, values first (site by site, layer by layer), then
    /// `index`, then `roles` for a job of conversations.
    pub tensors: Vec<String>,
}

/// Where the spill files go.
pub(in crate::pipeline) struct SpillDir {
    /// The directory.
    pub path: PathBuf,
    /// Whether the job owns it alone: then it is cleared before and removed after.
    pub owned: bool,
}

/// What a shuffle needs to know about the job.
struct Rows<'a> {
    job: &'a Job<'a>,
    itemsize: usize,
    /// Bytes of one row's values over every slot.
    values: usize,
    /// Whether each row carries its token's role (a job of conversations).
    roles: bool,
    /// The router's parts ([`harvest_core::format::RouterInfo::parts`]) and its layers, when kept: a record carries
    /// them after its role, layer by layer and part by part.
    router: Option<(Vec<RouterPart>, usize)>,
}

impl Rows<'_> {
    /// Bytes of a record's router tail.
    fn router_bytes(&self) -> usize {
        self.router.as_ref().map_or(0, |(parts, layers)| {
            layers * parts.iter().map(|p| p.width * 4).sum::<usize>()
        })
    }

    /// Bytes of one spill record: its head, its values, its role where rows have one, and its
    /// expert choices where the router is kept.
    fn record_bytes(&self) -> usize {
        let role = if self.roles { ROLE_BYTES } else { 0 };
        RECORD_HEAD + self.values + role + self.router_bytes()
    }
}

/// Scatters the shards of `records` into buckets under `spill_in`, then writes the training
/// files to `store`.
pub(in crate::pipeline) fn write_train_files(
    job: &Job<'_>,
    records: &BTreeMap<usize, ShardRecord>,
    store: &Store,
    runtime: &tokio::runtime::Runtime,
    rows_per_file: NonZeroUsize,
    seed: u64,
    spill_in: &SpillDir,
) -> Result<TrainFiles> {
    let itemsize = match job.contents {
        Contents::Activations => 2,
        Contents::Projections => 4,
    };
    let rows = Rows {
        job,
        itemsize,
        values: job.slots * job.width * itemsize,
        roles: job.conversations,
        router: job
            .router
            .as_ref()
            .map(|r| (r.parts(), r.layer_indices.len())),
    };
    let total: u64 = records.values().map(|r| kept_rows(job, r)).sum();
    let record_bytes = rows.record_bytes() as u64;
    let buckets = (total * record_bytes).div_ceil(BUCKET_BYTES).max(1) as usize;
    let dir = &spill_in.path;
    if spill_in.owned && dir.exists() {
        std::fs::remove_dir_all(dir).map_err(|e| Error::io("clearing", dir, e))?;
    }
    std::fs::create_dir_all(dir).map_err(|e| Error::io("creating", dir, e))?;
    let spill = tempfile::Builder::new()
        .prefix("harvest-shuffle-")
        .tempdir_in(dir)
        .map_err(|e| Error::io("creating a spill directory in", dir, e))?;
    let paths = scatter(&rows, records, store, runtime, seed, spill.path(), buckets)?;
    let mut writer = TrainWriter::new(&rows, rows_per_file, total);
    for path in &paths {
        let bytes = std::fs::read(path).map_err(|e| Error::io("reading", path, e))?;
        let _ = std::fs::remove_file(path);
        let mut order: Vec<&[u8]> = bytes.chunks_exact(record_bytes as usize).collect();
        order.sort_unstable_by_key(|r| sort_key(r));
        for record in order {
            if let Some((name, file)) = writer.push(record)? {
                runtime.block_on(store.put(&name, Bytes::from(file)))?;
            }
        }
    }
    if let Some((name, file)) = writer.finish()? {
        runtime.block_on(store.put(&name, Bytes::from(file)))?;
    }
    drop(spill);
    if spill_in.owned {
        let _ = std::fs::remove_dir(dir);
    }
    Ok(writer.done)
}

/// A spill record's (key, prompt, position).
fn sort_key(record: &[u8]) -> (u64, u32, u32) {
    let u32_at = |at: usize| u32::from_le_bytes(record[at..at + 4].try_into().unwrap_or([0; 4]));
    let key = u64::from_le_bytes(record[..8].try_into().unwrap_or([0; 8]));
    (key, u32_at(8), u32_at(12))
}

/// Rows a shard holds: its kept tokens, or every token without a selection.
fn kept_rows(job: &Job<'_>, record: &ShardRecord) -> u64 {
    let counts = if job.plan.options.selection.is_everything() {
        &record.meta.token_counts
    } else {
        &record.meta.kept_counts
    };
    counts.iter().map(|&n| n as u64).sum()
}

/// Writes every row of every shard to its bucket's spill file; returns the files in key order.
fn scatter(
    rows: &Rows<'_>,
    records: &BTreeMap<usize, ShardRecord>,
    store: &Store,
    runtime: &tokio::runtime::Runtime,
    seed: u64,
    dir: &Path,
    buckets: usize,
) -> Result<Vec<PathBuf>> {
    let paths: Vec<PathBuf> = (0..buckets)
        .map(|b| dir.join(format!("bucket_{b:05}")))
        .collect();
    let writers = paths
        .iter()
        .map(|p| {
            std::fs::File::create(p)
                .map(BufWriter::new)
                .map_err(|e| Error::io("creating", p, e))
        })
        .collect::<Result<Vec<_>>>()?;
    let mut buckets_out = Buckets {
        writers,
        paths: &paths,
        record: Vec::with_capacity(rows.record_bytes()),
    };
    for shard in records.values() {
        let name = shard_file_name(shard.meta.shard);
        let bytes = runtime.block_on(store.get(&name))?.ok_or_else(|| {
            Error::Store(StoreError::Object {
                location: store.location().to_string(),
                reason: format!("{name} vanished before the shuffle"),
            })
        })?;
        scatter_shard(rows, shard, &bytes, seed, &mut buckets_out)?;
    }
    let writers = buckets_out.writers;
    for (writer, path) in writers.into_iter().zip(&paths) {
        writer
            .into_inner()
            .map_err(|e| Error::io("writing", path, e.into_error()))?
            .sync_data()
            .map_err(|e| Error::io("writing", path, e))?;
    }
    Ok(paths)
}

/// The open spill files and one record's scratch.
struct Buckets<'a> {
    writers: Vec<BufWriter<std::fs::File>>,
    paths: &'a [PathBuf],
    record: Vec<u8>,
}

/// Writes every row of one shard file to its bucket.
fn scatter_shard(
    rows: &Rows<'_>,
    shard: &ShardRecord,
    bytes: &[u8],
    seed: u64,
    out: &mut Buckets<'_>,
) -> Result<()> {
    let job = rows.job;
    let corrupt = |reason: String| {
        Error::Model(ModelError::CorruptSafetensors {
            path: shard_file_name(shard.meta.shard).into(),
            reason,
        })
    };
    let file = SafeTensors::deserialize(bytes).map_err(|e| corrupt(e.to_string()))?;
    let tensor = |name: String| {
        file.tensor(&name)
            .map_err(|e| corrupt(format!("{name}: {e}")))
    };
    let selecting = !job.plan.options.selection.is_everything();
    let row = job.width * rows.itemsize;
    for (offset, &tokens) in shard.meta.token_counts.iter().enumerate() {
        let prompt = shard.meta.first_prompt + offset;
        let positions = match selecting {
            true => int32s(tensor(format!("positions_{prompt}"))?.data()),
            false => (0..tokens as u32).collect(),
        };
        let n = positions.len();
        let roles = if rows.roles {
            Some(tensor(format!("roles_{prompt}"))?)
        } else {
            None
        };
        let sites = job
            .plan
            .options
            .sites
            .as_slice()
            .iter()
            .map(|s| tensor(format!("{}_{prompt}", s.tensor_prefix())))
            .collect::<Result<Vec<_>>>()?;
        let (parts, route_layers) = rows.router.clone().unwrap_or_default();
        let router = parts
            .iter()
            .map(|p| Ok((tensor(format!("{}_{prompt}", p.prefix))?, p.width * 4)))
            .collect::<Result<Vec<_>>>()?;
        for (r, &position) in positions.iter().enumerate() {
            let key = shuffle_key(seed, prompt, position as usize);
            let record = &mut out.record;
            record.clear();
            record.extend_from_slice(&key.to_le_bytes());
            record.extend_from_slice(&(prompt as u32).to_le_bytes());
            record.extend_from_slice(&position.to_le_bytes());
            for view in &sites {
                for layer in 0..job.layers {
                    let at = (layer * n + r) * row;
                    record.extend_from_slice(&view.data()[at..at + row]);
                }
            }
            if let Some(roles) = &roles {
                let role = roles
                    .data()
                    .get(position as usize)
                    .ok_or_else(|| corrupt(format!("roles_{prompt} has no position {position}")))?;
                record.push(*role);
            }
            for layer in 0..route_layers {
                for (view, bytes) in &router {
                    let at = (layer * n + r) * bytes;
                    record.extend_from_slice(&view.data()[at..at + bytes]);
                }
            }
            let bucket = bucket_of(key, out.writers.len());
            out.writers[bucket]
                .write_all(record)
                .map_err(|e| Error::io("writing", &out.paths[bucket], e))?;
        }
    }
    Ok(())
}

/// Little-endian int32 values, as `u32` (positions are never negative).
fn int32s(data: &[u8]) -> Vec<u32> {
    data.chunks_exact(4)
        .map(|b| i32::from_le_bytes(b.try_into().unwrap_or([0; 4])) as u32)
        .collect()
}

/// Fills training files row by row.
struct TrainWriter<'a> {
    rows: &'a Rows<'a>,
    rows_per_file: usize,
    /// Rows still to come, so each file's buffers are sized once.
    remaining: u64,
    /// Per slot, the values of the file being filled.
    values: Vec<Vec<u8>>,
    index: Vec<u8>,
    /// Each row's role, for a job of conversations.
    roles: Vec<u8>,
    /// Per router tensor (layer by layer, part by part): its dtype, bytes per row and values.
    router: Vec<(Dtype, usize, Vec<u8>)>,
    filled: usize,
    done: TrainFiles,
}

impl<'a> TrainWriter<'a> {
    fn new(rows: &'a Rows<'a>, rows_per_file: NonZeroUsize, total: u64) -> Self {
        let job = rows.job;
        let mut tensors: Vec<String> = job
            .plan
            .options
            .sites
            .as_slice()
            .iter()
            .flat_map(|&site| {
                job.plan
                    .options
                    .layers
                    .as_slice()
                    .iter()
                    .map(move |&layer| train_tensor_name(site, layer))
            })
            .collect();
        tensors.push("index".into());
        if rows.roles {
            tensors.push("roles".into());
        }
        let router = job
            .router
            .as_ref()
            .map(harvest_core::format::RouterInfo::train_tensors)
            .unwrap_or_default();
        let buffers = router
            .iter()
            .map(|&(_, dtype, width)| {
                let dtype = if dtype == "int32" {
                    Dtype::I32
                } else {
                    Dtype::F32
                };
                (dtype, width * 4, Vec::new())
            })
            .collect();
        tensors.extend(router.into_iter().map(|(name, _, _)| name));
        Self {
            rows,
            rows_per_file: rows_per_file.get(),
            remaining: total,
            values: vec![Vec::new(); job.slots],
            index: Vec::new(),
            roles: Vec::new(),
            router: buffers,
            filled: 0,
            done: TrainFiles {
                files: Vec::new(),
                rows: Vec::new(),
                tensors,
            },
        }
    }

    /// Adds one spill record; returns a full file to store.
    fn push(&mut self, record: &[u8]) -> Result<Option<(String, Vec<u8>)>> {
        if self.filled == 0 {
            let rows = (self.rows_per_file as u64).min(self.remaining) as usize;
            let slot_bytes = rows * self.rows.job.width * self.rows.itemsize;
            for values in &mut self.values {
                values.clear();
                values.reserve(slot_bytes);
            }
            self.index.clear();
            self.index.reserve(rows * 8);
            self.roles.clear();
            for (_, bytes, values) in &mut self.router {
                values.clear();
                values.reserve(rows * *bytes);
            }
        }
        let (_, prompt, position) = sort_key(record);
        self.index.extend_from_slice(&(prompt as i32).to_le_bytes());
        self.index
            .extend_from_slice(&(position as i32).to_le_bytes());
        let row = self.rows.job.width * self.rows.itemsize;
        for (slot, values) in self.values.iter_mut().enumerate() {
            let at = RECORD_HEAD + slot * row;
            values.extend_from_slice(&record[at..at + row]);
        }
        let mut at = RECORD_HEAD + self.rows.values;
        if self.rows.roles {
            self.roles.push(record[at]);
            at += ROLE_BYTES;
        }
        for (_, bytes, values) in &mut self.router {
            values.extend_from_slice(&record[at..at + *bytes]);
            at += *bytes;
        }
        self.filled += 1;
        self.remaining = self.remaining.saturating_sub(1);
        if self.filled == self.rows_per_file {
            return self.finish();
        }
        Ok(None)
    }

    /// Serialises the file being filled, if it holds any row.
    fn finish(&mut self) -> Result<Option<(String, Vec<u8>)>> {
        if self.filled == 0 {
            return Ok(None);
        }
        let (rows, job) = (self.filled, self.rows.job);
        let dtype = match job.contents {
            Contents::Activations => Dtype::BF16,
            Contents::Projections => Dtype::F32,
        };
        let invalid = |e: safetensors::SafeTensorError| Error::InvalidBatch {
            reason: format!("serialising a training file: {e}"),
        };
        let mut views = Vec::with_capacity(self.values.len() + 1);
        for (name, values) in self.done.tensors.iter().zip(&self.values) {
            let view = TensorView::new(dtype, vec![rows, job.width], values).map_err(invalid)?;
            views.push((name.clone(), view));
        }
        let index = TensorView::new(Dtype::I32, vec![rows, 2], &self.index).map_err(invalid)?;
        views.push(("index".to_owned(), index));
        if self.rows.roles {
            let roles = TensorView::new(Dtype::U8, vec![rows], &self.roles).map_err(invalid)?;
            views.push(("roles".to_owned(), roles));
        }
        let names = self
            .done
            .tensors
            .iter()
            .skip(self.done.tensors.len() - self.router.len());
        for (name, (dtype, bytes, values)) in names.zip(&self.router) {
            let view = TensorView::new(*dtype, vec![rows, bytes / 4], values).map_err(invalid)?;
            views.push((name.clone(), view));
        }
        let metadata = HashMap::from([("harvest_plan".to_owned(), job.fingerprint.to_owned())]);
        let bytes = safetensors::serialize(views, Some(metadata)).map_err(invalid)?;
        let name = train_file_name(self.done.files.len());
        self.done.files.push(FileDigest {
            file: name.clone(),
            bytes: bytes.len() as u64,
            sha256: sha256_hex(&bytes),
        });
        self.done.rows.push(rows);
        self.filled = 0;
        Ok(Some((name, bytes)))
    }
}
