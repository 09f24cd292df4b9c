//! The plan fingerprint: a digest of everything that decides a harvest's bytes, recorded in every
//! shard, record and manifest so that a rerun resumes its own output and refuses another's.

use std::path::Path;

use harvest_core::ResolvedPlan;
use harvest_core::format;
use sha2::{Digest, Sha256};

use crate::error::{Error, Result};
use crate::projection::Directions;

/// A digest of everything that decides the output's bytes: model files, prompts, layers, shard
/// size, tokenization, directions and the format version. The batch budget is left out: it
/// does not change the output.
pub fn plan_fingerprint(
    plan: &ResolvedPlan,
    prompt_bytes: &[u8],
    directions: Option<&Directions>,
    max_tokens: usize,
) -> Result<String> {
    let mut hash = Sha256::new();
    let mut field = |label: &str, bytes: &[u8]| {
        hash.update((label.len() as u64).to_le_bytes());
        hash.update(label.as_bytes());
        hash.update((bytes.len() as u64).to_le_bytes());
        hash.update(bytes);
    };
    field("format_version", &format::FORMAT_VERSION.to_le_bytes());
    for file in ["config.json", "tokenizer.json", "tokenizer_config.json"] {
        let path = plan.model.join(file);
        let bytes = std::fs::read(&path).unwrap_or_default();
        field(file, &bytes);
    }
    let mut weight_files: Vec<_> = std::fs::read_dir(&plan.model)
        .map_err(|e| Error::io("listing", &plan.model, e))?
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .collect();
    weight_files.sort();
    for path in weight_files {
        field("weights", &safetensors_header(&path)?);
    }
    field("prompts", &Sha256::digest(prompt_bytes));
    field(
        "layers",
        &plan
            .options
            .layers
            .as_slice()
            .iter()
            .flat_map(|l| (*l as u64).to_le_bytes())
            .collect::<Vec<_>>(),
    );
    // Only a non-default choice is hashed, so outputs begun before sites existed still resume.
    if !plan.options.sites.is_default() {
        field("sites", plan.options.sites.to_string().as_bytes());
    }
    if !plan.options.selection.is_everything() {
        let rules = serde_json::to_vec(&plan.options.selection).unwrap_or_default();
        field("selection", &rules);
    }
    // f32 is left out, as it was before a job could name a precision.
    let precision = plan.options.precision.unwrap_or_default();
    if precision != harvest_core::plan::Precision::F32 {
        field("precision", precision.as_str().as_bytes());
    }
    field(
        "shard_size",
        &(plan.options.shard_size.get() as u64).to_le_bytes(),
    );
    field(
        "add_special_tokens",
        &[u8::from(plan.options.add_special_tokens)],
    );
    field("max_tokens", &(max_tokens as u64).to_le_bytes());
    if let Some(d) = directions {
        field(
            "directions",
            &d.unit_vectors()
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect::<Vec<_>>(),
        );
    }
    Ok(hash.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

/// The header of a safetensors file (names, dtypes, shapes, offsets) plus its length: enough to
/// identify weights without reading gigabytes.
fn safetensors_header(path: &Path) -> Result<Vec<u8>> {
    use std::io::Read;
    let mut file = std::fs::File::open(path).map_err(|e| Error::io("opening", path, e))?;
    let len = file
        .metadata()
        .map_err(|e| Error::io("reading", path, e))?
        .len();
    let mut size = [0u8; 8];
    file.read_exact(&mut size)
        .map_err(|e| Error::io("reading", path, e))?;
    let header_len = u64::from_le_bytes(size)
        .min(len.saturating_sub(8))
        .min(100 << 20);
    let mut header = vec![0u8; header_len as usize];
    file.read_exact(&mut header)
        .map_err(|e| Error::io("reading", path, e))?;
    header.extend(len.to_le_bytes());
    Ok(header)
}
