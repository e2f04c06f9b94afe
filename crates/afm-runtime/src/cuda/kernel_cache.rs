//! Kernel binaries for the device: NVRTC compiles each module straight to a CUBIN of the
//! device's own architecture (`sm_XX`), kept in a disk cache.
//!
//! Loading PTX made the driver translate it to machine code at load time, one module after
//! another (ptxas inside the driver): on a fresh H200 with an empty driver cache that took 57 s
//! for the six modules loaded at start (session 9, call 4), against 1.3 s once cached. Compiled
//! to CUBIN, ptxas runs inside NVRTC on the compiling thread, so the modules (compiled in
//! parallel) cost the slowest one, and the cache makes later starts cost a file read. The cache
//! is `$AFM_KERNEL_CACHE`, else `$XDG_CACHE_HOME/afm/kernels`, else `~/.cache/afm/kernels`;
//! `AFM_KERNEL_CACHE=0` turns it off. A file is named by the SHA-256 of the module's source, the
//! architecture and NVRTC's version, written to a temporary name and renamed, so a reader sees
//! either nothing or a whole file; one that does not load is compiled again.

use std::ffi::{c_char, CString};
use std::path::{Path, PathBuf};

use cudarc::nvrtc::{result as nvrtc, sys as nvrtc_sys};
use sha2::{Digest, Sha256};

use super::{CudaError, Result};

/// The cache directory (see the module header), `None` when it is off or no home is known.
pub(super) fn cache_dir() -> Option<PathBuf> {
    match std::env::var_os("AFM_KERNEL_CACHE") {
        Some(v) if v == "0" || v.is_empty() => None,
        Some(v) => Some(PathBuf::from(v)),
        None => std::env::var_os("XDG_CACHE_HOME")
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
            .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
            .map(|c| c.join("afm").join("kernels")),
    }
}

/// NVRTC's version, part of every cache key (another NVRTC may compile the same source
/// differently).
fn nvrtc_version() -> (i32, i32) {
    let (mut major, mut minor) = (0, 0);
    // SAFETY: two plain out-parameters.
    let ok = unsafe { nvrtc_sys::nvrtcVersion(&mut major, &mut minor) };
    if ok == nvrtc_sys::nvrtcResult::NVRTC_SUCCESS {
        (major, minor)
    } else {
        (0, 0)
    }
}

/// Where module `name` compiled from `source` for `sm` lives in `dir`.
fn cache_path(dir: &Path, name: &str, source: &str, sm: &str) -> PathBuf {
    let (major, minor) = nvrtc_version();
    let mut h = Sha256::new();
    h.update(source.as_bytes());
    h.update(format!("\0{sm}\0nvrtc {major}.{minor}").as_bytes());
    let hex: String = h.finalize()[..12]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    dir.join(format!("{name}-{sm}-{hex}.cubin"))
}

/// An ELF file (what a CUBIN is): anything else in the cache is ignored.
fn is_elf(b: &[u8]) -> bool {
    b.starts_with(b"\x7fELF")
}

/// A module's CUBIN for `sm` (e.g. `sm_90`): from `dir`'s cache when it holds one (`true`),
/// else compiled and stored there (`false`; a cache that cannot be written is not an error).
pub(super) fn cubin(
    name: &'static str,
    source: &str,
    sm: &str,
    dir: Option<&Path>,
) -> Result<(Vec<u8>, bool)> {
    let path = dir.map(|d| cache_path(d, name, source, sm));
    if let Some(bytes) = path.as_ref().and_then(|p| std::fs::read(p).ok()) {
        if is_elf(&bytes) {
            return Ok((bytes, true));
        }
    }
    let bytes = compile_cubin(name, source, sm)?;
    if let Some(p) = &path {
        store(p, &bytes);
    }
    Ok((bytes, false))
}

/// Removes a cached CUBIN that failed to load, so the next start compiles it again.
pub(super) fn forget(name: &str, source: &str, sm: &str, dir: &Path) {
    let _ = std::fs::remove_file(cache_path(dir, name, source, sm));
}

/// Writes `bytes` to `path` through a temporary file and a rename (atomic on one file system).
fn store(path: &Path, bytes: &[u8]) {
    let Some(dir) = path.parent() else {
        return;
    };
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    let written = std::fs::create_dir_all(dir)
        .and_then(|()| std::fs::write(&tmp, bytes))
        .and_then(|()| std::fs::rename(&tmp, path));
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
}

/// NVRTC to CUBIN for the real architecture `sm`.
fn compile_cubin(name: &'static str, source: &str, sm: &str) -> Result<Vec<u8>> {
    let fail = |log: String| CudaError::Compile { module: name, log };
    let src = CString::new(source).map_err(|e| fail(e.to_string()))?;
    let file = CString::new(format!("{name}.cu")).map_err(|e| fail(e.to_string()))?;
    let prog = nvrtc::create_program(&src, Some(&file)).map_err(|e| fail(format!("{e:?}")))?;
    let opts = [
        format!("--gpu-architecture={sm}"),
        "--std=c++17".to_string(),
    ];
    // SAFETY: `prog` is live until destroyed below; the options are plain strings.
    let compiled = unsafe { nvrtc::compile_program(prog, &opts) };
    let out = match compiled {
        Err(_) => {
            // SAFETY: as above.
            let log = unsafe { nvrtc::get_program_log(prog) }
                .map(|l| {
                    let bytes: Vec<u8> = l
                        .iter()
                        .take_while(|&&c| c != 0)
                        .map(|&c| c as u8)
                        .collect();
                    String::from_utf8_lossy(&bytes).into_owned()
                })
                .unwrap_or_default();
            Err(fail(log))
        }
        Ok(()) => {
            let mut size = 0usize;
            // SAFETY: `prog` compiled; `buf` holds `size` bytes.
            unsafe {
                nvrtc_sys::nvrtcGetCUBINSize(prog, &mut size)
                    .result()
                    .map_err(|e| fail(format!("CUBIN size: {e:?}")))?;
                let mut buf = vec![0u8; size];
                nvrtc_sys::nvrtcGetCUBIN(prog, buf.as_mut_ptr() as *mut c_char)
                    .result()
                    .map_err(|e| fail(format!("CUBIN: {e:?}")))?;
                Ok(buf)
            }
        }
    };
    // SAFETY: created above, destroyed once.
    let _ = unsafe { nvrtc::destroy_program(prog) };
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A module compiles to an ELF CUBIN, is stored, comes back from the cache unchanged, and
    /// a damaged cache file is compiled again and replaced. Needs libnvrtc, not a GPU.
    #[test]
    fn cubins_round_trip_through_the_cache() {
        let dir = std::env::temp_dir().join(format!("afm-kcache-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let (name, src) = ("sampling", super::super::context::module_source(6));
        let (bytes, cached) = cubin(name, &src, "sm_90", Some(&dir)).expect("compile");
        assert!(!cached, "an empty cache has nothing");
        assert!(is_elf(&bytes), "a CUBIN is an ELF file");
        let (again, cached) = cubin(name, &src, "sm_90", Some(&dir)).expect("cache");
        assert!(cached, "the second compile comes from the cache");
        assert_eq!(again, bytes);
        let path = cache_path(&dir, name, &src, "sm_90");
        std::fs::write(&path, b"not a cubin").expect("damage");
        let (fresh, cached) = cubin(name, &src, "sm_90", Some(&dir)).expect("recompile");
        assert!(!cached, "a damaged file is not used");
        assert_eq!(fresh, bytes, "NVRTC is deterministic");
        assert_eq!(std::fs::read(&path).expect("replaced"), bytes);
        // Another architecture is another file.
        let (_, cached) = cubin(name, &src, "sm_80", Some(&dir)).expect("sm_80");
        assert!(!cached);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
