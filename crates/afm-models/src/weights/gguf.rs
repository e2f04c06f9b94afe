//! GGUF v2/v3 reader. `open` memory-maps the file and validates the whole header up front
//! (magic, version, every count against the bytes left, strings, tensor types, shapes, alignment
//! and bounds), so `tensor` afterwards only slices the map.
//!
//! ```text
//! magic "GGUF" | u32 version | u64 tensor_count | u64 kv_count
//! kv_count × (string key, u32 type, value)              string = u64 len + UTF-8 bytes
//! tensor_count × (string name, u32 n_dims, n_dims × u64 dim (innermost first), u32 ggml_type,
//!                 u64 offset from the data section)
//! zero padding to general.alignment (default 32)
//! data section: tensors, each at an aligned offset
//! ```
//!
//! It does not interpret metadata (architectures read their own keys) and holds no tensor data
//! beyond the map. Any input bytes give a value or an error, never a panic.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use afm_runtime::{DType, WeightBytes};

use super::{map_file, row_bytes_fit, TensorView, WeightsError};

const MAGIC: &[u8; 4] = b"GGUF";
const DEFAULT_ALIGNMENT: u64 = 32;
const MAX_DIMS: u32 = 4;
/// Nested arrays are legal but no writer nests deeply; the cap keeps hostile nesting from
/// exhausting the stack.
const MAX_ARRAY_DEPTH: u32 = 8;
/// Smallest encodings, used to refuse counts the remaining bytes cannot hold before reserving.
const MIN_KV_BYTES: usize = 8 + 4 + 1; // key length, value type, a 1-byte value
const MIN_TENSOR_INFO_BYTES: usize = 8 + 4 + 4 + 8; // name length, n_dims, type, offset

type Bytes = Arc<dyn AsRef<[u8]> + Send + Sync>;

#[derive(Debug, Clone, PartialEq)]
pub enum GgufValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    Str(String),
    Array(Vec<GgufValue>),
    U64(u64),
    I64(i64),
    F64(f64),
}

impl GgufValue {
    /// Any non-negative integer.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            GgufValue::U8(v) => Some(v.into()),
            GgufValue::U16(v) => Some(v.into()),
            GgufValue::U32(v) => Some(v.into()),
            GgufValue::U64(v) => Some(v),
            _ => self.as_i64().and_then(|v| u64::try_from(v).ok()),
        }
    }

    /// Any integer that fits in an i64.
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            GgufValue::U8(v) => Some(v.into()),
            GgufValue::I8(v) => Some(v.into()),
            GgufValue::U16(v) => Some(v.into()),
            GgufValue::I16(v) => Some(v.into()),
            GgufValue::U32(v) => Some(v.into()),
            GgufValue::I32(v) => Some(v.into()),
            GgufValue::U64(v) => i64::try_from(v).ok(),
            GgufValue::I64(v) => Some(v),
            _ => None,
        }
    }

    /// Any number.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            GgufValue::F32(v) => Some(v.into()),
            GgufValue::F64(v) => Some(v),
            GgufValue::U64(v) => Some(v as f64),
            GgufValue::I64(v) => Some(v as f64),
            _ => self.as_i64().map(|v| v as f64),
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            GgufValue::Str(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            GgufValue::Bool(b) => Some(b),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[GgufValue]> {
        match self {
            GgufValue::Array(items) => Some(items),
            _ => None,
        }
    }
}

/// How a tensor's elements are stored.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Storage {
    /// Floats or a block-quantized weight type.
    Weight(DType),
    /// Little-endian signed integers of this many bytes (GGML I8/I16/I32/I64, ids 24..=27),
    /// e.g. DeepSeek V4's hash-routing table `ffn_gate_tid2eid`.
    Int(usize),
}

impl Storage {
    fn from_ggml_id(id: u32) -> Option<Storage> {
        Some(match id {
            24 => Storage::Int(1),
            25 => Storage::Int(2),
            26 => Storage::Int(4),
            27 => Storage::Int(8),
            _ => Storage::Weight(DType::from_ggml_id(id)?),
        })
    }

    /// A row of `n` elements as a weight type does: plain ints are blocks of one.
    fn as_dtype(self) -> DType {
        match self {
            Storage::Weight(d) => d,
            Storage::Int(_) => DType::F32,
        }
    }

    fn row_bytes(self, n: usize) -> Option<usize> {
        match self {
            Storage::Weight(d) => d.row_bytes(n),
            Storage::Int(b) => n.checked_mul(b),
        }
    }
}

/// Where one tensor lives in the map, checked at open.
struct TensorInfo {
    name: String,
    storage: Storage,
    shape: Vec<usize>,
    start: usize,
    len: usize,
}

pub struct GgufFile {
    path: PathBuf,
    data: Bytes,
    version: u32,
    alignment: u64,
    metadata: BTreeMap<String, GgufValue>,
    tensors: Vec<TensorInfo>,
    by_name: HashMap<String, usize>,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("metadata_keys", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

impl GgufFile {
    /// Memory-maps `path` and validates its header and every tensor's placement.
    pub fn open(path: &Path) -> Result<Self, WeightsError> {
        let map = map_file(path)?;
        Self::parse(path.to_path_buf(), Arc::new(map))
    }

    /// Parses a GGUF image held in memory (tests, fuzzing); errors name the path `<memory>`.
    pub fn from_bytes(bytes: Vec<u8>) -> Result<Self, WeightsError> {
        Self::parse(PathBuf::from("<memory>"), Arc::new(bytes))
    }

    pub fn version(&self) -> u32 {
        self.version
    }

    pub fn metadata(&self) -> &BTreeMap<String, GgufValue> {
        &self.metadata
    }

    pub fn get(&self, key: &str) -> Option<&GgufValue> {
        self.metadata.get(key)
    }

    /// `general.architecture`, e.g. "llama", "qwen3", "gemma3".
    pub fn architecture(&self) -> Option<&str> {
        self.get("general.architecture").and_then(GgufValue::as_str)
    }

    /// `general.alignment`, or 32 when absent.
    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// Tensor names in file order.
    pub fn tensor_names(&self) -> impl Iterator<Item = &str> {
        self.tensors.iter().map(|t| t.name.as_str())
    }

    pub fn contains(&self, name: &str) -> bool {
        self.by_name.contains_key(name)
    }

    fn info(&self, name: &str) -> Result<&TensorInfo, WeightsError> {
        self.by_name
            .get(name)
            .map(|&i| &self.tensors[i])
            .ok_or_else(|| WeightsError::MissingTensor {
                name: name.to_string(),
            })
    }

    /// An integer tensor (I8/I16/I32/I64) as i64 values with its shape, outermost first.
    pub fn integers(&self, name: &str) -> Result<(Vec<usize>, Vec<i64>), WeightsError> {
        let info = self.info(name)?;
        let Storage::Int(width) = info.storage else {
            return Err(WeightsError::WrongKind {
                name: name.to_string(),
                stored: info.storage.as_dtype().name().to_string(),
                wanted: "an integer table",
            });
        };
        // Placement was checked at open.
        let bytes = &(*self.data).as_ref()[info.start..info.start + info.len];
        let values = bytes
            .chunks_exact(width)
            .map(|c| {
                let mut b = [0u8; 8];
                b[..width].copy_from_slice(c);
                // Sign-extend from the stored width.
                let shift = 64 - 8 * width as u32;
                (i64::from_le_bytes(b) << shift) >> shift
            })
            .collect();
        Ok((info.shape.clone(), values))
    }

    /// A view into the map. The shape is outermost first: GGUF's dims reversed.
    pub fn tensor(&self, name: &str) -> Result<TensorView, WeightsError> {
        let info = self.info(name)?;
        let Storage::Weight(dtype) = info.storage else {
            return Err(WeightsError::WrongKind {
                name: name.to_string(),
                stored: "an integer table".into(),
                wanted: "weights",
            });
        };
        let bytes =
            WeightBytes::slice_of(self.data.clone(), info.start, info.len).ok_or_else(|| {
                WeightsError::TensorOutOfBounds {
                    name: name.to_string(),
                    offset: info.start as u64,
                    size: info.len as u64,
                    available: (*self.data).as_ref().len() as u64,
                }
            })?;
        Ok(TensorView {
            name: info.name.clone(),
            dtype,
            shape: info.shape.clone(),
            bytes,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    fn parse(path: PathBuf, data: Bytes) -> Result<Self, WeightsError> {
        let buf: &[u8] = (*data).as_ref();
        if buf.get(..4) != Some(MAGIC.as_slice()) {
            return Err(WeightsError::BadMagic {
                path,
                found: buf.iter().take(4).copied().collect(),
            });
        }
        let mut r = Reader { buf, pos: 4 };
        let version = r.u32("version")?;
        if version.swap_bytes() == 2 || version.swap_bytes() == 3 {
            let p = path.display();
            return Err(WeightsError::BadHeader(format!(
                "{p}: big-endian GGUF is not supported"
            )));
        }
        if version != 2 && version != 3 {
            return Err(WeightsError::UnsupportedVersion { path, version });
        }
        let tensor_count = r.u64("tensor_count")?;
        let kv_count = r.u64("metadata_kv_count")?;
        // Both sections follow, so each count alone must fit in what is left.
        let tensor_count =
            r.check_count("tensor_count", "", tensor_count, MIN_TENSOR_INFO_BYTES)?;
        let kv_count = r.check_count("metadata_kv_count", "", kv_count, MIN_KV_BYTES)?;

        let metadata = read_metadata(&mut r, kv_count)?;
        let alignment = alignment_of(&metadata)?;
        let raw = read_tensor_infos(&mut r, tensor_count)?;

        let align = usize::try_from(alignment).map_err(|_| overflow("general.alignment"))?;
        let data_start = r
            .pos
            .checked_next_multiple_of(align)
            .ok_or_else(|| overflow("tensor data start"))?;
        if !raw.is_empty() && data_start > buf.len() {
            let what = format!("padding to the {alignment}-byte aligned tensor data");
            return Err(WeightsError::Truncated {
                what,
                offset: r.pos as u64,
            });
        }
        let mut tensors = Vec::with_capacity(raw.len());
        let mut by_name = HashMap::with_capacity(raw.len());
        for info in raw {
            let info = locate(info, data_start, alignment, buf.len())?;
            if by_name.insert(info.name.clone(), tensors.len()).is_some() {
                return Err(WeightsError::BadHeader(format!(
                    "tensor {} appears twice",
                    info.name
                )));
            }
            tensors.push(info);
        }
        Ok(Self {
            path,
            data,
            version,
            alignment,
            metadata,
            tensors,
            by_name,
        })
    }
}

fn overflow(what: &str) -> WeightsError {
    WeightsError::Overflow {
        what: what.to_string(),
    }
}

fn alignment_of(metadata: &BTreeMap<String, GgufValue>) -> Result<u64, WeightsError> {
    let Some(value) = metadata.get("general.alignment") else {
        return Ok(DEFAULT_ALIGNMENT);
    };
    value
        .as_u64()
        .filter(|a| a.is_power_of_two())
        .ok_or_else(|| {
            WeightsError::BadHeader(format!(
                "general.alignment is {value:?}, it must be a power of two"
            ))
        })
}

fn read_metadata(
    r: &mut Reader,
    count: usize,
) -> Result<BTreeMap<String, GgufValue>, WeightsError> {
    let mut metadata = BTreeMap::new();
    for i in 0..count {
        let key = r.string(&format!("key of metadata entry {i}"))?;
        let what = format!("metadata value {key:?}");
        let ty = r.u32(&what)?;
        let value = read_value(r, ty, &what, 0)?;
        if metadata.contains_key(&key) {
            return Err(WeightsError::BadHeader(format!(
                "metadata key {key:?} appears twice"
            )));
        }
        metadata.insert(key, value);
    }
    Ok(metadata)
}

/// Bytes of the smallest value of GGUF value type `ty`; `None` for an unknown type.
fn min_value_bytes(ty: u32) -> Option<usize> {
    Some(match ty {
        0 | 1 | 7 => 1,
        2 | 3 => 2,
        4..=6 => 4,
        8 | 10..=12 => 8,
        9 => 4 + 8, // element type and count of an empty array
        _ => return None,
    })
}

fn read_value(r: &mut Reader, ty: u32, what: &str, depth: u32) -> Result<GgufValue, WeightsError> {
    Ok(match ty {
        0 => GgufValue::U8(u8::from_le_bytes(r.fixed(what)?)),
        1 => GgufValue::I8(i8::from_le_bytes(r.fixed(what)?)),
        2 => GgufValue::U16(u16::from_le_bytes(r.fixed(what)?)),
        3 => GgufValue::I16(i16::from_le_bytes(r.fixed(what)?)),
        4 => GgufValue::U32(r.u32(what)?),
        5 => GgufValue::I32(i32::from_le_bytes(r.fixed(what)?)),
        6 => GgufValue::F32(f32::from_le_bytes(r.fixed(what)?)),
        7 => match r.fixed::<1>(what)? {
            [0] => GgufValue::Bool(false),
            [1] => GgufValue::Bool(true),
            [b] => {
                let msg = format!("{what}: bool byte is {b}, it must be 0 or 1");
                return Err(WeightsError::BadHeader(msg));
            }
        },
        8 => GgufValue::Str(r.string_lossy(what)?),
        9 => {
            if depth >= MAX_ARRAY_DEPTH {
                let msg = format!("{what}: arrays nested deeper than {MAX_ARRAY_DEPTH}");
                return Err(WeightsError::BadHeader(msg));
            }
            let elem = r.u32(what)?;
            let count = r.u64(what)?;
            let min = min_value_bytes(elem).ok_or_else(|| {
                WeightsError::BadHeader(format!("{what}: unknown array element type {elem}"))
            })?;
            let count = r.check_count(what, " array length", count, min)?;
            let mut items = Vec::with_capacity(count);
            for _ in 0..count {
                items.push(read_value(r, elem, what, depth + 1)?);
            }
            GgufValue::Array(items)
        }
        10 => GgufValue::U64(r.u64(what)?),
        11 => GgufValue::I64(i64::from_le_bytes(r.fixed(what)?)),
        12 => GgufValue::F64(f64::from_le_bytes(r.fixed(what)?)),
        _ => {
            return Err(WeightsError::BadHeader(format!(
                "{what}: unknown value type {ty}"
            )))
        }
    })
}

/// A tensor info as written, before its type and placement are checked.
struct RawTensorInfo {
    name: String,
    dims: Vec<u64>,
    type_id: u32,
    offset: u64,
}

fn read_tensor_infos(r: &mut Reader, count: usize) -> Result<Vec<RawTensorInfo>, WeightsError> {
    let mut infos = Vec::with_capacity(count);
    for i in 0..count {
        let name = r.string(&format!("name of tensor info {i}"))?;
        let what = format!("tensor info of {name}");
        let n_dims = r.u32(&what)?;
        if n_dims > MAX_DIMS {
            let msg = format!("tensor {name}: n_dims is {n_dims}, at most {MAX_DIMS} are allowed");
            return Err(WeightsError::BadHeader(msg));
        }
        let dims = (0..n_dims)
            .map(|_| r.u64(&what))
            .collect::<Result<Vec<_>, _>>()?;
        let type_id = r.u32(&what)?;
        let offset = r.u64(&what)?;
        infos.push(RawTensorInfo {
            name,
            dims,
            type_id,
            offset,
        });
    }
    Ok(infos)
}

/// Checks a tensor's type, shape and placement; returns where its bytes are in the file.
fn locate(
    raw: RawTensorInfo,
    data_start: usize,
    alignment: u64,
    file_len: usize,
) -> Result<TensorInfo, WeightsError> {
    let RawTensorInfo {
        name,
        dims,
        type_id,
        offset,
    } = raw;
    let Some(storage) = Storage::from_ggml_id(type_id) else {
        return Err(WeightsError::UnknownTensorType { name, id: type_id });
    };
    let dtype = storage.as_dtype();
    let Ok(dims) = dims
        .iter()
        .map(|&d| usize::try_from(d))
        .collect::<Result<Vec<usize>, _>>()
    else {
        return Err(overflow(&format!("dims {dims:?} of tensor {name}")));
    };
    let numel = dims
        .iter()
        .try_fold(1usize, |n, &d| n.checked_mul(d))
        .ok_or_else(|| {
            overflow(&format!(
                "element count of tensor {name} with dims {dims:?}"
            ))
        })?;
    let shape: Vec<usize> = dims.iter().rev().copied().collect();
    let row = dims.first().copied().unwrap_or(1);
    if !row_bytes_fit(dtype, row) {
        return Err(overflow(&format!(
            "row size of tensor {name} with dims {dims:?}"
        )));
    }
    let Some(row_bytes) = storage.row_bytes(row) else {
        let (ty, block) = (dtype.name(), dtype.block_elems());
        let why =
            format!("rows of {row} elements are not a whole number of {ty} blocks of {block}");
        return Err(WeightsError::BadShape { name, shape, why });
    };
    let rows = numel.checked_div(row).unwrap_or(0); // a 0-length row holds no rows
    let size = row_bytes
        .checked_mul(rows)
        .ok_or_else(|| overflow(&format!("byte size of tensor {name} with dims {dims:?}")))?;
    if offset % alignment != 0 {
        return Err(WeightsError::Misaligned {
            name,
            offset,
            alignment,
        });
    }
    let available = file_len.saturating_sub(data_start);
    let end = offset.checked_add(size as u64);
    if end.is_none_or(|end| end > available as u64) {
        let (size, available) = (size as u64, available as u64);
        return Err(WeightsError::TensorOutOfBounds {
            name,
            offset,
            size,
            available,
        });
    }
    // In range of the file, so it fits in usize.
    let start = data_start + offset as usize;
    Ok(TensorInfo {
        name,
        storage,
        shape,
        start,
        len: size,
    })
}

/// A cursor over the header bytes. Reads past the end are `Truncated` errors naming `what`.
struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], WeightsError> {
        if n > self.remaining() {
            return Err(WeightsError::Truncated {
                what: what.to_string(),
                offset: self.pos as u64,
            });
        }
        let bytes = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(bytes)
    }

    fn fixed<const N: usize>(&mut self, what: &str) -> Result<[u8; N], WeightsError> {
        let bytes = self.take(N, what)?;
        Ok(bytes.try_into().expect("take returned N bytes"))
    }

    fn u32(&mut self, what: &str) -> Result<u32, WeightsError> {
        Ok(u32::from_le_bytes(self.fixed(what)?))
    }

    fn u64(&mut self, what: &str) -> Result<u64, WeightsError> {
        Ok(u64::from_le_bytes(self.fixed(what)?))
    }

    /// Refuses a count whose smallest encoding cannot fit in the remaining bytes, so a hostile
    /// count never reserves memory the file does not back.
    fn check_count(
        &self,
        what: &str,
        field: &str,
        count: u64,
        min_each: usize,
    ) -> Result<usize, WeightsError> {
        let fits = count <= (self.remaining() / min_each) as u64;
        fits.then_some(count as usize)
            .ok_or_else(|| WeightsError::CountTooLarge {
                what: format!("{what}{field}"),
                count,
                remaining: self.remaining() as u64,
                min_each: min_each as u64,
            })
    }

    fn string_bytes(&mut self, what: &str) -> Result<&'a [u8], WeightsError> {
        let len = self.u64(what)?;
        if len > self.remaining() as u64 {
            let what = format!("{what} (a string of {len} bytes)");
            return Err(WeightsError::Truncated {
                what,
                offset: self.pos as u64,
            });
        }
        self.take(len as usize, what)
    }

    /// Keys and tensor names must be UTF-8: they are looked up by name.
    fn string(&mut self, what: &str) -> Result<String, WeightsError> {
        let bytes = self.string_bytes(what)?;
        String::from_utf8(bytes.to_vec())
            .map_err(|_| WeightsError::BadHeader(format!("{what} is not valid UTF-8")))
    }

    /// String values are kept even when not UTF-8 (llama.cpp accepts any bytes there), with
    /// invalid sequences replaced, so one odd vocabulary entry does not refuse the model.
    fn string_lossy(&mut self, what: &str) -> Result<String, WeightsError> {
        Ok(String::from_utf8_lossy(self.string_bytes(what)?).into_owned())
    }
}

#[cfg(test)]
mod tests;
