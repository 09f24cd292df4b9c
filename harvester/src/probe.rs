//! `harvester probe`: capture one prompt and summarise each kept layer, a quick way to see that a
//! checkpoint loads, tokenizes and runs.

use std::fmt;
use std::path::Path;

use harvest_core::LayerSelection;

use crate::backend::cpu::CpuBackend;
use crate::backend::{Backend, Batch, Captured};
use crate::error::Result;
use crate::tokenizer::PromptTokenizer;

/// What `probe` found.
#[derive(Debug, Clone)]
pub struct ProbeReport {
    /// The model's architecture name.
    pub architecture: &'static str,
    /// Decoder blocks in the model.
    pub num_layers: usize,
    /// Hidden size.
    pub hidden: usize,
    /// The ids that ran.
    pub ids: Vec<u32>,
    /// Length before truncation, if truncated.
    pub truncated_from: Option<usize>,
    /// Per kept layer: index, mean, min and max token L2 norm.
    pub layers: Vec<(usize, f64, f64, f64)>,
}

/// Tokenizes `text`, runs it through the CPU backend and summarises the kept layers.
pub fn run(
    model: &Path,
    text: &str,
    layers: &LayerSelection,
    add_special_tokens: bool,
) -> Result<ProbeReport> {
    let mut backend = CpuBackend::load(model, layers, harvest_core::Sites::default(), None)?;
    let config = backend.config().clone();
    let tokenizer = PromptTokenizer::from_dir(model, config.max_position_embeddings)?;
    let encoded = tokenizer.encode(0, text, add_special_tokens)?;
    let kept = backend.spec().layers.as_slice().to_vec();
    let mut out = Captured::default();
    backend.capture(
        &Batch::from_sequences(std::slice::from_ref(&encoded.ids)),
        &mut out,
    )?;
    let summary = kept
        .iter()
        .enumerate()
        .map(|(i, &layer)| {
            let norms: Vec<f64> = out
                .layer(i)
                .chunks_exact(out.width)
                .map(|row| {
                    row.iter()
                        .map(|&v| f64::from(v).powi(2))
                        .sum::<f64>()
                        .sqrt()
                })
                .collect();
            let mean = norms.iter().sum::<f64>() / norms.len() as f64;
            let min = norms.iter().copied().fold(f64::INFINITY, f64::min);
            let max = norms.iter().copied().fold(0.0, f64::max);
            (layer, mean, min, max)
        })
        .collect();
    Ok(ProbeReport {
        architecture: config.architecture.hf_name(),
        num_layers: config.num_layers,
        hidden: config.hidden_size,
        ids: encoded.ids,
        truncated_from: encoded.truncated_from,
        layers: summary,
    })
}

impl fmt::Display for ProbeReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "model: {}, {} blocks, hidden {}",
            self.architecture, self.num_layers, self.hidden
        )?;
        write!(f, "tokens: {} {:?}", self.ids.len(), self.ids)?;
        if let Some(from) = self.truncated_from {
            write!(f, " (truncated from {from})")?;
        }
        writeln!(f)?;
        writeln!(
            f,
            "captured [{}, {}, {}] f32",
            self.layers.len(),
            self.ids.len(),
            self.hidden
        )?;
        writeln!(
            f,
            "{:>5} {:>12} {:>12} {:>12}",
            "layer", "mean ‖x‖", "min ‖x‖", "max ‖x‖"
        )?;
        for (layer, mean, min, max) in &self.layers {
            writeln!(f, "{layer:>5} {mean:>12.3} {min:>12.3} {max:>12.3}")?;
        }
        Ok(())
    }
}
