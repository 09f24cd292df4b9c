//! Memory-mapped Hugging Face safetensors checkpoints: one `model.safetensors`, or shards listed
//! by `model.safetensors.index.json`. Norms and f32 tensors are decoded to f32 straight from the
//! mapping; bf16 and f16 matrices stay in it ([`Matrix`]), so no file is ever held in memory
//! twice.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use safetensors::{Dtype, SafeTensors};
use serde::Deserialize;

use super::matrix::{FileMap, Half, Matrix};
use crate::dtype;
use crate::error::{Error, ModelError, Result, StoreError};

const SINGLE_FILE: &str = "model.safetensors";
const INDEX_FILE: &str = "model.safetensors.index.json";

/// An open checkpoint: every weight file mapped, and where each tensor lives.
#[derive(Debug)]
pub struct Checkpoint {
    dir: PathBuf,
    files: Vec<MappedFile>,
    locations: HashMap<String, Location>,
}

#[derive(Debug)]
struct MappedFile {
    path: PathBuf,
    mmap: Arc<FileMap>,
    data_start: usize,
}

#[derive(Debug, Clone)]
struct Location {
    file: usize,
    dtype: Dtype,
    shape: Vec<usize>,
    range: (usize, usize),
}

#[derive(Deserialize)]
struct ShardIndex {
    weight_map: HashMap<String, String>,
}

impl Checkpoint {
    /// Opens `dir/model.safetensors`, or every shard named by `dir/model.safetensors.index.json`.
    pub fn open(dir: &Path) -> Result<Self> {
        let index_path = dir.join(INDEX_FILE);
        let file_names: Vec<String> = if index_path.exists() {
            let text = std::fs::read_to_string(&index_path)
                .map_err(|e| Error::io("reading", &index_path, e))?;
            let index: ShardIndex = serde_json::from_str(&text).map_err(|source| {
                Error::Store(StoreError::Json {
                    path: index_path.clone(),
                    source,
                })
            })?;
            let mut names: Vec<String> = index.weight_map.into_values().collect();
            names.sort();
            names.dedup();
            names
        } else {
            vec![SINGLE_FILE.to_owned()]
        };
        let mut checkpoint = Self {
            dir: dir.to_owned(),
            files: Vec::new(),
            locations: HashMap::new(),
        };
        for name in file_names {
            checkpoint.map_file(&dir.join(name))?;
        }
        Ok(checkpoint)
    }

    fn map_file(&mut self, path: &Path) -> Result<()> {
        let file = File::open(path).map_err(|source| match source.kind() {
            std::io::ErrorKind::NotFound => Error::Model(ModelError::MissingFile {
                path: path.to_owned(),
                hint: "expected model.safetensors, or the shards listed in model.safetensors.index.json",
            }),
            _ => Error::io("opening", path, source),
        })?;
        // The bounds of every read are checked against the header below.
        let mmap = FileMap::open(&file).map_err(|e| Error::io("mapping", path, e))?;
        let corrupt = |reason: String| {
            Error::Model(ModelError::CorruptSafetensors {
                path: path.to_owned(),
                reason,
            })
        };
        let (header_len, metadata) =
            SafeTensors::read_metadata(&mmap).map_err(|e| corrupt(e.to_string()))?;
        let data_start = 8 + header_len;
        let data_len = mmap.len() - data_start;
        let file_index = self.files.len();
        for (name, info) in metadata.tensors() {
            if info.data_offsets.1 > data_len {
                return Err(corrupt(format!(
                    "tensor {name} ends past the end of the file"
                )));
            }
            self.locations.insert(
                name,
                Location {
                    file: file_index,
                    dtype: info.dtype,
                    shape: info.shape.clone(),
                    range: info.data_offsets,
                },
            );
        }
        self.files.push(MappedFile {
            path: path.to_owned(),
            mmap: Arc::new(mmap),
            data_start,
        });
        Ok(())
    }

    /// The bytes of every tensor whose name starts with `prefix`, as stored (what loading them
    /// maps or decodes), without reading any.
    pub fn stored_bytes(&self, prefix: &str) -> u64 {
        self.locations
            .iter()
            .filter(|(name, _)| name.starts_with(prefix))
            .map(|(_, loc)| (loc.range.1 - loc.range.0) as u64)
            .sum()
    }

    /// How many values the tensors whose name starts with `prefix` hold, whatever their dtype.
    pub fn stored_values(&self, prefix: &str) -> u64 {
        self.locations
            .iter()
            .filter(|(name, _)| name.starts_with(prefix))
            .map(|(_, loc)| loc.shape.iter().product::<usize>() as u64)
            .sum()
    }

    /// Whether the checkpoint has a tensor of this name.
    pub fn contains(&self, name: &str) -> bool {
        self.locations.contains_key(name)
    }

    /// The shape of a tensor, if present.
    pub fn shape(&self, name: &str) -> Option<&[usize]> {
        self.locations.get(name).map(|loc| loc.shape.as_slice())
    }

    /// Where tensor `name`, which must have shape `expected`, lives: its file, dtype and byte
    /// range in the mapping (checked against its shape and dtype).
    fn locate(&self, name: &str, expected: &[usize]) -> Result<(&MappedFile, Dtype, usize, usize)> {
        let location = self.locations.get(name).ok_or_else(|| {
            Error::Model(ModelError::MissingTensor {
                name: name.to_owned(),
                dir: self.dir.clone(),
            })
        })?;
        if location.shape != expected {
            return Err(Error::Model(ModelError::WrongShape {
                name: name.to_owned(),
                expected: expected.to_vec(),
                found: location.shape.clone(),
            }));
        }
        let file = &self.files[location.file];
        let elements: usize = expected.iter().product();
        let width = match location.dtype {
            Dtype::BF16 | Dtype::F16 => 2,
            Dtype::F32 => 4,
            other => {
                return Err(Error::Model(ModelError::UnsupportedDtype {
                    name: name.to_owned(),
                    dtype: format!("{other:?}"),
                }));
            }
        };
        let (start, end) = (
            file.data_start + location.range.0,
            file.data_start + location.range.1,
        );
        if end - start != elements * width {
            return Err(Error::Model(ModelError::CorruptSafetensors {
                path: file.path.clone(),
                reason: format!(
                    "tensor {name} holds {} bytes, but its shape and dtype need {}",
                    end - start,
                    elements * width
                ),
            }));
        }
        Ok((file, location.dtype, start, end))
    }

    /// Decodes tensor `name`, which must have shape `expected`, to f32 and appends it to `dst`.
    pub fn append_f32(&self, name: &str, expected: &[usize], dst: &mut Vec<f32>) -> Result<()> {
        let (file, dtype, start, end) = self.locate(name, expected)?;
        let bytes = &file.mmap[start..end];
        dst.reserve(expected.iter().product());
        match dtype {
            Dtype::BF16 => dtype::extend_from_bf16(dst, bytes),
            Dtype::F16 => dtype::extend_from_f16(dst, bytes),
            _ => dtype::extend_from_f32(dst, bytes),
        }
        Ok(())
    }

    /// The matrix made of tensors `parts` (each a name and its rows, all `cols` wide) stacked
    /// in order. When all are bf16, or all f16, it stays in the mapping; otherwise it is
    /// decoded to f32.
    pub fn matrix(&self, parts: &[(String, usize)], cols: usize) -> Result<Matrix> {
        let located = parts
            .iter()
            .map(|(name, rows)| self.locate(name, &[*rows, cols]))
            .collect::<Result<Vec<_>>>()?;
        let half = |dtype: Dtype| match dtype {
            Dtype::BF16 => Some(Half::Bf16),
            Dtype::F16 => Some(Half::F16),
            _ => None,
        };
        let format = half(located.first().map_or(Dtype::F32, |l| l.1));
        match format {
            Some(format) if located.iter().all(|l| half(l.1) == Some(format)) => {
                let mut matrix = Matrix::mapped(format, cols);
                for ((file, _, start, _), (_, rows)) in located.iter().zip(parts) {
                    matrix.push_rows(&file.mmap, *start, *rows);
                }
                Ok(matrix)
            }
            _ => {
                let rows: usize = parts.iter().map(|(_, r)| r).sum();
                let mut values = Vec::with_capacity(rows * cols);
                for (name, r) in parts {
                    self.append_f32(name, &[*r, cols], &mut values)?;
                }
                Ok(Matrix::from_f32(rows, cols, values))
            }
        }
    }

    /// Decodes tensor `name` of shape `expected` into a new f32 vector.
    pub fn tensor_f32(&self, name: &str, expected: &[usize]) -> Result<Vec<f32>> {
        let mut out = Vec::new();
        self.append_f32(name, expected, &mut out)?;
        Ok(out)
    }
}
