//! The forward pass split across pipeline stages (`--pipeline-stages N`): each stage thread
//! owns one contiguous range of the model's blocks (on its own device), and batches flow through
//! bounded channels, so while stage 2 runs batch k, stage 1 runs batch k + 1.
//!
//! ```text
//! feeder ──STAGE_QUEUE──► stage 1 ──STAGE_QUEUE──► … stage N ──FORWARD_QUEUE──► assembler
//!   ▲───────────── spare batch and residual buffers (SPARE_FLIGHTS) ──────┘
//! ```
//! A batch carries its residual stream from stage to stage and its capture buffer, into which
//! each stage writes the kept sites of its own blocks, so captures reach the assembler whole
//! and in order. The batches are the ones a single-device run makes (batches never span
//! shards), and each block runs the same arithmetic wherever it is, so any number of stages
//! writes the same bytes.

use std::collections::BTreeMap;
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
use std::time::Instant;

use crate::backend::{Batch, Captured, Held, RouteShape, Stage};
use crate::error::{Error, Result};
use crate::pipeline::Job;
use crate::pipeline::assembly::shard::ShardRecord;
use crate::pipeline::flow::handoff::ForwardOutput;
use crate::pipeline::flow::progress::Progress;

/// Batches waiting between two consecutive stages.
pub const STAGE_QUEUE: usize = 1;
/// Batch and residual buffers in circulation, beyond one per stage and queue slot.
const SPARE_FLIGHTS: usize = 2;

/// The capture buffers a staged run needs in circulation: one per batch that can be in a stage
/// or a queue between stages, on top of the single-device pool.
pub fn capture_pool(stages: usize) -> usize {
    crate::pipeline::CAPTURE_POOL + stages * (1 + STAGE_QUEUE)
}

/// One batch on its way through the stages.
struct Flight {
    batch: Batch,
    x: Vec<f32>,
    prompts: Vec<usize>,
    captured: Captured,
}

/// What a staged forward pass needs besides the job: the stages in order, and the capture
/// buffer's shape.
pub struct Staged {
    /// One per running stage, in block order.
    pub stages: Vec<Box<dyn Stage>>,
    /// Kept sites, kept layers and values per token.
    pub capture: (usize, usize, usize),
    /// How the stages hold what they capture.
    pub held: Held,
    /// The expert choices kept of each batch.
    pub routes: RouteShape,
}

/// Runs every batch of the shards not yet done through the stages, sending each batch's
/// captures to the assembler (`tx`) in order. Returns the wall time and the tokens run.
pub(in crate::pipeline) fn forward(
    job: &Job<'_>,
    staged: Staged,
    resumed: &BTreeMap<usize, ShardRecord>,
    tx: SyncSender<ForwardOutput>,
    free: Receiver<Captured>,
    progress: &Progress,
) -> Result<(f64, u64)> {
    let start = Instant::now();
    let done_before = job.prompts_resumed(resumed);
    let capture = (staged.held, staged.capture, staged.routes);
    let ends = Ends {
        tx,
        progress,
        done_before,
    };
    let tokens = run_chain(staged.stages, ends, |first, spare| {
        feed(job, resumed, capture, first, &free, spare)
    })?;
    Ok((start.elapsed().as_secs_f64(), tokens))
}

/// Where the chain's output goes, and how progress counts.
struct Ends<'a> {
    tx: SyncSender<ForwardOutput>,
    progress: &'a Progress,
    /// Prompts done before this run (resumed shards).
    done_before: usize,
}

/// Connects the stages with bounded channels, each on its own thread, and runs `feed` on this
/// one to fill the first; the last hands each batch to `ends.tx`. Returns the tokens run, or the
/// error of whichever part failed on its own.
fn run_chain(
    stages: Vec<Box<dyn Stage>>,
    ends: Ends<'_>,
    feed: impl FnOnce(&SyncSender<Flight>, &Receiver<(Batch, Vec<f32>)>) -> Result<()>,
) -> Result<u64> {
    let count = stages.len();
    let spares = count * (1 + STAGE_QUEUE) + SPARE_FLIGHTS;
    let (spare_tx, spare_rx) = sync_channel::<(Batch, Vec<f32>)>(spares);
    for _ in 0..spares {
        let _ = spare_tx.try_send((Batch::default(), Vec::new()));
    }
    std::thread::scope(|scope| {
        let (first_tx, first_rx) = sync_channel::<Flight>(STAGE_QUEUE);
        let mut input = Some(first_rx);
        let mut last = Some(ends);
        let mut handles = Vec::with_capacity(count);
        for (i, mut stage) in stages.into_iter().enumerate() {
            let Some(rx) = input.take() else { break };
            let next = match last.take_if(|_| i + 1 == count) {
                Some(ends) => Next::Assembler {
                    tx: ends.tx,
                    spare: spare_tx.clone(),
                    progress: ends.progress,
                    done: (ends.done_before, 0),
                },
                None => {
                    let (next_tx, next_rx) = sync_channel::<Flight>(STAGE_QUEUE);
                    input = Some(next_rx);
                    Next::Stage(next_tx)
                }
            };
            handles.push(scope.spawn(move || run_stage(&mut *stage, rx, next)));
        }
        drop(spare_tx);
        let fed = feed(&first_tx, &spare_rx);
        drop(first_tx);
        let mut errors: Vec<Option<Error>> = vec![fed.err()];
        let mut tokens = 0;
        for handle in handles {
            match handle.join() {
                Ok(Ok(n)) => tokens = tokens.max(n),
                Ok(Err(e)) => errors.push(Some(e)),
                Err(_) => errors.push(Some(Error::ThreadLost {
                    thread: "pipeline stage",
                })),
            }
        }
        if errors.iter().any(Option::is_some) {
            return Err(crate::pipeline::flow::handoff::root_cause(errors));
        }
        Ok(tokens)
    })
}

/// Where a stage sends a batch it has run.
enum Next<'a> {
    /// The next stage.
    Stage(SyncSender<Flight>),
    /// The last stage hands the captures to the assembler and the buffers back to the feeder.
    Assembler {
        tx: SyncSender<ForwardOutput>,
        spare: SyncSender<(Batch, Vec<f32>)>,
        progress: &'a Progress,
        /// Prompts and tokens done so far.
        done: (usize, u64),
    },
}

/// One stage's loop: run each arriving batch and pass it on, until the feeder is done (or a
/// neighbour has stopped). Returns the tokens it ran.
fn run_stage(stage: &mut dyn Stage, input: Receiver<Flight>, mut next: Next<'_>) -> Result<u64> {
    let lost = || Error::ThreadLost { thread: "assemble" };
    let mut tokens = 0u64;
    for mut flight in input {
        stage.forward(&flight.batch, &mut flight.x, &mut flight.captured)?;
        tokens += flight.batch.num_tokens() as u64;
        match &mut next {
            Next::Stage(tx) => tx.send(flight).map_err(|_| lost())?,
            Next::Assembler {
                tx,
                spare,
                progress,
                done,
            } => {
                let Flight {
                    batch,
                    x,
                    prompts,
                    captured,
                } = flight;
                done.0 += prompts.len();
                done.1 += batch.num_tokens() as u64;
                tx.send(ForwardOutput { prompts, captured })
                    .map_err(|_| lost())?;
                let _ = spare.try_send((batch, x));
                progress.update(done.0, done.1);
            }
        }
    }
    Ok(tokens)
}

/// Packs the batches of every shard not yet done ([`Job::batches`], as a single-device run
/// does) and sends each into the first stage with a capture buffer sized for it.
fn feed(
    job: &Job<'_>,
    resumed: &BTreeMap<usize, ShardRecord>,
    (held, (sites, layers, width), routes): (Held, (usize, usize, usize), RouteShape),
    first: &SyncSender<Flight>,
    free: &Receiver<Captured>,
    spare: &Receiver<(Batch, Vec<f32>)>,
) -> Result<()> {
    // A closed channel means a stage has stopped; its own error is the one reported.
    let lost = || Error::ThreadLost {
        thread: "pipeline stage",
    };
    for prompts in job.batches(resumed) {
        let (mut batch, x) = spare.recv().map_err(|_| lost())?;
        batch.clear();
        for index in prompts.clone() {
            batch.push(&job.encoded[index].ids);
        }
        let mut captured = free.recv().map_err(|_| lost())?;
        captured.reset_held(held, (sites, layers, batch.num_tokens(), width));
        captured.routes.reset(routes, batch.num_tokens());
        let flight = Flight {
            batch,
            x,
            prompts: prompts.collect(),
            captured,
        };
        first.send(flight).map_err(|_| lost())?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pipeline::progress::ProgressMode;

    /// A stage that adds `add` to every residual value and records it in slot `slot`, failing
    /// on batch `fail_at` if given.
    struct Adder {
        add: f32,
        slot: usize,
        seen: usize,
        fail_at: Option<usize>,
    }

    impl Stage for Adder {
        fn forward(&mut self, batch: &Batch, x: &mut Vec<f32>, out: &mut Captured) -> Result<()> {
            if self.fail_at == Some(self.seen) {
                return Err(Error::InvalidBatch {
                    reason: format!("stage {} broke", self.slot),
                });
            }
            self.seen += 1;
            if self.slot == 0 {
                x.clear();
                x.extend(batch.input_ids.iter().map(|&id| id as f32));
            }
            for v in x.iter_mut() {
                *v += self.add;
            }
            out.layer_mut(self.slot).copy_from_slice(x);
            Ok(())
        }
    }

    fn adders(fail: Option<(usize, usize)>) -> Vec<Box<dyn Stage>> {
        (0..3)
            .map(|slot| {
                let fail_at = fail.and_then(|(stage, at)| (stage == slot).then_some(at));
                Box::new(Adder {
                    add: 10f32.powi(slot as i32),
                    slot,
                    seen: 0,
                    fail_at,
                }) as Box<dyn Stage>
            })
            .collect()
    }

    /// One output as the assembler would get it: its prompts and captured values.
    type Arrived = (Vec<usize>, Vec<f32>);

    /// Sends `batches` one-token batches (ids 0, 1, …) through three adders; returns the chain's
    /// result and each output's prompts and captured rows, in arrival order.
    fn run_adders(fail: Option<(usize, usize)>, batches: u32) -> (Result<u64>, Vec<Arrived>) {
        let progress = Progress::new(ProgressMode::Off, batches as usize);
        let (tx, rx) = sync_channel::<ForwardOutput>(crate::pipeline::FORWARD_QUEUE);
        let collector = std::thread::spawn(move || {
            rx.into_iter()
                .map(|o| (o.prompts, o.captured.data))
                .collect::<Vec<_>>()
        });
        let ends = Ends {
            tx,
            progress: &progress,
            done_before: 0,
        };
        let result = run_chain(adders(fail), ends, |first, spare| {
            for id in 0..batches {
                let (mut batch, x) = spare
                    .recv()
                    .map_err(|_| Error::ThreadLost { thread: "t" })?;
                batch.clear();
                batch.push(&[id]);
                let mut captured = Captured::default();
                captured.reset(1, 3, 1, 1);
                let flight = Flight {
                    batch,
                    x,
                    prompts: vec![id as usize],
                    captured,
                };
                first
                    .send(flight)
                    .map_err(|_| Error::ThreadLost { thread: "t" })?;
            }
            Ok(())
        });
        (result, collector.join().unwrap())
    }

    #[test]
    fn every_batch_passes_every_stage_in_order_and_keeps_each_stages_rows() {
        let (result, outputs) = run_adders(None, 20);
        assert_eq!(result.unwrap(), 20);
        assert_eq!(outputs.len(), 20);
        for (i, (prompts, rows)) in outputs.iter().enumerate() {
            let id = i as f32;
            assert_eq!(prompts, &[i]);
            assert_eq!(rows, &[id + 1.0, id + 11.0, id + 111.0]);
        }
    }

    #[test]
    fn a_stage_failing_mid_run_stops_the_chain_with_its_own_error() {
        for stage in 0..3 {
            let (result, outputs) = run_adders(Some((stage, 5)), 40);
            let error = result.unwrap_err().to_string();
            assert!(error.contains(&format!("stage {stage} broke")), "{error}");
            assert!(outputs.len() <= 5, "{} batches got through", outputs.len());
        }
    }
}
