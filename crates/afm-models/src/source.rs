//! Where a `-m` argument points: a GGUF file, a Hugging Face model directory, or a repo id
//! ("org/name") already in the local Hugging Face cache. Offline only: nothing is downloaded.
//!
//! ```text
//! <hub cache>/models--org--name/refs/main            -> "<rev>"
//! <hub cache>/models--org--name/snapshots/<rev>/...  config.json + *.safetensors, or *.gguf
//! ```
//!
//! It does not open the weights; `WeightSource::open` does.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use crate::weights::WeightsError;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModelLocation {
    Gguf(PathBuf),
    HfDir(PathBuf),
}

/// An existing `.gguf` file (or any file starting with the GGUF magic) → `Gguf`; a directory
/// with `config.json` → `HfDir`; a directory with exactly one model `.gguf` → `Gguf`; otherwise
/// a repo id looked up in the Hugging Face cache.
pub fn resolve_model(arg: &str) -> Result<ModelLocation, WeightsError> {
    let path = Path::new(arg);
    if path.exists() {
        return resolve_path(path);
    }
    let not_found = |looked_at| WeightsError::NotFound {
        what: format!("model {arg:?} (neither a local path nor in the Hugging Face cache)"),
        looked_at,
    };
    if !is_repo_id(arg) {
        return Err(not_found(vec![path.into()]));
    }
    let Some(cache) = hub_cache_dir(|k| std::env::var_os(k)) else {
        return Err(not_found(vec![path.into()]));
    };
    match find_in_cache(arg, &cache) {
        Ok(snapshot) => resolve_path(&snapshot),
        Err(mut looked_at) => {
            looked_at.insert(0, path.into());
            Err(not_found(looked_at))
        }
    }
}

/// The hub cache, as huggingface_hub finds it: `$HF_HUB_CACHE`, else `$HF_HOME/hub`, else
/// `$XDG_CACHE_HOME/huggingface/hub`, else `~/.cache/huggingface/hub`.
fn hub_cache_dir(var: impl Fn(&str) -> Option<OsString>) -> Option<PathBuf> {
    let set = |k: &str| var(k).filter(|v| !v.is_empty()).map(PathBuf::from);
    if let Some(dir) = set("HF_HUB_CACHE") {
        return Some(dir);
    }
    let hf_home = set("HF_HOME")
        .or_else(|| set("XDG_CACHE_HOME").map(|d| d.join("huggingface")))
        .or_else(|| set("HOME").map(|d| d.join(".cache").join("huggingface")))?;
    Some(hf_home.join("hub"))
}

/// "org/name" or "name": parts of letters, digits, '-', '_' and '.', never "." or "..".
fn is_repo_id(arg: &str) -> bool {
    let parts: Vec<&str> = arg.split('/').collect();
    parts.len() <= 2
        && parts.iter().all(|p| {
            !p.is_empty()
                && *p != "."
                && *p != ".."
                && p.chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
        })
}

/// The snapshot directory of `repo` in `cache`: the revision `refs/main` names, else the only
/// or newest snapshot. On failure, the paths looked at.
fn find_in_cache(repo: &str, cache: &Path) -> Result<PathBuf, Vec<PathBuf>> {
    let repo_dir = cache.join(format!("models--{}", repo.replace('/', "--")));
    let refs_main = repo_dir.join("refs").join("main");
    let snapshots = repo_dir.join("snapshots");
    let pinned = std::fs::read_to_string(&refs_main).ok().and_then(|rev| {
        let rev = rev.trim();
        // A revision is a commit hash; anything path-like is ignored rather than followed.
        let plain = !rev.is_empty() && rev.chars().all(|c| c.is_ascii_alphanumeric());
        plain
            .then(|| snapshots.join(rev))
            .filter(|dir| dir.is_dir())
    });
    if let Some(dir) = pinned {
        return Ok(dir);
    }
    let newest = std::fs::read_dir(&snapshots).ok().and_then(|entries| {
        entries
            .filter_map(Result::ok)
            .filter(|e| e.path().is_dir())
            .max_by_key(|e| e.metadata().and_then(|m| m.modified()).ok())
            .map(|e| e.path())
    });
    newest.ok_or(vec![refs_main, snapshots])
}

fn resolve_path(path: &Path) -> Result<ModelLocation, WeightsError> {
    let not_a_model = |why: String| WeightsError::NotAModel {
        path: path.into(),
        why,
    };
    if path.is_file() {
        if has_gguf_extension(path) || starts_with_gguf_magic(path) {
            return Ok(ModelLocation::Gguf(path.into()));
        }
        return Err(not_a_model(
            "is neither a GGUF file nor a model directory".into(),
        ));
    }
    if path.join("config.json").is_file() {
        return Ok(ModelLocation::HfDir(path.into()));
    }
    let io = |source| WeightsError::Io {
        path: path.into(),
        source,
    };
    let mut ggufs = Vec::new();
    for entry in std::fs::read_dir(path).map_err(io)? {
        let file = entry.map_err(io)?.path();
        // Multimodal repos ship a vision projector beside the model; it is not the model.
        let projector = file
            .file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.starts_with("mmproj"));
        if has_gguf_extension(&file) && !projector && file.is_file() {
            ggufs.push(file);
        }
    }
    ggufs.sort();
    match ggufs.as_slice() {
        [one] => Ok(ModelLocation::Gguf(one.clone())),
        [] => Err(not_a_model(
            "has neither config.json nor a .gguf file".into(),
        )),
        many => {
            let names: Vec<String> = many.iter().map(|p| p.display().to_string()).collect();
            let why = format!(
                "holds {} .gguf files; pass one of them: {}",
                many.len(),
                names.join(", ")
            );
            Err(not_a_model(why))
        }
    }
}

fn has_gguf_extension(path: &Path) -> bool {
    path.extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
}

fn starts_with_gguf_magic(path: &Path) -> bool {
    use std::io::Read;
    let mut magic = [0u8; 4];
    std::fs::File::open(path)
        .and_then(|mut f| f.read_exact(&mut magic))
        .is_ok()
        && &magic == b"GGUF"
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::weights::testfiles::ScratchDir;

    #[test]
    fn local_files_and_directories() {
        let dir = ScratchDir::new("src-local");
        let gguf = dir.write("m.Q4_K.GGUF", b"anything");
        assert_eq!(
            resolve_path(&gguf).unwrap(),
            ModelLocation::Gguf(gguf.clone())
        );
        let magic = dir.write("model.bin", b"GGUF\x03\0\0\0");
        assert_eq!(resolve_path(&magic).unwrap(), ModelLocation::Gguf(magic));
        let other = dir.write("notes.txt", b"hello");
        assert!(matches!(
            resolve_path(&other),
            Err(WeightsError::NotAModel { .. })
        ));

        let hf = ScratchDir::new("src-hf");
        hf.write("config.json", b"{}");
        hf.write("model.safetensors", b"");
        let arg = hf.0.to_str().unwrap();
        assert_eq!(
            resolve_model(arg).unwrap(),
            ModelLocation::HfDir(hf.0.clone())
        );

        let one = ScratchDir::new("src-one");
        let model = one.write("model.gguf", b"GGUF");
        one.write("mmproj-model-f16.gguf", b"GGUF");
        assert_eq!(resolve_path(&one.0).unwrap(), ModelLocation::Gguf(model));
        one.write("model-q8.gguf", b"GGUF");
        let err = resolve_path(&one.0).unwrap_err();
        assert!(err.to_string().contains("holds 2 .gguf files"), "{err}");

        let empty = ScratchDir::new("src-empty");
        assert!(matches!(
            resolve_path(&empty.0),
            Err(WeightsError::NotAModel { .. })
        ));
    }

    #[test]
    fn repo_ids_resolve_through_the_hub_cache() {
        let cache = ScratchDir::new("src-cache");
        let repo = "models--org--Tiny-1.5B";
        cache.write(&format!("{repo}/snapshots/aaa111/config.json"), b"{}");
        cache.write(&format!("{repo}/snapshots/bbb222/config.json"), b"{}");
        cache.write(&format!("{repo}/refs/main"), b"aaa111\n");
        let found = find_in_cache("org/Tiny-1.5B", &cache.0).unwrap();
        assert_eq!(found, cache.0.join(repo).join("snapshots/aaa111"));
        assert_eq!(
            resolve_path(&found).unwrap(),
            ModelLocation::HfDir(found.clone())
        );

        // A ref that is path-like, or names a missing snapshot, falls back to a snapshot there.
        for bad_ref in ["../../elsewhere", "ccc333"] {
            cache.write(&format!("{repo}/refs/main"), bad_ref.as_bytes());
            let found = find_in_cache("org/Tiny-1.5B", &cache.0).unwrap();
            assert!(
                found.starts_with(cache.0.join(repo).join("snapshots")),
                "{found:?}"
            );
        }

        let looked = find_in_cache("org/absent", &cache.0).unwrap_err();
        assert!(
            looked.contains(&cache.0.join("models--org--absent/refs/main")),
            "{looked:?}"
        );
        assert!(
            looked.contains(&cache.0.join("models--org--absent/snapshots")),
            "{looked:?}"
        );
    }

    #[test]
    fn missing_models_name_where_they_were_looked_for() {
        let err = resolve_model("no-such-org/no-such-model-xyz").unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("no-such-org/no-such-model-xyz"), "{msg}");
        assert!(
            msg.contains("models--no-such-org--no-such-model-xyz"),
            "{msg}"
        );
        let err = resolve_model("./not/a/real/path.gguf").unwrap_err();
        assert!(matches!(err, WeightsError::NotFound { .. }), "{err}");
    }

    #[test]
    fn hub_cache_follows_huggingface_hub_precedence() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| {
                pairs
                    .iter()
                    .find(|(n, _)| *n == k)
                    .map(|(_, v)| OsString::from(v))
            }
        };
        let dir = |pairs| hub_cache_dir(env(pairs));
        assert_eq!(
            dir(&[("HF_HUB_CACHE", "/c"), ("HF_HOME", "/h")]),
            Some("/c".into())
        );
        assert_eq!(
            dir(&[("HF_HOME", "/h"), ("HOME", "/home/u")]),
            Some("/h/hub".into())
        );
        assert_eq!(
            dir(&[("XDG_CACHE_HOME", "/x"), ("HOME", "/u")]),
            Some("/x/huggingface/hub".into())
        );
        assert_eq!(
            dir(&[("HOME", "/u")]),
            Some("/u/.cache/huggingface/hub".into())
        );
        assert_eq!(
            dir(&[("HF_HUB_CACHE", ""), ("HOME", "/u")]),
            Some("/u/.cache/huggingface/hub".into())
        );
        assert_eq!(dir(&[]), None);
    }

    #[test]
    fn repo_id_shapes() {
        for ok in ["org/name", "Qwen/Qwen3-0.6B", "gpt2", "a_b/c.d"] {
            assert!(is_repo_id(ok), "{ok}");
        }
        for bad in ["", "/abs", "a/b/c", "../x", "org/..", "a b/c", "org/"] {
            assert!(!is_repo_id(bad), "{bad}");
        }
    }
}
