//! Test-only writers that lay out GGUF and safetensors files byte by byte, following the format
//! specs rather than our readers, plus scratch directories for them.

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};

use super::GgufValue;

pub fn value_type(v: &GgufValue) -> u32 {
    match v {
        GgufValue::U8(_) => 0,
        GgufValue::I8(_) => 1,
        GgufValue::U16(_) => 2,
        GgufValue::I16(_) => 3,
        GgufValue::U32(_) => 4,
        GgufValue::I32(_) => 5,
        GgufValue::F32(_) => 6,
        GgufValue::Bool(_) => 7,
        GgufValue::Str(_) => 8,
        GgufValue::Array(_) => 9,
        GgufValue::U64(_) => 10,
        GgufValue::I64(_) => 11,
        GgufValue::F64(_) => 12,
    }
}

pub fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

/// The value's bytes, without its type id. An empty array is written with element type u8.
pub fn put_value(out: &mut Vec<u8>, v: &GgufValue) {
    match v {
        GgufValue::U8(x) => out.extend(x.to_le_bytes()),
        GgufValue::I8(x) => out.extend(x.to_le_bytes()),
        GgufValue::U16(x) => out.extend(x.to_le_bytes()),
        GgufValue::I16(x) => out.extend(x.to_le_bytes()),
        GgufValue::U32(x) => out.extend(x.to_le_bytes()),
        GgufValue::I32(x) => out.extend(x.to_le_bytes()),
        GgufValue::F32(x) => out.extend(x.to_le_bytes()),
        GgufValue::Bool(x) => out.push(u8::from(*x)),
        GgufValue::Str(s) => put_str(out, s),
        GgufValue::Array(items) => {
            out.extend(items.first().map_or(0, value_type).to_le_bytes());
            out.extend((items.len() as u64).to_le_bytes());
            for item in items {
                put_value(out, item);
            }
        }
        GgufValue::U64(x) => out.extend(x.to_le_bytes()),
        GgufValue::I64(x) => out.extend(x.to_le_bytes()),
        GgufValue::F64(x) => out.extend(x.to_le_bytes()),
    }
}

pub struct TestTensor {
    pub name: String,
    /// GGUF order: innermost dimension first.
    pub dims: Vec<u64>,
    pub type_id: u32,
    pub data: Vec<u8>,
    /// Written instead of the computed offset, to build broken files.
    pub offset: Option<u64>,
}

impl TestTensor {
    pub fn f32(name: &str, dims: &[u64], values: &[f32]) -> Self {
        let data = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        Self {
            name: name.into(),
            dims: dims.to_vec(),
            type_id: 0,
            data,
            offset: None,
        }
    }
}

pub struct GgufBuilder {
    pub version: u32,
    pub kvs: Vec<(String, GgufValue)>,
    pub tensors: Vec<TestTensor>,
    /// The layout's alignment; add `general.alignment` to `kvs` yourself when it is not 32.
    pub alignment: usize,
}

impl GgufBuilder {
    pub fn new() -> Self {
        Self {
            version: 3,
            kvs: Vec::new(),
            tensors: Vec::new(),
            alignment: 32,
        }
    }

    pub fn kv(mut self, key: &str, v: GgufValue) -> Self {
        self.kvs.push((key.into(), v));
        self
    }

    pub fn tensor(mut self, t: TestTensor) -> Self {
        self.tensors.push(t);
        self
    }

    /// The file, and the byte offset where the data section starts.
    pub fn build_with_data_start(&self) -> (Vec<u8>, usize) {
        let mut out = Vec::new();
        out.extend(b"GGUF");
        out.extend(self.version.to_le_bytes());
        out.extend((self.tensors.len() as u64).to_le_bytes());
        out.extend((self.kvs.len() as u64).to_le_bytes());
        for (key, v) in &self.kvs {
            put_str(&mut out, key);
            out.extend(value_type(v).to_le_bytes());
            put_value(&mut out, v);
        }
        let mut offsets = Vec::new();
        let mut next = 0usize;
        for t in &self.tensors {
            put_str(&mut out, &t.name);
            out.extend((t.dims.len() as u32).to_le_bytes());
            for d in &t.dims {
                out.extend(d.to_le_bytes());
            }
            out.extend(t.type_id.to_le_bytes());
            out.extend(t.offset.unwrap_or(next as u64).to_le_bytes());
            offsets.push(next);
            next = (next + t.data.len()).next_multiple_of(self.alignment);
        }
        out.resize(out.len().next_multiple_of(self.alignment), 0);
        let data_start = out.len();
        for (t, off) in self.tensors.iter().zip(offsets) {
            out.resize(data_start + off, 0);
            out.extend(&t.data);
        }
        (out, data_start)
    }

    pub fn build(&self) -> Vec<u8> {
        self.build_with_data_start().0
    }
}

/// A safetensors file from a raw JSON header and data section.
pub fn safetensors_raw(header: &str, data: &[u8]) -> Vec<u8> {
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend(header.as_bytes());
    out.extend(data);
    out
}

/// A well-formed safetensors file: tensors packed in order, with a `__metadata__` entry.
pub fn safetensors(tensors: &[(&str, &str, &[usize], Vec<u8>)]) -> Vec<u8> {
    let mut header = serde_json::Map::new();
    header.insert("__metadata__".into(), serde_json::json!({"format": "pt"}));
    let mut data = Vec::new();
    for (name, dtype, shape, bytes) in tensors {
        let begin = data.len();
        data.extend(bytes);
        let entry = serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [begin, data.len()]});
        header.insert(name.to_string(), entry);
    }
    let mut json = serde_json::Value::Object(header).to_string();
    // Writers pad the header with spaces to 8 bytes; readers must accept that.
    json.push_str(&" ".repeat(json.len().next_multiple_of(8) - json.len()));
    safetensors_raw(&json, &data)
}

pub fn f32_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// A fresh, empty directory under the system temp dir; removed when dropped.
pub struct ScratchDir(pub PathBuf);

impl ScratchDir {
    pub fn new(tag: &str) -> Self {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("afm-models-{tag}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("create scratch dir");
        Self(dir)
    }

    pub fn write(&self, rel: &str, bytes: &[u8]) -> PathBuf {
        let path = self.0.join(rel);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).expect("create scratch subdir");
        }
        std::fs::write(&path, bytes).expect("write scratch file");
        path
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
