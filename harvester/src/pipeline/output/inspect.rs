//! `harvester inspect`: a finished local harvest's manifest and tensors, as text.

use std::path::Path;

use harvest_core::format::Manifest;

use crate::error::{Error, ModelError, Result, StoreError};
use crate::pipeline::MANIFEST_FILE;

/// A readable summary of a finished local harvest: the manifest's key facts and the dtype and
/// shape of every tensor in every shard.
pub fn inspect(dir: &Path) -> Result<String> {
    use std::fmt::Write;
    let path = dir.join(MANIFEST_FILE);
    let text = std::fs::read_to_string(&path).map_err(|e| Error::io("reading", &path, e))?;
    let manifest: Manifest = serde_json::from_str(&text)
        .map_err(|source| Error::Store(StoreError::Json { path, source }))?;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{} ({}), {:?} {}, layers {:?}, {} prompts, {} tokens, {} shards{}",
        manifest.model.name,
        manifest.model.architecture,
        manifest.contents,
        manifest.dtype,
        manifest.layer_indices,
        manifest.n_prompts,
        manifest.total_tokens,
        manifest.shards.len(),
        manifest.train.as_ref().map_or(String::new(), |t| format!(
            ", shuffled into {} training files of {} rows",
            t.files.len(),
            t.rows
        ))
    );
    if let Some(router) = &manifest.router {
        let _ = writeln!(
            out,
            "router: top-{} of {} experts at layers {:?}{}",
            router.experts_per_token,
            router.experts,
            router.layer_indices,
            if router.logits { ", with logits" } else { "" }
        );
    }
    let files: Vec<(&str, u64)> = match &manifest.train {
        None => manifest
            .shards
            .iter()
            .map(|s| (s.file.as_str(), s.bytes))
            .collect(),
        Some(train) => train
            .files
            .iter()
            .map(|f| (f.file.as_str(), f.bytes))
            .collect(),
    };
    for (file, size) in files {
        let path = dir.join(file);
        let bytes = std::fs::read(&path).map_err(|e| Error::io("reading", &path, e))?;
        let shard = safetensors::SafeTensors::deserialize(&bytes).map_err(|e| {
            Error::Model(ModelError::CorruptSafetensors {
                path: path.clone(),
                reason: e.to_string(),
            })
        })?;
        let _ = writeln!(out, "{file} ({size} bytes)");
        let mut names = shard.names();
        names.sort_by_key(|n| {
            let (kind, index) = n.rsplit_once('_').unwrap_or((n, "0"));
            (index.parse::<usize>().unwrap_or(0), kind.to_owned())
        });
        for name in names {
            if let Ok(view) = shard.tensor(name) {
                let _ = writeln!(out, "  {name:<14} {:?} {:?}", view.dtype(), view.shape());
            }
        }
    }
    Ok(out)
}
