//! Broken model files at the command line: `afm serve -m <file>` on a truncated file, a wrong
//! magic, an out-of-bounds or misaligned tensor offset, an unknown tensor type, shapes that
//! disagree with the config, or a garbled safetensors header exits 1 with one line on stderr
//! naming the problem — never a panic, never a server.
//!
//! The files are made from the committed tiny llama fixture (tests/fixtures/tiny/llama).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/tiny/llama")
        .join(name)
}

/// Runs `afm serve -m path -s hi` (no port needed) and returns (exit code, stderr).
fn afm_on(path: &Path) -> (Option<i32>, String) {
    let start = Instant::now();
    let out = Command::new(env!("CARGO_BIN_EXE_afm"))
        .args(["serve", "-m"])
        .arg(path)
        .args(["-s", "hi", "--max-tokens", "2", "--kv-memory", "64M"])
        .output()
        .expect("afm runs");
    assert!(start.elapsed() < Duration::from_secs(60));
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Exit 1, one stderr line `afm: error: ...` containing every `needle`, no panic.
fn assert_one_line_error(path: &Path, needles: &[&str]) {
    let (code, stderr) = afm_on(path);
    assert_eq!(
        code,
        Some(1),
        "{}: exit {code:?}, stderr: {stderr}",
        path.display()
    );
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "{}: not one line: {stderr}", path.display());
    let line = lines[0];
    assert!(line.starts_with("afm: error: "), "{line}");
    assert!(
        !line.contains("internal error") && !line.contains("panicked"),
        "{line}"
    );
    for needle in needles {
        assert!(line.contains(needle), "{line:?} does not name {needle:?}");
    }
}

/// Where the fields of a GGUF v2/v3 header lie, found by walking it.
struct GgufLayout {
    /// (key, byte offset of the value) for each metadata entry.
    values: Vec<(String, usize)>,
    /// (name, offset of the `type` u32; the `offset` u64 follows it) for each tensor.
    tensors: Vec<(String, usize)>,
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().unwrap())
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().unwrap())
}

fn string_at(b: &[u8], at: &mut usize) -> String {
    let len = u64_at(b, *at) as usize;
    let s = String::from_utf8_lossy(&b[*at + 8..*at + 8 + len]).into_owned();
    *at += 8 + len;
    s
}

/// Skips one metadata value of type `ty` at `at`.
fn skip_value(b: &[u8], ty: u32, at: &mut usize) {
    match ty {
        0 | 1 | 7 => *at += 1,
        2 | 3 => *at += 2,
        4..=6 => *at += 4,
        10..=12 => *at += 8,
        8 => {
            string_at(b, at);
        }
        9 => {
            let elem = u32_at(b, *at);
            let n = u64_at(b, *at + 4);
            *at += 12;
            for _ in 0..n {
                skip_value(b, elem, at);
            }
        }
        other => panic!("fixture has metadata type {other}"),
    }
}

fn layout(b: &[u8]) -> GgufLayout {
    assert_eq!(&b[..4], b"GGUF");
    let n_tensors = u64_at(b, 8);
    let n_kv = u64_at(b, 16);
    let mut at = 24;
    let mut values = Vec::new();
    for _ in 0..n_kv {
        let key = string_at(b, &mut at);
        let ty = u32_at(b, at);
        at += 4;
        values.push((key, at));
        skip_value(b, ty, &mut at);
    }
    let mut tensors = Vec::new();
    for _ in 0..n_tensors {
        let name = string_at(b, &mut at);
        let n_dims = u32_at(b, at) as usize;
        at += 4 + 8 * n_dims;
        tensors.push((name, at));
        at += 4 + 8;
    }
    GgufLayout { values, tensors }
}

fn write_temp(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, bytes).unwrap();
    path
}

fn temp_dir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("afm-bad-models-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn the_fixture_itself_loads() {
    let (code, stderr) = afm_on(&fixture("model-f32.gguf"));
    assert_eq!(code, Some(0), "{stderr}");
}

#[test]
fn broken_gguf_files_are_one_line_errors() {
    let good = std::fs::read(fixture("model-f32.gguf")).unwrap();
    let l = layout(&good);
    let dir = temp_dir("gguf");
    let (first, type_at) = l.tensors[0].clone();
    let mut cases: Vec<(&str, Vec<u8>, Vec<String>)> = Vec::new();

    cases.push(("truncated-header.gguf", good[..100].to_vec(), vec![]));
    cases.push((
        "truncated-data.gguf",
        good[..good.len() - 1000].to_vec(),
        vec![],
    ));
    let mut magic = good.clone();
    magic[..4].copy_from_slice(b"GGML");
    cases.push(("magic.gguf", magic, vec!["magic".into()]));
    let mut unknown = good.clone();
    unknown[type_at..type_at + 4].copy_from_slice(&99u32.to_le_bytes());
    cases.push(("type.gguf", unknown, vec![first.clone(), "99".into()]));
    let mut far = good.clone();
    far[type_at + 4..type_at + 12].copy_from_slice(&(1u64 << 40).to_le_bytes());
    cases.push(("offset.gguf", far, vec![first.clone()]));
    let mut misaligned = good.clone();
    let offset = u64_at(&good, type_at + 4) + 1;
    misaligned[type_at + 4..type_at + 12].copy_from_slice(&offset.to_le_bytes());
    cases.push(("misaligned.gguf", misaligned, vec![first.clone()]));
    // The config says 48 wide; the tensors are 64 wide.
    let (_, width_at) = l
        .values
        .iter()
        .find(|(k, _)| k.ends_with(".embedding_length"))
        .cloned()
        .expect("the fixture has an embedding length");
    let mut shapes = good.clone();
    shapes[width_at..width_at + 4].copy_from_slice(&48u32.to_le_bytes());
    cases.push(("shapes.gguf", shapes, vec!["shape".into()]));

    for (name, bytes, needles) in cases {
        let path = write_temp(&dir, name, &bytes);
        let needles: Vec<&str> = needles.iter().map(String::as_str).collect();
        assert_one_line_error(&path, &needles);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn broken_safetensors_and_configs_are_one_line_errors() {
    let dir = temp_dir("st");
    let good = std::fs::read(fixture("model.safetensors")).unwrap();
    let config = std::fs::read_to_string(fixture("config.json")).unwrap();
    let header_len = u64_at(&good, 0) as usize;

    let model_dir = |tag: &str, weights: &[u8], config: &str| {
        let d = dir.join(tag);
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(d.join("model.safetensors"), weights).unwrap();
        std::fs::write(d.join("config.json"), config).unwrap();
        d
    };
    let truncated = model_dir("truncated", &good[..good.len() / 2], &config);
    assert_one_line_error(&truncated, &[]);
    let mut huge = good.clone();
    huge[..8].copy_from_slice(&(u64::MAX / 2).to_le_bytes());
    assert_one_line_error(&model_dir("header-len", &huge, &config), &[]);
    let mut garbled = good.clone();
    for b in &mut garbled[8..8 + header_len.min(40)] {
        *b = b'#';
    }
    assert_one_line_error(&model_dir("garbled", &garbled, &config), &[]);
    let mut dtype = good.clone();
    let header = String::from_utf8_lossy(&good[8..8 + header_len]).into_owned();
    let first_dtype = header
        .find("\"F32\"")
        .expect("an F32 tensor in the fixture");
    dtype[8 + first_dtype..8 + first_dtype + 5].copy_from_slice(b"\"Q9\" ");
    assert_one_line_error(&model_dir("dtype", &dtype, &config), &["Q9"]);
    let mut cfg: serde_json::Value = serde_json::from_str(&config).unwrap();
    let width = cfg["hidden_size"].as_u64().unwrap();
    cfg["hidden_size"] = (width / 2).into();
    let narrow = model_dir("shapes", &good, &cfg.to_string());
    assert_one_line_error(&narrow, &["shape"]);
    let _ = std::fs::remove_dir_all(&dir);
}
