//! Hugging Face safetensors checkpoints: one file, or a directory of shards (with or without
//! `model.safetensors.index.json`), memory-mapped and validated when opened.
//!
//! ```text
//! u64 header_len (LE) | JSON header (header_len bytes) | data section
//! header: { "__metadata__": {..},                      (skipped)
//!           "<name>": {"dtype": "BF16", "shape": [out, in], "data_offsets": [begin, end]}, .. }
//! offsets are relative to the data section; end - begin = numel × dtype size
//! ```
//!
//! Every entry's offsets and size are checked at open for every dtype; `tensor` serves the
//! float types the runtime computes with (F32, F16, BF16) and names any other dtype it meets.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Component, Path, PathBuf};
use std::sync::Arc;

use afm_runtime::{DType, WeightBytes};
use serde::Deserialize;

use super::{map_file, TensorView, WeightsError};

type Bytes = Arc<dyn AsRef<[u8]> + Send + Sync>;

const INDEX_FILE: &str = "model.safetensors.index.json";
/// The reference implementation's limit; it bounds what a hostile header can make us parse.
const MAX_HEADER_BYTES: u64 = 100 * 1024 * 1024;

struct Shard {
    path: PathBuf,
    data: Bytes,
}

/// One tensor's place, checked at open.
struct Entry {
    shard: usize,
    dtype: String,
    shape: Vec<usize>,
    start: usize,
    len: usize,
}

#[derive(Deserialize)]
struct RawEntry {
    dtype: String,
    shape: Vec<u64>,
    data_offsets: [u64; 2],
}

#[derive(Deserialize)]
struct Index {
    weight_map: BTreeMap<String, String>,
}

pub struct SafetensorsSet {
    shards: Vec<Shard>,
    tensors: BTreeMap<String, Entry>,
}

impl std::fmt::Debug for SafetensorsSet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let paths: Vec<&Path> = self.shards.iter().map(|s| s.path.as_path()).collect();
        f.debug_struct("SafetensorsSet")
            .field("shards", &paths)
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

impl SafetensorsSet {
    /// A checkpoint directory. With an index, its shards (paths must stay inside `dir`) plus any
    /// other `*.safetensors` there (e.g. a separate `mtp.safetensors`); without one, every
    /// `*.safetensors` in `dir`. Mistral's `consolidated*.safetensors` duplicates the same
    /// weights under other names, so it is read only when nothing else is there.
    pub fn open_dir(dir: &Path) -> Result<Self, WeightsError> {
        let index_path = dir.join(INDEX_FILE);
        let index = if index_path.is_file() {
            Some(read_index(&index_path)?)
        } else {
            None
        };
        let mut files = Vec::new();
        if let Some(index) = &index {
            let shards: BTreeSet<&str> = index.weight_map.values().map(String::as_str).collect();
            for shard in shards {
                files.push(shard_path(dir, shard)?);
            }
        }
        let (mut others, consolidated) = safetensors_in(dir)?;
        others.retain(|p| !files.contains(p));
        files.extend(others);
        if files.is_empty() {
            files = consolidated;
        }
        if files.is_empty() {
            let what = format!("safetensors weights in {}", dir.display());
            return Err(WeightsError::NotFound {
                what,
                looked_at: vec![index_path, dir.into()],
            });
        }

        let mut set = Self::empty();
        for path in files {
            let data = Arc::new(map_file(&path)?);
            set.add_shard(path, data)?;
        }
        if let Some(index) = index {
            set.check_index(&index_path, dir, &index)?;
        }
        Ok(set)
    }

    pub fn open_file(path: &Path) -> Result<Self, WeightsError> {
        let mut set = Self::empty();
        set.add_shard(path.to_path_buf(), Arc::new(map_file(path)?))?;
        Ok(set)
    }

    /// Parses a safetensors image held in memory (tests, fuzzing).
    pub fn from_bytes(bytes: Vec<u8>) -> Result<Self, WeightsError> {
        let mut set = Self::empty();
        set.add_shard(PathBuf::from("<memory>"), Arc::new(bytes))?;
        Ok(set)
    }

    /// A view into the shard's map. Only F32, F16 and BF16 are served.
    pub fn tensor(&self, name: &str) -> Result<TensorView, WeightsError> {
        let entry = self
            .tensors
            .get(name)
            .ok_or_else(|| WeightsError::MissingTensor {
                name: name.to_string(),
            })?;
        let dtype = match entry.dtype.as_str() {
            "F32" => DType::F32,
            "F16" => DType::F16,
            "BF16" => DType::BF16,
            other => {
                let (name, dtype) = (name.to_string(), other.to_string());
                return Err(WeightsError::UnsupportedDType { name, dtype });
            }
        };
        let data = self.shards[entry.shard].data.clone();
        let available = (*data).as_ref().len() as u64;
        let bytes = WeightBytes::slice_of(data, entry.start, entry.len).ok_or_else(|| {
            WeightsError::TensorOutOfBounds {
                name: name.to_string(),
                offset: entry.start as u64,
                size: entry.len as u64,
                available,
            }
        })?;
        Ok(TensorView {
            name: name.to_string(),
            dtype,
            shape: entry.shape.clone(),
            bytes,
        })
    }

    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// Sorted.
    pub fn tensor_names(&self) -> Vec<String> {
        self.tensors.keys().cloned().collect()
    }

    /// The dtype string as stored (e.g. "BF16", "F8_E4M3"), for tensors `tensor` may refuse.
    pub fn dtype_of(&self, name: &str) -> Option<&str> {
        self.tensors.get(name).map(|e| e.dtype.as_str())
    }

    /// An integer tensor (I64 or I32) as i64 values in storage order, with its shape: lookup
    /// tables such as DeepSeek V4's hash-routing `tid2eid`.
    pub fn integers(&self, name: &str) -> Result<(Vec<usize>, Vec<i64>), WeightsError> {
        let entry = self
            .tensors
            .get(name)
            .ok_or_else(|| WeightsError::MissingTensor {
                name: name.to_string(),
            })?;
        let data = (*self.shards[entry.shard].data).as_ref();
        // Offsets and sizes were checked at open.
        let bytes = &data[entry.start..entry.start + entry.len];
        let values = match entry.dtype.as_str() {
            "I64" => bytes
                .chunks_exact(8)
                .map(|c| i64::from_le_bytes(c.try_into().expect("chunks of 8")))
                .collect(),
            "I32" => bytes
                .chunks_exact(4)
                .map(|c| i32::from_le_bytes(c.try_into().expect("chunks of 4")) as i64)
                .collect(),
            other => {
                let (name, dtype) = (name.to_string(), other.to_string());
                return Err(WeightsError::UnsupportedDType { name, dtype });
            }
        };
        Ok((entry.shape.clone(), values))
    }

    fn empty() -> Self {
        Self {
            shards: Vec::new(),
            tensors: BTreeMap::new(),
        }
    }

    fn add_shard(&mut self, path: PathBuf, data: Bytes) -> Result<(), WeightsError> {
        let shard = self.shards.len();
        for (name, mut entry) in parse_header((*data).as_ref(), &path)? {
            if let Some(other) = self.tensors.get(&name) {
                let first = self.shards[other.shard].path.display();
                let msg = format!("tensor {name} is in both {first} and {}", path.display());
                return Err(WeightsError::BadHeader(msg));
            }
            entry.shard = shard;
            self.tensors.insert(name, entry);
        }
        self.shards.push(Shard { path, data });
        Ok(())
    }

    /// Every name the index lists must be in the shard it names.
    fn check_index(
        &self,
        index_path: &Path,
        dir: &Path,
        index: &Index,
    ) -> Result<(), WeightsError> {
        for (name, shard) in &index.weight_map {
            let want = shard_path(dir, shard)?;
            let found = self.tensors.get(name).map(|e| &self.shards[e.shard].path);
            if found != Some(&want) {
                let msg = format!(
                    "{} puts {name} in {shard}, but that shard does not hold it",
                    index_path.display()
                );
                return Err(WeightsError::BadHeader(msg));
            }
        }
        Ok(())
    }
}

fn read_index(path: &Path) -> Result<Index, WeightsError> {
    let text = std::fs::read(path).map_err(|source| WeightsError::Io {
        path: path.into(),
        source,
    })?;
    serde_json::from_slice(&text).map_err(|source| WeightsError::Json {
        path: path.into(),
        source,
    })
}

/// A shard named by the index, which must stay inside `dir`. Checked on the name, not by
/// canonicalizing: the Hugging Face cache links snapshot files to blobs outside the snapshot.
fn shard_path(dir: &Path, shard: &str) -> Result<PathBuf, WeightsError> {
    let outside = || WeightsError::ShardOutsideDir {
        shard: shard.to_string(),
        dir: dir.into(),
    };
    let mut path = dir.to_path_buf();
    let mut depth = 0;
    for c in Path::new(shard).components() {
        match c {
            Component::Normal(part) => {
                path.push(part);
                depth += 1;
            }
            Component::CurDir => {}
            _ => return Err(outside()),
        }
    }
    if depth == 0 {
        return Err(outside());
    }
    Ok(path)
}

/// `*.safetensors` files in `dir`, sorted: (ordinary ones, Mistral `consolidated*` ones).
fn safetensors_in(dir: &Path) -> Result<(Vec<PathBuf>, Vec<PathBuf>), WeightsError> {
    let io = |source| WeightsError::Io {
        path: dir.into(),
        source,
    };
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(io)? {
        let path = entry.map_err(io)?.path();
        if path.extension().is_some_and(|e| e == "safetensors") && path.is_file() {
            files.push(path);
        }
    }
    files.sort();
    Ok(files.into_iter().partition(|p| {
        !p.file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.starts_with("consolidated"))
    }))
}

/// Entries of one file, each checked against the file's data section.
fn parse_header(buf: &[u8], path: &Path) -> Result<Vec<(String, Entry)>, WeightsError> {
    let Some(len_bytes) = buf.get(..8) else {
        let what = format!("safetensors header length of {}", path.display());
        return Err(WeightsError::Truncated { what, offset: 0 });
    };
    let header_len = u64::from_le_bytes(len_bytes.try_into().expect("8 bytes"));
    if header_len > MAX_HEADER_BYTES {
        let msg = format!(
            "{}: header length {header_len} exceeds the limit of {MAX_HEADER_BYTES} bytes",
            path.display()
        );
        return Err(WeightsError::BadHeader(msg));
    }
    let data_start = 8 + header_len as usize;
    if data_start > buf.len() {
        let what = format!("{header_len}-byte JSON header of {}", path.display());
        return Err(WeightsError::Truncated { what, offset: 8 });
    }
    let header: BTreeMap<String, serde_json::Value> = serde_json::from_slice(&buf[8..data_start])
        .map_err(|source| WeightsError::Json {
        path: path.into(),
        source,
    })?;
    let data_len = buf.len() - data_start;
    let mut entries = Vec::with_capacity(header.len());
    for (name, value) in header {
        if name == "__metadata__" {
            continue;
        }
        let raw: RawEntry = serde_json::from_value(value).map_err(|e| {
            WeightsError::BadHeader(format!("{}: tensor {name}: {e}", path.display()))
        })?;
        let entry = check_entry(&name, raw, data_start, data_len)?;
        entries.push((name, entry));
    }
    Ok(entries)
}

fn check_entry(
    name: &str,
    raw: RawEntry,
    data_start: usize,
    data_len: usize,
) -> Result<Entry, WeightsError> {
    let overflow = |what: &str| WeightsError::Overflow {
        what: format!("{what} of tensor {name}"),
    };
    let shape = raw
        .shape
        .iter()
        .map(|&d| usize::try_from(d))
        .collect::<Result<Vec<usize>, _>>()
        .map_err(|_| overflow("shape"))?;
    let numel = shape
        .iter()
        .try_fold(1usize, |n, &d| n.checked_mul(d))
        .ok_or_else(|| overflow("element count"))?;
    let [begin, end] = raw.data_offsets;
    if begin > end || end > data_len as u64 {
        return Err(WeightsError::TensorOutOfBounds {
            name: name.to_string(),
            offset: begin,
            size: end.saturating_sub(begin),
            available: data_len as u64,
        });
    }
    if let Some(bits) = dtype_bits(&raw.dtype) {
        let total_bits = numel
            .checked_mul(bits)
            .ok_or_else(|| overflow("byte size"))?;
        if total_bits % 8 != 0 || (total_bits / 8) as u64 != end - begin {
            let why = format!(
                "{numel} elements of {} need {total_bits} bits, but data_offsets [{begin}, {end}] span {} bytes",
                raw.dtype,
                end - begin
            );
            return Err(WeightsError::BadShape {
                name: name.to_string(),
                shape,
                why,
            });
        }
    }
    // Both within the file, so they fit in usize.
    let (start, len) = (data_start + begin as usize, (end - begin) as usize);
    Ok(Entry {
        shard: 0,
        dtype: raw.dtype,
        shape,
        start,
        len,
    })
}

/// Bits per element of the safetensors dtypes; `None` for a name this reader does not know,
/// whose size is then left unchecked (`tensor` refuses it anyway).
fn dtype_bits(dtype: &str) -> Option<usize> {
    Some(match dtype {
        "F4" => 4,
        "F6_E2M3" | "F6_E3M2" => 6,
        "BOOL" | "U8" | "I8" | "F8_E5M2" | "F8_E4M3" | "F8_E8M0" => 8,
        "I16" | "U16" | "F16" | "BF16" => 16,
        "I32" | "U32" | "F32" => 32,
        "I64" | "U64" | "F64" | "C64" => 64,
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::ModelLocation;
    use crate::weights::testfiles::{f32_bytes, safetensors, safetensors_raw, ScratchDir};
    use crate::weights::WeightSource;

    fn err_of(bytes: Vec<u8>) -> WeightsError {
        SafetensorsSet::from_bytes(bytes).expect_err("should be refused")
    }

    fn one(name: &str, values: &[f32]) -> Vec<u8> {
        safetensors(&[(name, "F32", &[values.len()], f32_bytes(values))])
    }

    #[test]
    fn reads_float_tensors_and_skips_metadata() {
        // f16 1.0 = 0x3c00, -2.0 = 0xc000; bf16 1.0 = 0x3f80, 3.0 = 0x4040.
        let bytes = safetensors(&[
            ("model.norm.weight", "F32", &[2], f32_bytes(&[0.5, -1.0])),
            (
                "lm_head.weight",
                "F16",
                &[2, 1],
                vec![0x00, 0x3c, 0x00, 0xc0],
            ),
            (
                "embed.weight",
                "BF16",
                &[1, 2],
                vec![0x80, 0x3f, 0x40, 0x40],
            ),
        ]);
        let set = SafetensorsSet::from_bytes(bytes).unwrap();
        assert_eq!(
            set.tensor_names(),
            ["embed.weight", "lm_head.weight", "model.norm.weight"]
        );
        assert!(!set.contains("__metadata__"));
        let head = set.tensor("lm_head.weight").unwrap();
        assert_eq!((head.dtype, head.shape.clone()), (DType::F16, vec![2, 1]));
        assert_eq!(head.to_f32().unwrap(), [1.0, -2.0]);
        assert_eq!(
            set.tensor("embed.weight").unwrap().to_f32().unwrap(),
            [1.0, 3.0]
        );
        assert_eq!(
            set.tensor("model.norm.weight").unwrap().to_f32().unwrap(),
            [0.5, -1.0]
        );
        assert!(matches!(
            set.tensor("nope"),
            Err(WeightsError::MissingTensor { .. })
        ));
    }

    #[test]
    fn other_dtypes_open_but_are_refused_by_name() {
        let bytes = safetensors(&[
            ("scales", "I8", &[4], vec![1, 2, 3, 4]),
            ("fp8", "F8_E4M3", &[2], vec![0, 0]),
            ("future", "F3_NEW", &[2], vec![0, 0, 0]),
            ("ok", "F32", &[1], f32_bytes(&[1.0])),
        ]);
        let set = SafetensorsSet::from_bytes(bytes).unwrap();
        assert_eq!(set.dtype_of("fp8"), Some("F8_E4M3"));
        for (name, dtype) in [("scales", "I8"), ("fp8", "F8_E4M3"), ("future", "F3_NEW")] {
            let err = set.tensor(name).unwrap_err();
            assert!(
                matches!(&err, WeightsError::UnsupportedDType { dtype: d, .. } if d == dtype),
                "{err}"
            );
            assert!(err.to_string().contains(name), "{err}");
        }
        assert!(set.tensor("ok").is_ok());
    }

    #[test]
    fn malformed_files_are_refused() {
        assert!(matches!(
            err_of(vec![1, 2, 3]),
            WeightsError::Truncated { offset: 0, .. }
        ));
        let mut past_end = one("w", &[1.0]);
        past_end[..8].copy_from_slice(&10_000u64.to_le_bytes());
        assert!(matches!(
            err_of(past_end),
            WeightsError::Truncated { offset: 8, .. }
        ));
        let mut over_limit = one("w", &[1.0]);
        over_limit[..8].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(err_of(over_limit).to_string().contains("exceeds the limit"));
        assert!(matches!(
            err_of(safetensors_raw("{not json", &[])),
            WeightsError::Json { .. }
        ));
        assert!(matches!(
            err_of(safetensors_raw("[1, 2]", &[])),
            WeightsError::Json { .. }
        ));

        let entry = |e: &str| safetensors_raw(&format!(r#"{{"w": {e}}}"#), &[0; 8]);
        let missing = err_of(entry(r#"{"dtype": "F32", "shape": [2]}"#));
        assert!(missing.to_string().contains("data_offsets"), "{missing}");
        let beyond = err_of(entry(
            r#"{"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}"#,
        ));
        assert!(
            matches!(beyond, WeightsError::TensorOutOfBounds { available: 8, .. }),
            "{beyond}"
        );
        let reversed = err_of(entry(
            r#"{"dtype": "F32", "shape": [0], "data_offsets": [8, 4]}"#,
        ));
        assert!(
            matches!(reversed, WeightsError::TensorOutOfBounds { .. }),
            "{reversed}"
        );
        let wrong_size = err_of(entry(
            r#"{"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}"#,
        ));
        assert!(
            matches!(&wrong_size, WeightsError::BadShape { shape, .. } if shape == &[3]),
            "{wrong_size}"
        );
        let huge = err_of(entry(
            r#"{"dtype": "F32", "shape": [4294967296, 4294967296], "data_offsets": [0, 8]}"#,
        ));
        assert!(matches!(huge, WeightsError::Overflow { .. }), "{huge}");
        let negative = err_of(entry(
            r#"{"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}"#,
        ));
        assert!(matches!(negative, WeightsError::BadHeader(_)), "{negative}");
    }

    #[test]
    fn every_truncation_is_an_error() {
        let bytes = one("w", &[1.0, 2.0]);
        for len in 0..bytes.len() {
            assert!(
                SafetensorsSet::from_bytes(bytes[..len].to_vec()).is_err(),
                "prefix of {len} bytes"
            );
        }
    }

    #[test]
    fn mutated_files_never_panic() {
        let good = safetensors(&[
            ("a", "F32", &[2, 2], f32_bytes(&[1.0, 2.0, 3.0, 4.0])),
            ("b", "BF16", &[3], vec![0; 6]),
        ]);
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for _ in 0..5000 {
            let mut bytes = good.clone();
            for _ in 0..1 + next() % 3 {
                let i = (next() % bytes.len() as u64) as usize;
                bytes[i] = next() as u8;
            }
            if let Ok(set) = SafetensorsSet::from_bytes(bytes) {
                for name in set.tensor_names() {
                    let _ = set.tensor(&name).map(|t| t.to_f32());
                }
            }
        }
    }

    fn write_index(dir: &ScratchDir, map: &[(&str, &str)]) {
        let weight_map: serde_json::Map<String, serde_json::Value> = map
            .iter()
            .map(|(k, v)| (k.to_string(), serde_json::json!(v)))
            .collect();
        let index = serde_json::json!({"metadata": {"total_size": 12}, "weight_map": weight_map});
        dir.write(INDEX_FILE, index.to_string().as_bytes());
    }

    #[test]
    fn sharded_directory_with_index_and_an_extra_shard() {
        let dir = ScratchDir::new("st-sharded");
        dir.write("model-00001-of-00002.safetensors", &one("a", &[1.0]));
        dir.write("model-00002-of-00002.safetensors", &one("b", &[2.0, 3.0]));
        dir.write("mtp.safetensors", &one("mtp.fc", &[4.0]));
        dir.write("consolidated.safetensors", &one("tok_embeddings", &[9.0]));
        dir.write("config.json", b"{}");
        write_index(
            &dir,
            &[
                ("a", "model-00001-of-00002.safetensors"),
                ("b", "./model-00002-of-00002.safetensors"),
            ],
        );
        let set = SafetensorsSet::open_dir(&dir.0).unwrap();
        assert_eq!(set.tensor_names(), ["a", "b", "mtp.fc"]);
        assert_eq!(set.tensor("b").unwrap().to_f32().unwrap(), [2.0, 3.0]);
        assert_eq!(set.tensor("mtp.fc").unwrap().to_f32().unwrap(), [4.0]);

        let source = WeightSource::open(&ModelLocation::HfDir(dir.0.clone())).unwrap();
        assert_eq!(source.tensor_names(), ["a", "b", "mtp.fc"]);
        assert!(source.contains("a"));
        assert_eq!(source.tensor("a").unwrap().to_f32().unwrap(), [1.0]);
    }

    #[test]
    fn directory_without_index_reads_every_file() {
        let dir = ScratchDir::new("st-plain");
        dir.write("consolidated.safetensors", &one("tok_embeddings", &[9.0]));
        assert_eq!(
            SafetensorsSet::open_dir(&dir.0).unwrap().tensor_names(),
            ["tok_embeddings"]
        );
        dir.write("model.safetensors", &one("w", &[1.0]));
        let set = SafetensorsSet::open_dir(&dir.0).unwrap();
        assert_eq!(set.tensor_names(), ["w"]);
        dir.write("extra.safetensors", &one("w", &[2.0]));
        let err = SafetensorsSet::open_dir(&dir.0).unwrap_err();
        assert!(err.to_string().contains("tensor w is in both"), "{err}");

        let empty = ScratchDir::new("st-empty");
        assert!(matches!(
            SafetensorsSet::open_dir(&empty.0),
            Err(WeightsError::NotFound { .. })
        ));
        let file = SafetensorsSet::open_file(&dir.0.join("model.safetensors")).unwrap();
        assert_eq!(file.tensor("w").unwrap().to_f32().unwrap(), [1.0]);
    }

    #[test]
    fn index_must_stay_inside_the_directory_and_match_its_shards() {
        let dir = ScratchDir::new("st-index");
        dir.write("model.safetensors", &one("a", &[1.0]));
        for evil in [
            "../outside.safetensors",
            "/etc/passwd",
            "sub/../../x.safetensors",
            "",
        ] {
            write_index(&dir, &[("a", evil)]);
            let err = SafetensorsSet::open_dir(&dir.0).unwrap_err();
            assert!(
                matches!(&err, WeightsError::ShardOutsideDir { shard, .. } if shard == evil),
                "{err}"
            );
        }
        write_index(
            &dir,
            &[("a", "model.safetensors"), ("ghost", "model.safetensors")],
        );
        let err = SafetensorsSet::open_dir(&dir.0).unwrap_err();
        assert!(err.to_string().contains("ghost"), "{err}");
        write_index(
            &dir,
            &[("a", "model.safetensors"), ("b", "missing.safetensors")],
        );
        let err = SafetensorsSet::open_dir(&dir.0).unwrap_err();
        assert!(
            matches!(&err, WeightsError::Io { path, .. } if path.ends_with("missing.safetensors")),
            "{err}"
        );
        dir.write(INDEX_FILE, b"{\"weight_map\": 3}");
        assert!(matches!(
            SafetensorsSet::open_dir(&dir.0),
            Err(WeightsError::Json { .. })
        ));
    }
}
