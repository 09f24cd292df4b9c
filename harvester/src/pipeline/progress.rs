//! Progress of a run: a bar on a terminal, JSON lines for a supervising process.
//!
//! A JSON line goes to stderr after every forward batch:
//! `{"event":"progress","prompts_done":64,"prompts_total":4096,"tokens_done":16384,"tokens_per_s":480.2,"elapsed_s":34.1}`.
//! `prompts_done` counts prompts of shards completed by an earlier, resumed run too.

use std::io::{IsTerminal, Write};
use std::time::Instant;

use indicatif::{ProgressBar, ProgressStyle};

/// How progress is shown.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum ProgressMode {
    /// A bar when stderr is a terminal, JSON lines otherwise.
    #[default]
    Auto,
    /// Always a bar.
    Bar,
    /// Always JSON lines.
    Json,
    /// Nothing.
    Off,
}

/// A progress reporter, shared by the forward thread.
#[derive(Debug)]
pub struct Progress {
    bar: Option<ProgressBar>,
    json: bool,
    total: usize,
    start: Instant,
}

impl Progress {
    /// Starts reporting on `total` prompts.
    pub fn new(mode: ProgressMode, total: usize) -> Self {
        let mode = match mode {
            ProgressMode::Auto if std::io::stderr().is_terminal() => ProgressMode::Bar,
            ProgressMode::Auto => ProgressMode::Json,
            other => other,
        };
        let bar = (mode == ProgressMode::Bar).then(|| {
            let bar = ProgressBar::new(total as u64);
            let style =
                ProgressStyle::with_template("{bar:40} {pos}/{len} prompts, {msg}, ETA {eta}")
                    .unwrap_or_else(|_| ProgressStyle::default_bar());
            bar.set_style(style);
            bar
        });
        Self {
            bar,
            json: mode == ProgressMode::Json,
            total,
            start: Instant::now(),
        }
    }

    /// Reports `prompts_done` of the total and `tokens_done` tokens run in this process.
    pub fn update(&self, prompts_done: usize, tokens_done: u64) {
        let elapsed = self.start.elapsed().as_secs_f64();
        let rate = if elapsed > 0.0 {
            tokens_done as f64 / elapsed
        } else {
            0.0
        };
        if let Some(bar) = &self.bar {
            bar.set_position(prompts_done as u64);
            bar.set_message(format!("{rate:.0} tokens/s"));
        }
        if self.json {
            let line = serde_json::json!({
                "event": "progress", "prompts_done": prompts_done, "prompts_total": self.total,
                "tokens_done": tokens_done, "tokens_per_s": (rate * 10.0).round() / 10.0,
                "elapsed_s": (elapsed * 100.0).round() / 100.0,
            });
            let _ = writeln!(std::io::stderr().lock(), "{line}");
        }
    }

    /// Clears the bar.
    pub fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}
