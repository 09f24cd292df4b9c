//! Shared helpers for the harvester's integration tests: reference fixtures, tolerance checks,
//! and a seeded random-weight checkpoint generator.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use harvest_core::LayerSelection;
use harvester::backend::cpu::CpuBackend;
use harvester::backend::cpu::level::{LEVEL_VARIABLE, Level};
use harvester::backend::{Backend, Batch, Captured};
pub use harvester::synth::Shape;
use safetensors::{Dtype, SafeTensors};

/// Sets the CPU kernels' level from `HARVEST_CPU_LEVEL`, as the harvester's `main` does, so
/// that scripts/test.sh's run at each level tests that level. Every helper that leads to a
/// CPU backend calls it; the first call decides.
pub fn cpu_level() -> Level {
    let forced = std::env::var(LEVEL_VARIABLE).ok();
    let _ = Level::configure(forced.as_deref());
    Level::current()
}

pub fn fixtures() -> PathBuf {
    cpu_level();
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

/// The Python with numpy, safetensors, tokenizers and gguf that scripts/test.sh installs
/// (`HARVEST_PYTHON`, else the cache's tools venv).
pub fn python() -> PathBuf {
    let python = std::env::var_os("HARVEST_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap()).join(".cache/harvest/tools/bin/python")
        });
    assert!(
        python.exists(),
        "{} is missing: run scripts/test.sh or set HARVEST_PYTHON",
        python.display()
    );
    python
}

/// Where `scripts/fetch-model.sh` leaves the imported SmolLM2 checkpoint and its GGUF.
pub fn model_cache() -> PathBuf {
    let cache = std::env::var_os("HARVEST_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            let home = std::env::var_os("HOME").expect("HOME is set");
            PathBuf::from(home).join(".cache/harvest")
        });
    cache.join("models")
}

pub fn smollm2_dir() -> PathBuf {
    cpu_level();
    let dir = model_cache().join("smollm2-135m");
    assert!(
        dir.join("model.safetensors").exists(),
        "{} is missing: run scripts/fetch-model.sh first (or set HARVEST_CACHE)",
        dir.display()
    );
    dir
}

/// A reference file written by scripts/reference/make_fixtures.py.
pub struct Reference {
    bytes: Vec<u8>,
    pub prompts: Vec<String>,
    pub layers: Vec<usize>,
    pub truncate_at: usize,
}

impl Reference {
    pub fn open(path: &Path) -> Self {
        let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let (_, metadata) = SafeTensors::read_metadata(&bytes).unwrap();
        let meta: &HashMap<String, String> = metadata.metadata().as_ref().unwrap();
        Self {
            prompts: serde_json::from_str(&meta["prompts"]).unwrap(),
            layers: serde_json::from_str(&meta["layers"]).unwrap(),
            truncate_at: meta["truncate_at"].parse().unwrap(),
            bytes,
        }
    }

    fn tensor(&self, name: &str) -> (Vec<usize>, Vec<u8>) {
        let st = SafeTensors::deserialize(&self.bytes).unwrap();
        let view = st
            .tensor(name)
            .unwrap_or_else(|_| panic!("fixture tensor {name}"));
        (view.shape().to_vec(), view.data().to_vec())
    }

    pub fn ids(&self, prompt: usize, add_special_tokens: bool) -> Vec<u32> {
        let tag = if add_special_tokens {
            "special"
        } else {
            "plain"
        };
        let (_, data) = self.tensor(&format!("ids_{prompt}_{tag}"));
        data.chunks_exact(4)
            .map(|b| i32::from_le_bytes(b.try_into().unwrap()) as u32)
            .collect()
    }

    /// `[layers, tokens, hidden]` f32.
    pub fn residual(&self, prompt: usize) -> (Vec<usize>, Vec<f32>) {
        self.f32s(&format!("residual_{prompt}"))
    }

    /// Hook site `site` of `prompt` (`residual_p` for `resid_post`), `[layers, tokens, hidden]`.
    pub fn site(&self, site: harvest_core::Site, prompt: usize) -> (Vec<usize>, Vec<f32>) {
        match site {
            harvest_core::Site::ResidPost => self.residual(prompt),
            other => self.f32s(&format!("{other}_{prompt}")),
        }
    }

    /// An int32 tensor, `(shape, values)`.
    pub fn i32s(&self, name: &str) -> (Vec<usize>, Vec<i32>) {
        let (shape, data) = self.tensor(name);
        let values = data
            .chunks_exact(4)
            .map(|b| i32::from_le_bytes(b.try_into().unwrap()))
            .collect();
        (shape, values)
    }

    /// A metadata entry of the reference.
    pub fn metadata(&self, key: &str) -> Option<String> {
        let (_, metadata) = SafeTensors::read_metadata(&self.bytes).unwrap();
        metadata.metadata().as_ref()?.get(key).cloned()
    }

    /// A float32 tensor, `(shape, values)`.
    pub fn f32s(&self, name: &str) -> (Vec<usize>, Vec<f32>) {
        let (shape, data) = self.tensor(name);
        let st = SafeTensors::deserialize(&self.bytes).unwrap();
        assert_eq!(st.tensor(name).unwrap().dtype(), Dtype::F32);
        (
            shape,
            data.chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                .collect(),
        )
    }
}

/// The worst per-token relative error ‖ours − ref‖ / ‖ref‖ over rows of width `width`.
pub fn worst_relative_error(ours: &[f32], reference: &[f32], width: usize) -> f64 {
    assert_eq!(ours.len(), reference.len(), "shapes differ");
    ours.chunks_exact(width)
        .zip(reference.chunks_exact(width))
        .map(|(a, b)| {
            let diff: f64 = a
                .iter()
                .zip(b)
                .map(|(&x, &y)| (f64::from(x) - f64::from(y)).powi(2))
                .sum();
            let norm: f64 = b.iter().map(|&y| f64::from(y).powi(2)).sum();
            (diff / norm.max(1e-30)).sqrt()
        })
        .fold(0.0, f64::max)
}

/// Runs the CPU backend over `sequences` packed in one batch, keeping `layers`.
pub fn capture(dir: &Path, layers: &LayerSelection, sequences: &[Vec<u32>]) -> Captured {
    capture_sites(dir, layers, harvest_core::Sites::default(), sequences)
}

/// [`capture`], keeping `sites` of each kept layer.
pub fn capture_sites(
    dir: &Path,
    layers: &LayerSelection,
    sites: harvest_core::Sites,
    sequences: &[Vec<u32>],
) -> Captured {
    capture_in(
        dir,
        layers,
        sites,
        harvest_core::plan::Precision::F32,
        sequences,
    )
}

/// [`capture_sites`] in `precision`.
pub fn capture_in(
    dir: &Path,
    layers: &LayerSelection,
    sites: harvest_core::Sites,
    precision: harvest_core::plan::Precision,
    sequences: &[Vec<u32>],
) -> Captured {
    cpu_level();
    let config = harvester::model::ModelConfig::from_file(&dir.join("config.json")).unwrap();
    let layers = layers.resolve(config.num_layers).unwrap();
    let weights = harvester::model::LlamaWeights::load(dir, Some(layers.deepest() + 1)).unwrap();
    let spec = harvester::backend::CaptureSpec {
        layers,
        sites,
        precision,
        directions: None,
    };
    let mut backend = CpuBackend::new(weights, spec).unwrap();
    let mut out = Captured::default();
    backend
        .capture(&Batch::from_sequences(sequences), &mut out)
        .unwrap();
    out
}

/// Four prompts of ragged lengths for the tiny model (vocabulary 64): one of 150 tokens, one of
/// a single token.
pub fn prompts() -> Vec<Vec<u32>> {
    vec![
        vec![1, 5, 9, 2, 33, 7, 7, 60],
        vec![3],
        (0..150).map(|i| (i * 7 % 64) as u32).collect(),
        vec![8, 8],
    ]
}

/// The tiny model shape the forward tests use.
pub fn tiny_model() -> Shape {
    cpu_level();
    Shape {
        hidden: 32,
        layers: 3,
        heads: 4,
        kv_heads: 2,
        intermediate: 48,
        vocab: 64,
    }
}

/// Writes a tiny seeded random-weight Llama checkpoint in f32 (the forward tests' fixtures;
/// `harvester synth-model` writes bf16 ones of real sizes).
pub trait WriteTiny {
    fn write(&self, dir: &Path, seed: u64);
}

impl WriteTiny for Shape {
    fn write(&self, dir: &Path, seed: u64) {
        let mut state = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let mut random = |n: usize, scale: f32, offset: f32| -> Vec<u8> {
            (0..n)
                .flat_map(|_| {
                    state = state
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    let unit = ((state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0;
                    (offset + scale * unit).to_le_bytes()
                })
                .collect()
        };
        let (h, i) = (self.hidden, self.intermediate);
        let tensors: Vec<(String, Vec<usize>, Vec<u8>)> = harvester::synth::tensors(*self)
            .into_iter()
            .map(|(name, dims, norm)| {
                let n = dims.iter().product();
                // The embedding has unit scale; norms sit around 1, projections around 0.
                let (scale, offset) = match (norm, name.as_str()) {
                    (true, _) => (0.1, 1.0),
                    (false, "model.embed_tokens.weight") => (1.0, 0.0),
                    (false, _) => (0.3, 0.0),
                };
                let bytes = random(n, scale, offset);
                (name, dims, bytes)
            })
            .collect();
        let views: Vec<_> = tensors
            .iter()
            .map(|(n, s, b)| {
                (
                    n.clone(),
                    safetensors::tensor::TensorView::new(Dtype::F32, s.clone(), b).unwrap(),
                )
            })
            .collect();
        std::fs::create_dir_all(dir).unwrap();
        safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
        let config = serde_json::json!({
            "architectures": ["LlamaForCausalLM"], "hidden_size": h, "intermediate_size": i,
            "num_hidden_layers": self.layers, "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
            "max_position_embeddings": 512, "vocab_size": self.vocab, "tie_word_embeddings": true,
        });
        std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    }
}
