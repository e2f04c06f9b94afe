//! The GGUF reader against a real checkpoint, SmolLM2-135M-Instruct Q4_1 (fetched by
//! `scripts/fetch_models.sh smollm2`), and against gguf-py, llama.cpp's own reader, when python3
//! has it. Each test prints a note and passes when what it needs is absent.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use afm_models::source::{resolve_model, ModelLocation};
use afm_models::weights::{GgufFile, GgufValue, WeightSource};
use afm_runtime::DType;
use serde_json::Value;

fn smollm2() -> Option<PathBuf> {
    let path =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/SmolLM2-135M-Instruct.Q4_1.gguf");
    if !path.is_file() {
        eprintln!(
            "skipping: {} is absent (scripts/fetch_models.sh smollm2)",
            path.display()
        );
        return None;
    }
    Some(path)
}

#[test]
fn smollm2_header_and_tensors() {
    let Some(path) = smollm2() else { return };
    let f = GgufFile::open(&path).unwrap();
    assert_eq!(f.version(), 3);
    assert_eq!(f.architecture(), Some("llama"));
    let int = |k: &str| f.get(k).and_then(GgufValue::as_u64);
    assert_eq!(int("llama.block_count"), Some(30));
    assert_eq!(int("llama.embedding_length"), Some(576));
    let tokens = f
        .get("tokenizer.ggml.tokens")
        .and_then(GgufValue::as_array)
        .unwrap();
    assert_eq!(tokens.len(), 49152);
    assert_eq!(tokens[0].as_str(), Some("<|endoftext|>"));

    // 30 blocks × 9 tensors, token_embd and output_norm; the output head is tied.
    assert_eq!(f.tensor_names().count(), 30 * 9 + 2);
    let emb = f.tensor("token_embd.weight").unwrap();
    assert_eq!(
        (emb.dtype, emb.shape.clone()),
        (DType::Q8_0, vec![49152, 576])
    );
    let mut census: BTreeMap<&str, usize> = BTreeMap::new();
    for name in f.tensor_names() {
        *census
            .entry(f.tensor(name).unwrap().dtype.name())
            .or_default() += 1;
    }
    assert_eq!(
        census,
        BTreeMap::from([("F32", 61), ("Q4_1", 210), ("Q8_0", 1)])
    );

    let source = WeightSource::open(&resolve_model(path.to_str().unwrap()).unwrap()).unwrap();
    assert_eq!(source.tensor_names().len(), 272);
    let norm = source
        .tensor("blk.0.attn_norm.weight")
        .unwrap()
        .to_f32()
        .unwrap();
    assert!(norm.len() == 576 && norm.iter().all(|v| v.is_finite()));
    let q = source
        .tensor("blk.0.attn_q.weight")
        .unwrap()
        .into_matrix()
        .unwrap();
    assert_eq!((q.dtype(), q.rows(), q.cols()), (DType::Q4_1, 576, 576));
    assert!(matches!(
        resolve_model(path.to_str().unwrap()),
        Ok(ModelLocation::Gguf(_))
    ));
}

/// gguf-py's view of the file: every tensor (name, dims innermost first, type, offset in the
/// data section, bytes), every metadata value (arrays by length and ends), and one dequantized
/// Q4_1 tensor.
const GGUF_PY: &str = r#"
import json, sys
import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize
r = GGUFReader(sys.argv[1])
tensors = [[t.name, [int(d) for d in t.shape], t.tensor_type.name,
            int(t.data_offset - r.data_offset), int(t.n_bytes)] for t in r.tensors]
meta = {}
for k, f in r.fields.items():
    if k.startswith("GGUF."):
        continue
    v = f.contents()
    if isinstance(v, list):
        meta[k] = {"len": len(v), "first": v[0] if v else None, "last": v[-1] if v else None}
    else:
        meta[k] = {"value": v}
t = next(t for t in r.tensors if t.name == "blk.0.attn_q.weight")
q = dequantize(t.data, t.tensor_type).reshape(-1)
out = {"tensors": tensors, "meta": meta, "q_head": q[:8].tolist(),
       "q_sum": float(q.astype(np.float64).sum())}
print(json.dumps(out, default=lambda o: o.item()))
"#;

fn gguf_py(path: &Path) -> Option<Value> {
    let out = std::process::Command::new("python3")
        .arg("-c")
        .arg(GGUF_PY)
        .arg(path)
        .output();
    match out {
        Ok(out) if out.status.success() => Some(serde_json::from_slice(&out.stdout).unwrap()),
        Ok(out) => {
            let err = String::from_utf8_lossy(&out.stderr);
            eprintln!(
                "skipping: gguf-py failed: {}",
                err.lines().last().unwrap_or("")
            );
            None
        }
        Err(e) => {
            eprintln!("skipping: no python3 ({e})");
            None
        }
    }
}

fn same_value(ours: &GgufValue, theirs: &Value) -> bool {
    match theirs {
        Value::String(s) => ours.as_str() == Some(s),
        Value::Bool(b) => ours.as_bool() == Some(*b),
        Value::Number(n) => ours.as_f64() == n.as_f64(),
        _ => false,
    }
}

#[test]
fn smollm2_agrees_with_gguf_py() {
    let Some(path) = smollm2() else { return };
    let Some(py) = gguf_py(&path) else { return };
    let f = GgufFile::open(&path).unwrap();

    let theirs = py["tensors"].as_array().unwrap();
    let ours: Vec<&str> = f.tensor_names().collect();
    let names: Vec<&str> = theirs.iter().map(|t| t[0].as_str().unwrap()).collect();
    assert_eq!(ours, names, "tensor names and order");
    // Offsets compare through addresses in our map, relative to the first tensor's.
    let addr = |name: &str| f.tensor(name).unwrap().bytes.as_slice().as_ptr() as u64;
    let base = addr(names[0]) - theirs[0][3].as_u64().unwrap();
    for t in theirs {
        let view = f.tensor(t[0].as_str().unwrap()).unwrap();
        let dims: Vec<usize> = t[1]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d.as_u64().unwrap() as usize)
            .collect();
        let mut shape = view.shape.clone();
        shape.reverse();
        assert_eq!(shape, dims, "{}: dims", view.name);
        assert_eq!(
            view.dtype.name(),
            t[2].as_str().unwrap(),
            "{}: type",
            view.name
        );
        assert_eq!(
            addr(&view.name) - base,
            t[3].as_u64().unwrap(),
            "{}: offset",
            view.name
        );
        assert_eq!(
            view.bytes.len() as u64,
            t[4].as_u64().unwrap(),
            "{}: bytes",
            view.name
        );
    }

    let meta = py["meta"].as_object().unwrap();
    assert_eq!(f.metadata().len(), meta.len(), "metadata key count");
    for (key, want) in meta {
        let ours = f.get(key).unwrap_or_else(|| panic!("{key} missing"));
        if let Some(value) = want.get("value") {
            assert!(same_value(ours, value), "{key}: {ours:?} vs {value}");
            continue;
        }
        let items = ours
            .as_array()
            .unwrap_or_else(|| panic!("{key} is not an array"));
        assert_eq!(
            items.len() as u64,
            want["len"].as_u64().unwrap(),
            "{key}: length"
        );
        if let (Some(first), Some(last)) = (items.first(), items.last()) {
            assert!(same_value(first, &want["first"]), "{key}: first {first:?}");
            assert!(same_value(last, &want["last"]), "{key}: last {last:?}");
        }
    }

    let q = f.tensor("blk.0.attn_q.weight").unwrap().to_f32().unwrap();
    let head: Vec<f32> = py["q_head"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap() as f32)
        .collect();
    assert_eq!(q[..8], head[..], "first values of blk.0.attn_q.weight");
    let sum: f64 = q.iter().map(|&v| f64::from(v)).sum();
    let want = py["q_sum"].as_f64().unwrap();
    assert!(
        (sum - want).abs() <= 1e-6 * want.abs().max(1.0),
        "sum {sum} vs {want}"
    );
}
