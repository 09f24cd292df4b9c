//! The three concurrent threads of a run: forward (the batches of [`crate::pipeline::forward::batches`], on one
//! backend or through pipeline stages, `staged`), assembly (shards in prompt order, token
//! selection) and upload, joined by bounded queues.

use std::collections::{BTreeMap, VecDeque};
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
use std::time::Instant;

use bytes::Bytes;
use harvest_core::plan::{shard_file_name, shard_prompts};

use crate::backend::{Backend, Batch, Captured};
use crate::error::{Error, Result};
use crate::pipeline::assembly::select::Selector;
use crate::pipeline::assembly::shard::{KeptRows, ShardAssembly, ShardRecord, ShardShape};
use crate::pipeline::flow::handoff::{ForwardOutput, root_cause};
use crate::pipeline::flow::progress::Progress;
use crate::pipeline::forward::engine::Engine;
use crate::pipeline::forward::staged;
use crate::pipeline::output::store::Store;
use crate::pipeline::{FORWARD_QUEUE, Job, UPLOAD_QUEUE};

/// What the run's threads produced.
pub(in crate::pipeline) struct ThreadsOutcome {
    pub(in crate::pipeline) records: Vec<ShardRecord>,
    pub(in crate::pipeline) forward_s: f64,
    pub(in crate::pipeline) save_s: f64,
    pub(in crate::pipeline) upload_s: f64,
}

/// Runs forward, assembly and upload concurrently; the first real error wins.
pub(in crate::pipeline) fn run_threads(
    job: &Job<'_>,
    engine: Engine,
    resumed: &BTreeMap<usize, ShardRecord>,
    store: &Store,
    runtime: &tokio::runtime::Runtime,
    progress: &Progress,
) -> Result<ThreadsOutcome> {
    let pool = engine.capture_pool();
    let (forward_tx, forward_rx) = sync_channel::<ForwardOutput>(FORWARD_QUEUE);
    let (free_tx, free_rx) = sync_channel::<Captured>(pool);
    let (upload_tx, upload_rx) = tokio::sync::mpsc::channel::<(Vec<u8>, ShardRecord)>(UPLOAD_QUEUE);
    for _ in 0..pool {
        let _ = free_tx.try_send(Captured::default());
    }
    std::thread::scope(|scope| {
        let forward = scope.spawn(move || match engine {
            Engine::Single(backend) => {
                forward_thread(job, backend, resumed, forward_tx, free_rx, progress)
            }
            Engine::Staged(staged) => {
                staged::forward(job, staged, resumed, forward_tx, free_rx, progress)
            }
        });
        let assemble =
            scope.spawn(move || assemble_thread(job, resumed, forward_rx, free_tx, upload_tx));
        let upload = runtime.block_on(upload_task(store, upload_rx));
        let forward = forward
            .join()
            .unwrap_or(Err(Error::ThreadLost { thread: "forward" }));
        let assemble = assemble
            .join()
            .unwrap_or(Err(Error::ThreadLost { thread: "assemble" }));
        match (forward, assemble, upload) {
            (Ok((forward_s, _tokens)), Ok(save_s), Ok((records, upload_s))) => Ok(ThreadsOutcome {
                records,
                forward_s,
                save_s,
                upload_s,
            }),
            (forward, assemble, upload) => {
                Err(root_cause([forward.err(), assemble.err(), upload.err()]))
            }
        }
    })
}

fn forward_thread(
    job: &Job<'_>,
    mut backend: Box<dyn Backend>,
    resumed: &BTreeMap<usize, ShardRecord>,
    tx: SyncSender<ForwardOutput>,
    free: Receiver<Captured>,
    progress: &Progress,
) -> Result<(f64, u64)> {
    let lost = || Error::ThreadLost { thread: "assemble" };
    let mut forward_s = 0.0;
    let mut done = Done {
        held: VecDeque::new(),
        tokens: 0,
        prompts: job.prompts_resumed(resumed),
        tx,
        progress,
    };
    let mut batch = Batch::default();
    for prompts in job.batches(resumed) {
        batch.clear();
        for index in prompts.clone() {
            batch.push(&job.encoded[index].ids);
        }
        let captured = free.recv().map_err(|_| lost())?;
        done.held.push_back((prompts, batch.num_tokens() as u64));
        let start = Instant::now();
        let completed = backend.capture_next(&batch, captured)?;
        forward_s += start.elapsed().as_secs_f64();
        done.hand_on(completed)?;
    }
    let start = Instant::now();
    let completed = backend.finish()?;
    forward_s += start.elapsed().as_secs_f64();
    done.hand_on(completed)?;
    if !done.held.is_empty() {
        return Err(Error::InvalidBatch {
            reason: format!(
                "the backend kept the captures of {} batches after its last. This is a bug.",
                done.held.len()
            ),
        });
    }
    Ok((forward_s, done.tokens))
}

/// The forward thread's batches from the backend to the assembler.
struct Done<'a> {
    /// The batches the backend has not handed back yet (`capture_next`), oldest first: their
    /// prompts and tokens.
    held: VecDeque<(std::ops::Range<usize>, u64)>,
    tokens: u64,
    prompts: usize,
    tx: SyncSender<ForwardOutput>,
    progress: &'a Progress,
}

impl Done<'_> {
    /// Sends a completed capture, the oldest held batch's, on to the assembler.
    fn hand_on(&mut self, captured: Option<Captured>) -> Result<()> {
        let Some(captured) = captured else {
            return Ok(());
        };
        let Some((prompts, tokens)) = self.held.pop_front() else {
            return Err(Error::InvalidBatch {
                reason: "the backend returned a capture for no batch it was given. This is a bug."
                    .into(),
            });
        };
        self.tokens += tokens;
        self.prompts += prompts.len();
        self.tx
            .send(ForwardOutput {
                prompts: prompts.collect(),
                captured,
            })
            .map_err(|_| Error::ThreadLost { thread: "assemble" })?;
        self.progress.update(self.prompts, self.tokens);
        Ok(())
    }
}

/// The selector of a job that selects tokens: the norm filter reads `resid_post` at the deepest
/// kept layer.
pub(in crate::pipeline) fn selector(job: &Job<'_>) -> Option<Selector> {
    let selection = job.plan.options.selection;
    if selection.is_everything() {
        return None;
    }
    let norm_slot = job
        .plan
        .options
        .sites
        .position(harvest_core::Site::ResidPost)
        .map(|site| site * job.layers + job.layers - 1);
    Some(Selector::new(selection, job.special_ids.clone(), norm_slot))
}

/// An empty assembly for shard `shard`.
fn new_assembly(job: &Job<'_>, shard: usize, selector: Option<&Selector>) -> ShardAssembly {
    let range = shard_prompts(shard, job.plan.options.shard_size, job.encoded.len());
    let shape = ShardShape {
        contents: job.contents,
        sites: &job.plan.options.sites,
        slots: job.slots,
        width: job.width,
        selecting: selector.is_some(),
        norms: selector.is_some_and(Selector::filters_norms),
    };
    ShardAssembly::new(shard, range.start, range.len(), &shape)
}

fn assemble_thread(
    job: &Job<'_>,
    resumed: &BTreeMap<usize, ShardRecord>,
    rx: Receiver<ForwardOutput>,
    free: SyncSender<Captured>,
    upload: tokio::sync::mpsc::Sender<(Vec<u8>, ShardRecord)>,
) -> Result<f64> {
    let mut busy = 0.0;
    let mut current: Option<ShardAssembly> = None;
    let mut selector = selector(job);
    let mut skipped = resumed.iter().peekable();
    let size = job.plan.options.shard_size;
    for output in rx {
        let start = Instant::now();
        let mut offset = 0;
        for &index in &output.prompts {
            let encoded = &job.encoded[index];
            let shard = index / size.get();
            let assembly = current.get_or_insert_with(|| {
                // The running median covers every earlier shard, made now or before.
                while let Some((_, record)) = skipped.next_if(|&(&s, _)| s < shard) {
                    if let (Some(selector), Some(norms)) = (selector.as_mut(), &record.norms) {
                        selector.skip_shard(norms);
                    }
                }
                new_assembly(job, shard, selector.as_ref())
            });
            let rows = offset..offset + encoded.ids.len();
            offset = rows.end;
            let skip_bos = job.bos_id.is_some() && encoded.ids.first() == job.bos_id.as_ref();
            let mut norms = assembly.norms.take().unwrap_or_default();
            let selected = selector.as_mut().map(|selector| {
                selector.select(index, encoded, &output.captured, rows.clone(), &mut norms)
            });
            let kept = match &selected {
                None => KeptRows::All,
                Some(selected) => KeptRows::Positions(selected.kept, selected.dropped),
            };
            assembly.push(index, encoded, &output.captured, rows, skip_bos, kept);
            if selector.as_ref().is_some_and(Selector::filters_norms) {
                assembly.norms = Some(norms);
            }
            if assembly.is_complete()
                && let Some(done) = current.take()
            {
                let (bytes, mut record) = done.finish(job.fingerprint)?;
                record.seal(&bytes);
                record.meta.bos_token_id = job.bos_id;
                busy += start.elapsed().as_secs_f64();
                upload
                    .blocking_send((bytes, record))
                    .map_err(|_| Error::ThreadLost { thread: "upload" })?;
            }
        }
        let _ = free.try_send(output.captured);
        busy += start.elapsed().as_secs_f64();
    }
    Ok(busy)
}

async fn upload_task(
    store: &Store,
    mut rx: tokio::sync::mpsc::Receiver<(Vec<u8>, ShardRecord)>,
) -> Result<(Vec<ShardRecord>, f64)> {
    let mut records = Vec::new();
    let mut busy = 0.0;
    while let Some((bytes, record)) = rx.recv().await {
        let start = Instant::now();
        store
            .put(&shard_file_name(record.meta.shard), Bytes::from(bytes))
            .await?;
        store
            .put(
                &ShardRecord::file_name(record.meta.shard),
                Bytes::from(record.to_bytes()?),
            )
            .await?;
        busy += start.elapsed().as_secs_f64();
        tracing::debug!(shard = record.meta.shard, "shard stored");
        records.push(record);
    }
    Ok((records, busy))
}
