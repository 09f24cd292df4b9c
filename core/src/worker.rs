//! The worker protocol: everything that crosses the process boundary between a supervisor (the
//! API's embedded worker pool, the operator's Pods) and a `harvester run` process.
//!
//! ```text
//! supervisor ── plan.json (plan::RawPlan) + prompts.jsonl (write_prompts_jsonl) ──► harvester
//!            ◄── stderr: ProgressEvent lines, one per forward batch
//!            ◄── exit status (ExitStatus) + termination message (Termination)
//!            ◄── result.json beside the outputs (RunResult)
//! ```
//! Both sides read and write these types only: no side parses the other's JSON by hand, and
//! no exit code is written as a bare number anywhere else.

use serde::{Deserialize, Serialize};

use crate::format::Contents;

pub use crate::format::RESULT_FILE;
/// Most bytes Kubernetes keeps of a termination message.
pub const TERMINATION_MESSAGE_LIMIT: usize = 4096;

/// The class of a failed run, which tells a supervisor whether a retry can help.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorKind {
    /// The plan or its inputs are wrong: the same run fails again.
    BadInput,
    /// Storage, disk or device trouble: a retry elsewhere or later may succeed (and resumes).
    Infrastructure,
    /// A bug in the harvester.
    Internal,
}

/// How a `harvester run` process ended: the one table between exit codes and meanings.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ExitStatus {
    /// Exit 0: the outputs are committed.
    Success,
    /// A documented failure: 2 bad input, 3 infrastructure, 70 internal.
    Failed(ErrorKind),
    /// Any other code: a crash or a signal, not a documented answer.
    Unexpected(i32),
}

impl ErrorKind {
    /// The stable name written into termination messages.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::BadInput => "bad_input",
            Self::Infrastructure => "infrastructure",
            Self::Internal => "internal",
        }
    }
}

impl ExitStatus {
    /// Reads a process exit code.
    pub fn from_code(code: i32) -> Self {
        match code {
            0 => Self::Success,
            2 => Self::Failed(ErrorKind::BadInput),
            3 => Self::Failed(ErrorKind::Infrastructure),
            70 => Self::Failed(ErrorKind::Internal),
            other => Self::Unexpected(other),
        }
    }

    /// The process exit code.
    pub fn code(self) -> i32 {
        match self {
            Self::Success => 0,
            Self::Failed(ErrorKind::BadInput) => 2,
            Self::Failed(ErrorKind::Infrastructure) => 3,
            Self::Failed(ErrorKind::Internal) => 70,
            Self::Unexpected(code) => code,
        }
    }
}

impl From<ErrorKind> for ExitStatus {
    fn from(kind: ErrorKind) -> Self {
        Self::Failed(kind)
    }
}

/// Who is to blame for a failed attempt: the one rule both backends retry by. The input: the
/// same run fails again, so the job fails now. The job (a crash, out of memory): retried,
/// counted against the job's attempts (`backoffLimit` on Kubernetes). The infrastructure
/// (storage, disk, device, a lost node): retried, and not counted where the backend counts it
/// apart. A rerun resumes from the shards already recorded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Blame {
    /// A crash or out of memory.
    Job,
    /// Storage, disk, device, or the cluster.
    Infrastructure,
    /// The plan or its inputs.
    Input,
}

impl Blame {
    /// The blame for a harvester that ended with exit `code` ([`ExitStatus`]); `None` is a
    /// process killed by a signal, the job's (an OOM kill, say) unless the supervisor knows
    /// better (an eviction).
    pub fn of_exit(code: Option<i32>) -> Self {
        match code.map(ExitStatus::from_code) {
            Some(ExitStatus::Failed(ErrorKind::BadInput)) => Self::Input,
            Some(ExitStatus::Failed(ErrorKind::Infrastructure)) => Self::Infrastructure,
            Some(
                ExitStatus::Success
                | ExitStatus::Failed(ErrorKind::Internal)
                | ExitStatus::Unexpected(_),
            )
            | None => Self::Job,
        }
    }

    /// Whether another attempt can help.
    pub fn retried(self) -> bool {
        self != Self::Input
    }
}

/// Seconds spent per stage. Stages overlap, so they need not add up to the wall time.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Timings {
    /// Reading inputs, tokenizer and weights.
    #[serde(default)]
    pub load_s: f64,
    /// Forward passes.
    #[serde(default)]
    pub forward_s: f64,
    /// Assembling and serialising shards, statistics and manifest.
    #[serde(default)]
    pub save_s: f64,
    /// Writing objects to the store.
    #[serde(default)]
    pub upload_s: f64,
}

/// `result.json`, the same JSON on stdout, and the termination message of a successful run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunResult {
    /// Shards in the output.
    pub n_shards: usize,
    /// Prompts harvested.
    #[serde(default)]
    pub n_prompts: usize,
    /// Kept layers, ascending.
    pub layer_indices: Vec<usize>,
    /// Tokens run, over all prompts.
    pub tokens: u64,
    /// Bytes of shards, statistics and manifest.
    pub bytes_written: u64,
    /// Activations or projections.
    pub contents: Contents,
    /// Per-stage seconds of this process.
    #[serde(default)]
    pub timings: Timings,
    /// Where the files are.
    pub output: String,
    /// Shards found complete from an earlier run and not recomputed.
    #[serde(default)]
    pub resumed_shards: usize,
    /// `by_prompt`, or `shuffled`: then `n_shards` counts training files.
    #[serde(default, skip_serializing_if = "is_by_prompt")]
    pub layout: crate::layout::LayoutName,
    /// Where the forward pass ran (`cpu`, `cuda:N`, `cuda-replay`); absent from results written
    /// before it was recorded, and from one read back from a manifest.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device: Option<String>,
    /// Why `--device auto` chose it: the GPU's name, compute capability, driver and libraries,
    /// or why the CPU.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_reason: Option<String>,
}

fn is_by_prompt(layout: &crate::layout::LayoutName) -> bool {
    *layout == crate::layout::LayoutName::ByPrompt
}

/// The termination message of a failed run.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunFailure {
    /// What went wrong, for people.
    pub error: String,
    /// The exit code the process ended with.
    pub exit_code: i32,
    /// The class of the failure.
    pub kind: ErrorKind,
}

/// What `harvester run --part I/N` reports (stdout and termination message): its shards are
/// written and recorded, and `harvester finalize` closes the job once every part has run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PartResult {
    /// `INDEX/COUNT`.
    pub part: String,
    /// Its shards, `[first, end)`.
    pub shards: [usize; 2],
    /// Shards this process wrote.
    pub written: usize,
    /// Shards an earlier run of the part had written.
    pub resumed: usize,
    /// Tokens this process ran.
    pub tokens: u64,
}

/// What a run leaves in its termination log (at most [`TERMINATION_MESSAGE_LIMIT`] bytes).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Termination {
    /// The result summary.
    Done(RunResult),
    /// A part's summary.
    Part(PartResult),
    /// Why it failed.
    Failed(RunFailure),
}

impl RunFailure {
    /// A failure of `kind`, its message cut so that the whole termination message fits.
    pub fn new(kind: ErrorKind, error: &str) -> Self {
        Self {
            error: cut(error, TERMINATION_MESSAGE_LIMIT - 200).to_owned(),
            exit_code: ExitStatus::Failed(kind).code(),
            kind,
        }
    }
}

impl Termination {
    /// The message as written to the termination log, cut to the Kubernetes limit on a
    /// character boundary.
    pub fn to_message(&self) -> String {
        let text = serde_json::to_string(self).unwrap_or_default();
        cut(&text, TERMINATION_MESSAGE_LIMIT).to_owned()
    }

    /// The exit status a process that wrote this message ends with.
    pub fn exit_status(&self) -> ExitStatus {
        match self {
            Self::Done(_) | Self::Part(_) => ExitStatus::Success,
            Self::Failed(failure) => ExitStatus::from_code(failure.exit_code),
        }
    }

    /// Reads a termination message; `None` when it is not one (a kubelet's log fallback, say).
    pub fn parse(message: &str) -> Option<Self> {
        serde_json::from_str(message.trim()).ok()
    }
}

fn cut(text: &str, limit: usize) -> &str {
    let mut end = text.len().min(limit);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

/// One progress line on the harvester's stderr, after every forward batch:
/// `{"event":"progress","prompts_done":64,"prompts_total":4096,"tokens_done":16384,"tokens_per_s":480.2,"elapsed_s":34.1}`.
/// `prompts_done` counts prompts of shards completed by an earlier, resumed run too. While the
/// weights are read, before the first batch, lines say `"phase":"loading"` with the bytes read
/// so far and in all (`bytes_loaded`, `bytes_total`); lines without a phase are `running`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", rename = "progress")]
pub struct ProgressEvent {
    /// Loading the weights, or running batches.
    #[serde(default, skip_serializing_if = "Phase::is_running")]
    pub phase: Phase,
    /// Weight bytes read so far, while loading.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bytes_loaded: Option<u64>,
    /// Weight bytes to read, while loading.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bytes_total: Option<u64>,
    /// Prompts whose activations are computed.
    pub prompts_done: usize,
    /// Prompts in the job.
    pub prompts_total: usize,
    /// Tokens run by this process.
    pub tokens_done: u64,
    /// Tokens per second of this process, one decimal.
    #[serde(default)]
    pub tokens_per_s: f64,
    /// Seconds since this process started reporting, two decimals.
    #[serde(default)]
    pub elapsed_s: f64,
}

/// What a worker is doing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Phase {
    /// Reading the model's weights.
    Loading,
    /// Running the forward pass.
    #[default]
    Running,
}

impl Phase {
    /// The name the progress line and the REST `progress.phase` use.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Loading => "loading",
            Self::Running => "running",
        }
    }

    fn is_running(&self) -> bool {
        *self == Self::Running
    }
}

impl ProgressEvent {
    /// The event as one line of JSON (no newline).
    pub fn to_line(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }

    /// Reads one line; `None` for any other line (logs, warnings).
    pub fn parse_line(line: &str) -> Option<Self> {
        let line = line.trim();
        if !line.starts_with('{') {
            return None;
        }
        serde_json::from_str(line).ok()
    }

    /// The newest progress line in a log.
    pub fn latest_in(log: &str) -> Option<Self> {
        log.lines().rev().find_map(Self::parse_line)
    }
}

/// One line of a prompts JSONL file.
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct PromptLine<'a> {
    #[serde(borrow)]
    text: std::borrow::Cow<'a, str>,
}

/// Why a prompts JSONL file cannot be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("line {line}: {reason} (each line must be {{\"text\": \"...\"}})")]
pub struct PromptsLineError {
    /// The 1-based line number.
    pub line: usize,
    /// What is wrong with it.
    pub reason: String,
}

/// The prompts file a supervisor hands a worker: one `{"text": ...}` object per line.
pub fn write_prompts_jsonl<S: AsRef<str>>(prompts: &[S]) -> String {
    let mut out = String::new();
    for prompt in prompts {
        let line = PromptLine {
            text: std::borrow::Cow::Borrowed(prompt.as_ref()),
        };
        out.push_str(&serde_json::to_string(&line).unwrap_or_default());
        out.push('\n');
    }
    out
}

/// The inputs file of a job of conversations: one `{"messages": [...], "add_generation_prompt":
/// ...}` object per line, which the worker renders with the model's chat template.
pub fn write_conversations_jsonl(conversations: &[crate::chat::Conversation]) -> String {
    let mut out = String::new();
    for conversation in conversations {
        out.push_str(&serde_json::to_string(conversation).unwrap_or_default());
        out.push('\n');
    }
    out
}

/// Reads a prompts JSONL file; blank lines are skipped, and an error names its line.
pub fn read_prompts_jsonl(text: &str) -> Result<Vec<String>, PromptsLineError> {
    text.lines()
        .enumerate()
        .filter(|(_, line)| !line.trim().is_empty())
        .map(|(n, line)| {
            serde_json::from_str::<PromptLine<'_>>(line)
                .map(|l| l.text.into_owned())
                .map_err(|e| PromptsLineError {
                    line: n + 1,
                    reason: e.to_string(),
                })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_refused_input_is_not_retried_and_a_kill_is_the_jobs() {
        assert_eq!(Blame::of_exit(Some(2)), Blame::Input);
        assert_eq!(Blame::of_exit(Some(3)), Blame::Infrastructure);
        for crash in [Some(70), Some(101), Some(137), None] {
            assert_eq!(Blame::of_exit(crash), Blame::Job, "{crash:?}");
        }
        assert!(!Blame::Input.retried());
        assert!(Blame::Job.retried() && Blame::Infrastructure.retried());
    }

    fn result() -> RunResult {
        RunResult {
            n_shards: 2,
            n_prompts: 40,
            layer_indices: vec![7, 15],
            tokens: 900,
            bytes_written: 12345,
            contents: Contents::Projections,
            timings: Timings {
                load_s: 1.5,
                ..Timings::default()
            },
            output: "s3://b/p".into(),
            resumed_shards: 1,
            layout: crate::layout::LayoutName::ByPrompt,
            device: Some("cuda:0".into()),
            device_reason: None,
        }
    }

    #[test]
    fn every_exit_code_maps_to_one_status_and_back() {
        for code in [0, 2, 3, 70, 1, 137] {
            assert_eq!(ExitStatus::from_code(code).code(), code);
        }
        assert_eq!(
            ExitStatus::from_code(3),
            ExitStatus::Failed(ErrorKind::Infrastructure)
        );
        assert_eq!(ExitStatus::from_code(137), ExitStatus::Unexpected(137));
        assert_eq!(ExitStatus::from(ErrorKind::BadInput).code(), 2);
    }

    #[test]
    fn a_termination_message_reads_back_as_what_was_written() {
        let done = Termination::Done(result());
        assert_eq!(Termination::parse(&done.to_message()), Some(done));
        let failed = Termination::Failed(RunFailure::new(ErrorKind::BadInput, "no such layer"));
        let message = failed.to_message();
        assert!(message.contains(r#""exit_code":2"#), "{message}");
        assert!(message.contains(r#""kind":"bad_input""#), "{message}");
        assert_eq!(Termination::parse(&message), Some(failed));
        assert_eq!(Termination::parse("panicked at src/main.rs"), None);
    }

    #[test]
    fn a_long_error_is_cut_to_the_kubernetes_limit_on_a_char_boundary() {
        let failed = Termination::Failed(RunFailure::new(ErrorKind::Internal, &"é".repeat(5000)));
        let message = failed.to_message();
        assert!(message.len() <= TERMINATION_MESSAGE_LIMIT);
        let Some(Termination::Failed(back)) = Termination::parse(&message) else {
            panic!("{message}");
        };
        assert_eq!(back.exit_code, 70);
    }

    #[test]
    fn the_newest_progress_line_of_a_log_is_found_among_other_lines() {
        let first = ProgressEvent {
            phase: Phase::Running,
            bytes_loaded: None,
            bytes_total: None,
            prompts_done: 4,
            prompts_total: 8,
            tokens_done: 100,
            tokens_per_s: 50.5,
            elapsed_s: 2.0,
        };
        let second = ProgressEvent {
            prompts_done: 8,
            ..first.clone()
        };
        let log = format!(
            "{}\n2026-01-01 WARN something\n{}\n{{\"event\":\"other\"}}\n",
            first.to_line(),
            second.to_line()
        );
        assert!(
            first
                .to_line()
                .starts_with(r#"{"event":"progress","prompts_done":4"#)
        );
        assert_eq!(ProgressEvent::latest_in(&log), Some(second));
        assert_eq!(ProgressEvent::latest_in("no json here"), None);
    }

    #[test]
    fn a_loading_line_carries_its_bytes_and_an_older_line_reads_as_running() {
        let loading = ProgressEvent {
            phase: Phase::Loading,
            bytes_loaded: Some(1 << 30),
            bytes_total: Some(3 << 30),
            prompts_done: 0,
            prompts_total: 8,
            tokens_done: 0,
            tokens_per_s: 0.0,
            elapsed_s: 1.5,
        };
        let line = loading.to_line();
        assert!(
            line.contains(r#""phase":"loading","bytes_loaded":1073741824"#),
            "{line}"
        );
        assert_eq!(ProgressEvent::parse_line(&line), Some(loading));
        let old = r#"{"event":"progress","prompts_done":1,"prompts_total":2,"tokens_done":5}"#;
        let parsed = ProgressEvent::parse_line(old).unwrap();
        assert_eq!((parsed.phase, parsed.bytes_total), (Phase::Running, None));
    }

    #[test]
    fn prompts_round_trip_through_jsonl_with_newlines_and_quotes() {
        let prompts = ["a \"quoted\"\nline", "", "ünïcode"];
        let text = write_prompts_jsonl(&prompts);
        assert_eq!(text.lines().count(), 3);
        assert_eq!(read_prompts_jsonl(&text).unwrap(), prompts);
    }

    #[test]
    fn a_malformed_prompts_line_is_named_by_number() {
        let error = read_prompts_jsonl("{\"text\": \"a\"}\n\n{\"txt\": \"b\"}\n").unwrap_err();
        assert_eq!(error.line, 3);
        assert!(error.to_string().contains("line 3"), "{error}");
    }
}
