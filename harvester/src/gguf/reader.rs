//! A GGUF (v2/v3) reader: metadata, tensor directory and raw tensor bytes from a memory map.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use crate::error::{Error, ModelError, Result};

const MAGIC: &[u8; 4] = b"GGUF";
const DEFAULT_ALIGNMENT: u64 = 32;

/// A metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    /// Any unsigned integer type.
    UInt(u64),
    /// Any signed integer type.
    Int(i64),
    /// f32 or f64.
    Float(f64),
    /// A boolean.
    Bool(bool),
    /// A UTF-8 string.
    Str(String),
    /// An array of values.
    Array(Vec<Value>),
}

/// One entry of the tensor directory.
#[derive(Debug, Clone)]
pub struct TensorInfo {
    /// The GGUF name, e.g. `blk.0.attn_q.weight`.
    pub name: String,
    /// Dimensions, fastest-varying first (GGML order).
    pub dims: Vec<u64>,
    /// The GGML type id.
    pub ggml_type: u32,
    /// Offset from the start of the data section.
    pub offset: u64,
}

/// An open GGUF file.
#[derive(Debug)]
pub struct GgufFile {
    path: PathBuf,
    mmap: Mmap,
    /// Metadata key-value pairs.
    pub metadata: HashMap<String, Value>,
    /// The tensor directory, in file order.
    pub tensors: Vec<TensorInfo>,
    data_start: usize,
}

struct Cursor<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl Cursor<'_> {
    fn take(&mut self, n: usize) -> std::result::Result<&[u8], String> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&end| end <= self.bytes.len())
            .ok_or_else(|| {
                format!(
                    "truncated: needed {n} bytes at offset {}, file has {}",
                    self.pos,
                    self.bytes.len()
                )
            })?;
        let slice = &self.bytes[self.pos..end];
        self.pos = end;
        Ok(slice)
    }

    fn array<const N: usize>(&mut self) -> std::result::Result<[u8; N], String> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }

    fn u32(&mut self) -> std::result::Result<u32, String> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    fn u64(&mut self) -> std::result::Result<u64, String> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    fn length(&mut self) -> std::result::Result<usize, String> {
        let len = self.u64()?;
        usize::try_from(len)
            .ok()
            .filter(|&len| len <= self.bytes.len())
            .ok_or_else(|| format!("implausible length {len} at offset {}", self.pos - 8))
    }

    fn string(&mut self) -> std::result::Result<String, String> {
        let len = self.length()?;
        String::from_utf8(self.take(len)?.to_vec())
            .map_err(|_| format!("string at offset {} is not UTF-8", self.pos - len))
    }

    fn value(&mut self, kind: u32) -> std::result::Result<Value, String> {
        Ok(match kind {
            0 => Value::UInt(u64::from(self.array::<1>()?[0])),
            1 => Value::Int(i64::from(i8::from_le_bytes(self.array()?))),
            2 => Value::UInt(u64::from(u16::from_le_bytes(self.array()?))),
            3 => Value::Int(i64::from(i16::from_le_bytes(self.array()?))),
            4 => Value::UInt(u64::from(self.u32()?)),
            5 => Value::Int(i64::from(i32::from_le_bytes(self.array()?))),
            6 => Value::Float(f64::from(f32::from_le_bytes(self.array()?))),
            7 => Value::Bool(self.array::<1>()?[0] != 0),
            8 => Value::Str(self.string()?),
            9 => {
                let item_kind = self.u32()?;
                let len = self.length()?;
                let mut items = Vec::with_capacity(len.min(1 << 20));
                for _ in 0..len {
                    items.push(self.value(item_kind)?);
                }
                Value::Array(items)
            }
            10 => Value::UInt(self.u64()?),
            11 => Value::Int(i64::from_le_bytes(self.array()?)),
            12 => Value::Float(f64::from_le_bytes(self.array()?)),
            other => return Err(format!("unknown metadata value type {other}")),
        })
    }
}

impl GgufFile {
    /// Maps and parses a GGUF file.
    pub fn open(path: &Path) -> Result<Self> {
        let file = File::open(path).map_err(|source| match source.kind() {
            std::io::ErrorKind::NotFound => Error::Model(ModelError::MissingFile {
                path: path.to_owned(),
                hint: "give the path of a .gguf file",
            }),
            _ => Error::io("opening", path, source),
        })?;
        // SAFETY: read-only private mapping; every read below is bounds-checked by `Cursor` or
        // against the tensor sizes, so a file truncated under us yields an error, not UB, unless
        // it shrinks after the checks (the usual contract of memory-mapped loaders).
        #[allow(unsafe_code)]
        let mmap = unsafe { Mmap::map(&file) }.map_err(|e| Error::io("mapping", path, e))?;
        Self::parse(path, mmap)
    }

    fn parse(path: &Path, mmap: Mmap) -> Result<Self> {
        let gguf_error = |reason: String| {
            Error::Model(ModelError::Gguf {
                path: path.to_owned(),
                reason,
            })
        };
        let mut cursor = Cursor {
            bytes: &mmap,
            pos: 0,
        };
        let header = (|| -> std::result::Result<_, String> {
            if cursor.take(4)? != MAGIC {
                return Err("not a GGUF file (bad magic)".into());
            }
            let version = cursor.u32()?;
            if !(2..=3).contains(&version) {
                return Err(format!(
                    "GGUF version {version} is not supported (2 and 3 are)"
                ));
            }
            let tensor_count = cursor.length()?;
            let kv_count = cursor.length()?;
            let mut metadata = HashMap::new();
            for _ in 0..kv_count {
                let key = cursor.string()?;
                let kind = cursor.u32()?;
                let value = cursor
                    .value(kind)
                    .map_err(|e| format!("metadata {key}: {e}"))?;
                metadata.insert(key, value);
            }
            let mut tensors = Vec::with_capacity(tensor_count);
            for _ in 0..tensor_count {
                let name = cursor.string()?;
                let n_dims = cursor.u32()? as usize;
                if n_dims > 4 {
                    return Err(format!("tensor {name} has {n_dims} dimensions"));
                }
                let dims = (0..n_dims)
                    .map(|_| cursor.u64())
                    .collect::<std::result::Result<_, _>>()?;
                let ggml_type = cursor.u32()?;
                let offset = cursor.u64()?;
                tensors.push(TensorInfo {
                    name,
                    dims,
                    ggml_type,
                    offset,
                });
            }
            Ok((metadata, tensors, cursor.pos))
        })();
        let (metadata, tensors, header_end) = header.map_err(gguf_error)?;
        let alignment = match metadata.get("general.alignment") {
            Some(Value::UInt(a)) if *a > 0 => *a,
            _ => DEFAULT_ALIGNMENT,
        };
        let data_start = (header_end as u64).div_ceil(alignment) * alignment;
        let data_start = usize::try_from(data_start)
            .ok()
            .filter(|&s| s <= mmap.len())
            .ok_or_else(|| gguf_error("the data section starts past the end of the file".into()))?;
        Ok(Self {
            path: path.to_owned(),
            mmap,
            metadata,
            tensors,
            data_start,
        })
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// `len` bytes of tensor data at `offset` within the data section, bounds-checked.
    pub fn tensor_bytes(&self, info: &TensorInfo, len: usize) -> Result<&[u8]> {
        let start = usize::try_from(info.offset)
            .ok()
            .and_then(|o| o.checked_add(self.data_start));
        match start.and_then(|s| Some((s, s.checked_add(len)?))) {
            Some((s, e)) if e <= self.mmap.len() => Ok(&self.mmap[s..e]),
            _ => Err(Error::Model(ModelError::Gguf {
                path: self.path.clone(),
                reason: format!(
                    "tensor {} runs past the end of the file (truncated download?)",
                    info.name
                ),
            })),
        }
    }

    /// A metadata value that must be present.
    pub fn require(&self, key: &str) -> Result<&Value> {
        self.metadata.get(key).ok_or_else(|| {
            Error::Model(ModelError::Gguf {
                path: self.path.clone(),
                reason: format!("metadata key {key} is missing"),
            })
        })
    }

    /// An unsigned integer metadata value that must be present.
    pub fn require_uint(&self, key: &str) -> Result<u64> {
        match self.require(key)? {
            Value::UInt(v) => Ok(*v),
            Value::Int(v) if *v >= 0 => Ok(*v as u64),
            other => Err(self.wrong_type(key, "an unsigned integer", other)),
        }
    }

    /// A float metadata value, if present.
    pub fn float(&self, key: &str) -> Result<Option<f64>> {
        match self.metadata.get(key) {
            None => Ok(None),
            Some(Value::Float(v)) => Ok(Some(*v)),
            Some(other) => Err(self.wrong_type(key, "a float", other)),
        }
    }

    /// A string array metadata value that must be present.
    pub fn require_strings(&self, key: &str) -> Result<Vec<&str>> {
        match self.require(key)? {
            Value::Array(items) => items
                .iter()
                .map(|item| match item {
                    Value::Str(s) => Ok(s.as_str()),
                    other => Err(self.wrong_type(key, "an array of strings", other)),
                })
                .collect(),
            other => Err(self.wrong_type(key, "an array of strings", other)),
        }
    }

    fn wrong_type(&self, key: &str, wanted: &str, found: &Value) -> Error {
        let found = format!("{found:?}");
        let found: String = found.chars().take(60).collect();
        Error::Model(ModelError::Gguf {
            path: self.path.clone(),
            reason: format!("metadata {key} should be {wanted}, found {found}"),
        })
    }
}
