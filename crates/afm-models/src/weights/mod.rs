//! Weight sources: GGUF files and Hugging Face safetensors checkpoints, opened once, validated up
//! front, and read as `TensorView`s that point into the memory map (no copies).
//!
//! This module owns file formats only. Which tensor names an architecture needs, and how GGUF
//! names map to Hugging Face names, belong to the architecture files.

pub mod gguf;
pub mod safetensors;
#[cfg(test)]
pub(crate) mod testfiles;

use std::path::{Path, PathBuf};

use afm_runtime::{DType, RuntimeError, WeightBytes, WeightMatrix};

pub use gguf::{GgufFile, GgufValue};
pub use safetensors::SafetensorsSet;

use crate::source::ModelLocation;

#[derive(Debug, thiserror::Error)]
pub enum WeightsError {
    #[error("reading {}: {source}", .path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{}: not a GGUF file (magic bytes {found:02x?}, expected \"GGUF\")", .path.display())]
    BadMagic { path: PathBuf, found: Vec<u8> },
    #[error("{}: GGUF version {version} is not supported (supported: 2 and 3)", .path.display())]
    UnsupportedVersion { path: PathBuf, version: u32 },
    #[error("truncated file: {what} at byte {offset} runs past the end")]
    Truncated { what: String, offset: u64 },
    #[error(
        "{what} is {count}, but only {remaining} bytes remain and each needs at least {min_each}"
    )]
    CountTooLarge {
        what: String,
        count: u64,
        remaining: u64,
        min_each: u64,
    },
    #[error("integer overflow computing {what}")]
    Overflow { what: String },
    #[error(
        "tensor {name}: {size} bytes at data offset {offset} end past the data ({available} bytes)"
    )]
    TensorOutOfBounds {
        name: String,
        offset: u64,
        size: u64,
        available: u64,
    },
    #[error("tensor {name}: offset {offset} is not a multiple of the alignment {alignment}")]
    Misaligned {
        name: String,
        offset: u64,
        alignment: u64,
    },
    #[error("tensor {name}: unknown or unsupported GGML type id {id}")]
    UnknownTensorType { name: String, id: u32 },
    #[error("tensor {name}: dtype {dtype} is not supported here (supported: F32, F16, BF16)")]
    UnsupportedDType { name: String, dtype: String },
    /// An integer table read as weights, or weights read as an integer table.
    #[error("tensor {name} is {stored}, read here as {wanted}")]
    WrongKind {
        name: String,
        stored: String,
        wanted: &'static str,
    },
    #[error("tensor {name} not found")]
    MissingTensor { name: String },
    #[error("tensor {name} with shape {shape:?}: {why}")]
    BadShape {
        name: String,
        shape: Vec<usize>,
        why: String,
    },
    #[error("bad header: {0}")]
    BadHeader(String),
    #[error("{}: invalid JSON: {source}", .path.display())]
    Json {
        path: PathBuf,
        source: serde_json::Error,
    },
    #[error("shard {shard:?} listed in the index is not inside {}", .dir.display())]
    ShardOutsideDir { shard: String, dir: PathBuf },
    #[error("{what} not found; looked at: {}", join_paths(.looked_at))]
    NotFound {
        what: String,
        looked_at: Vec<PathBuf>,
    },
    #[error("{}: {why}", .path.display())]
    NotAModel { path: PathBuf, why: String },
    #[error("tensor {name}: {source}")]
    Runtime { name: String, source: RuntimeError },
}

fn join_paths(paths: &[PathBuf]) -> String {
    let shown: Vec<String> = paths.iter().map(|p| p.display().to_string()).collect();
    shown.join(", ")
}

/// Whether `DType::row_bytes(n)` can be computed: it multiplies unchecked, and header fields
/// can claim rows of any length.
fn row_bytes_fit(dtype: DType, n: usize) -> bool {
    (n / dtype.block_elems())
        .checked_mul(dtype.block_bytes())
        .is_some()
}

/// Opens a file read-only and maps it.
fn map_file(path: &Path) -> Result<memmap2::Mmap, WeightsError> {
    let io = |source| WeightsError::Io {
        path: path.to_path_buf(),
        source,
    };
    let file = std::fs::File::open(path).map_err(io)?;
    // Populated at load (MAP_POPULATE, as llama.cpp maps its models): the page tables are built
    // once here instead of by a page fault per 4 KiB during the first request's prefill.
    // SAFETY: the mapping is read-only and weight files are not modified while served; a file
    // truncated underneath us would fault, the same contract llama.cpp and safetensors accept.
    unsafe { memmap2::MmapOptions::new().populate().map(&file) }.map_err(io)
}

/// One tensor as stored: its type, its shape (outermost first, like PyTorch: a `[out, in]`
/// matrix is `vec![out, in]`) and its bytes, usually a slice of a memory map.
#[derive(Debug, Clone)]
pub struct TensorView {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub bytes: WeightBytes,
}

impl TensorView {
    /// Number of elements (1 for a 0-d tensor). Saturates instead of overflowing, so a
    /// hand-built view with an absurd shape fails the size check in `to_f32` rather than panic.
    pub fn numel(&self) -> usize {
        self.shape.iter().fold(1usize, |n, &d| n.saturating_mul(d))
    }

    /// The innermost dimension, along which quantization blocks run.
    fn row_len(&self) -> usize {
        self.shape.last().copied().unwrap_or(1)
    }

    fn bad_shape(&self, why: String) -> WeightsError {
        WeightsError::BadShape {
            name: self.name.clone(),
            shape: self.shape.clone(),
            why,
        }
    }

    /// Bytes this shape needs in this dtype, checked against what the view holds.
    fn check_len(&self) -> Result<(), WeightsError> {
        let row = self.row_len();
        if !row_bytes_fit(self.dtype, row) {
            return Err(self.bad_shape(format!("rows of {row} elements overflow usize")));
        }
        let row_bytes = self.dtype.row_bytes(row).ok_or_else(|| {
            self.bad_shape(format!(
                "rows of {row} elements are not a whole number of {} blocks of {}",
                self.dtype.name(),
                self.dtype.block_elems()
            ))
        })?;
        let rows = self.numel().checked_div(row).unwrap_or(0);
        let want = row_bytes.checked_mul(rows);
        if want != Some(self.bytes.len()) {
            return Err(self.bad_shape(format!(
                "{} needs {} bytes, the view holds {}",
                self.dtype.name(),
                want.map_or("more than usize::MAX".to_string(), |w| w.to_string()),
                self.bytes.len()
            )));
        }
        Ok(())
    }

    /// All elements as f32, in storage order. Plain floats are decoded here; block-quantized
    /// types go through `afm_runtime::quant::dequantize_row`, one innermost row at a time.
    pub fn to_f32(&self) -> Result<Vec<f32>, WeightsError> {
        self.check_len()?;
        let src = self.bytes.as_slice();
        let out = match self.dtype {
            DType::F32 => src
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            DType::F16 => src
                .chunks_exact(2)
                .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            DType::BF16 => src
                .chunks_exact(2)
                .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            quantized => {
                let row = self.row_len();
                let mut out = vec![0f32; self.numel()];
                if row > 0 {
                    let row_bytes = quantized.row_bytes(row).expect("checked by check_len");
                    for (s, o) in src.chunks_exact(row_bytes).zip(out.chunks_exact_mut(row)) {
                        afm_runtime::quant::dequantize_row(quantized, s, o);
                    }
                }
                out
            }
        };
        Ok(out)
    }

    /// A 2-D tensor as a weight matrix: `shape[0]` rows (output features) × `shape[1]` columns.
    pub fn into_matrix(self) -> Result<WeightMatrix, WeightsError> {
        let &[rows, cols] = self.shape.as_slice() else {
            let n = self.shape.len();
            return Err(self.bad_shape(format!("a matrix must be 2-D, this is {n}-D")));
        };
        WeightMatrix::new(self.dtype, rows, cols, self.bytes).map_err(|source| {
            WeightsError::Runtime {
                name: self.name,
                source,
            }
        })
    }
}

/// Where a model's weights come from. Both kinds feed the same architecture code.
#[derive(Debug)]
pub enum WeightSource {
    Gguf(GgufFile),
    Safetensors(SafetensorsSet),
}

impl WeightSource {
    /// Opens what `source::resolve_model` found.
    pub fn open(location: &ModelLocation) -> Result<Self, WeightsError> {
        Ok(match location {
            ModelLocation::Gguf(path) => WeightSource::Gguf(GgufFile::open(path)?),
            ModelLocation::HfDir(dir) => WeightSource::Safetensors(SafetensorsSet::open_dir(dir)?),
        })
    }

    pub fn tensor(&self, name: &str) -> Result<TensorView, WeightsError> {
        match self {
            WeightSource::Gguf(f) => f.tensor(name),
            WeightSource::Safetensors(s) => s.tensor(name),
        }
    }

    pub fn contains(&self, name: &str) -> bool {
        match self {
            WeightSource::Gguf(f) => f.contains(name),
            WeightSource::Safetensors(s) => s.contains(name),
        }
    }

    /// An integer tensor as i64 values with its shape (safetensors I64/I32, GGUF I8..I64).
    pub fn integers(&self, name: &str) -> Result<(Vec<usize>, Vec<i64>), WeightsError> {
        match self {
            WeightSource::Gguf(f) => f.integers(name),
            WeightSource::Safetensors(s) => s.integers(name),
        }
    }

    /// GGUF: file order. Safetensors: sorted.
    pub fn tensor_names(&self) -> Vec<String> {
        match self {
            WeightSource::Gguf(f) => f.tensor_names().map(str::to_string).collect(),
            WeightSource::Safetensors(s) => s.tensor_names(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view(dtype: DType, shape: Vec<usize>, bytes: Vec<u8>) -> TensorView {
        TensorView {
            name: "t".into(),
            dtype,
            shape,
            bytes: WeightBytes::from_vec(bytes),
        }
    }

    #[test]
    fn to_f32_decodes_plain_floats() {
        let f32s: Vec<u8> = [1.5f32, -2.0]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        assert_eq!(
            view(DType::F32, vec![2], f32s).to_f32().unwrap(),
            vec![1.5, -2.0]
        );
        // 0x3c00 = 1.0 in f16, 0xc000 = -2.0; 0x3f80 = 1.0 in bf16, 0x4040 = 3.0.
        let f16s = vec![0x00, 0x3c, 0x00, 0xc0];
        assert_eq!(
            view(DType::F16, vec![1, 2], f16s).to_f32().unwrap(),
            vec![1.0, -2.0]
        );
        let bf16s = vec![0x80, 0x3f, 0x40, 0x40];
        assert_eq!(
            view(DType::BF16, vec![2, 1], bf16s).to_f32().unwrap(),
            vec![1.0, 3.0]
        );
    }

    #[test]
    fn to_f32_rejects_a_view_whose_bytes_do_not_fit_its_shape() {
        let err = view(DType::F32, vec![3], vec![0; 8]).to_f32().unwrap_err();
        assert!(matches!(err, WeightsError::BadShape { .. }), "{err}");
        let huge = view(DType::F32, vec![usize::MAX, 4], vec![0; 8])
            .to_f32()
            .unwrap_err();
        assert!(matches!(huge, WeightsError::BadShape { .. }), "{huge}");
        let partial_block = view(DType::Q8_0, vec![2, 16], vec![0; 34])
            .to_f32()
            .unwrap_err();
        assert!(
            partial_block.to_string().contains("block"),
            "{partial_block}"
        );
    }

    #[test]
    fn into_matrix_takes_2d_and_refuses_1d() {
        let bytes: Vec<u8> = (0..6).flat_map(|i| (i as f32).to_le_bytes()).collect();
        let m = view(DType::F32, vec![2, 3], bytes.clone())
            .into_matrix()
            .unwrap();
        assert_eq!((m.rows(), m.cols()), (2, 3));
        let err = view(DType::F32, vec![6], bytes).into_matrix().unwrap_err();
        assert!(err.to_string().contains("2-D"), "{err}");
    }
}
