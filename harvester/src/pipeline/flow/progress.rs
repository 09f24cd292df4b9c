//! Progress of a run: a bar on a terminal, JSON lines for a supervising process.
//!
//! A [`ProgressEvent`] line goes to stderr after every forward batch (the worker protocol's
//! format, which the API and the operator read).

use std::io::{IsTerminal, Write};
use std::time::Instant;

use harvest_core::worker::{Phase, ProgressEvent};
use indicatif::{ProgressBar, ProgressStyle};

/// How progress is shown.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
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

impl std::str::FromStr for ProgressMode {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(Self::Auto),
            "bar" => Ok(Self::Bar),
            "json" => Ok(Self::Json),
            "off" => Ok(Self::Off),
            other => Err(format!(
                "unknown progress mode {other:?}: use auto, bar, json or off"
            )),
        }
    }
}

/// A progress reporter, shared by the forward thread.
#[derive(Debug)]
pub struct Progress {
    bar: Option<ProgressBar>,
    json: bool,
    total: usize,
    start: Instant,
    /// When the weights were in, from which tokens/s counts.
    running_since: std::sync::OnceLock<Instant>,
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
            running_since: std::sync::OnceLock::new(),
        }
    }

    /// Reports `prompts_done` of the total and `tokens_done` tokens run in this process.
    pub fn update(&self, prompts_done: usize, tokens_done: u64) {
        let elapsed = self.start.elapsed().as_secs_f64();
        let since = self.running_since.get().copied().unwrap_or(self.start);
        let running = since.elapsed().as_secs_f64();
        let rate = if running > 0.0 {
            tokens_done as f64 / running
        } else {
            0.0
        };
        if let Some(bar) = &self.bar {
            bar.set_position(prompts_done as u64);
            bar.set_message(format!("{rate:.0} tokens/s"));
        }
        if self.json {
            let event = ProgressEvent {
                phase: Phase::Running,
                bytes_loaded: None,
                bytes_total: None,
                prompts_done,
                prompts_total: self.total,
                tokens_done,
                tokens_per_s: (rate * 10.0).round() / 10.0,
                elapsed_s: (elapsed * 100.0).round() / 100.0,
            };
            let _ = writeln!(std::io::stderr().lock(), "{}", event.to_line());
        }
    }

    /// Marks the end of loading: tokens/s counts from here.
    pub fn running(&self) {
        let _ = self.running_since.set(Instant::now());
    }

    /// Whether the weights are in and the forward pass has begun.
    pub fn is_running(&self) -> bool {
        self.running_since.get().is_some()
    }

    /// Reports `loaded` of `total` weight bytes read, before the first batch.
    pub fn loading(&self, loaded: u64, total: u64) {
        const GB: f64 = 1e9;
        if let Some(bar) = &self.bar {
            bar.set_message(format!(
                "loading weights {:.1}/{:.1} GB",
                loaded as f64 / GB,
                total as f64 / GB
            ));
        }
        if self.json {
            let event = ProgressEvent {
                phase: Phase::Loading,
                bytes_loaded: Some(loaded),
                bytes_total: Some(total),
                prompts_done: 0,
                prompts_total: self.total,
                tokens_done: 0,
                tokens_per_s: 0.0,
                elapsed_s: (self.start.elapsed().as_secs_f64() * 100.0).round() / 100.0,
            };
            let _ = writeln!(std::io::stderr().lock(), "{}", event.to_line());
        }
    }

    /// Clears the bar.
    pub fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}
