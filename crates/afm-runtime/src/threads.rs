//! The CPU worker pool the kernels run on: rayon's global pool, sized once at startup.
//!
//! `matmul` splits its output rows over this pool. A caller that runs a whole forward pass
//! through `install` keeps its own thread in the pool, so each matmul starts on the caller's
//! thread instead of waking a worker and sleeping until it finishes.

/// Size the global pool to `n` threads (0: one per logical CPU). Only the first call can
/// succeed; later calls, or any call after something already used rayon, return the error.
pub fn set_num_threads(n: usize) -> Result<(), rayon::ThreadPoolBuildError> {
    rayon::ThreadPoolBuilder::new()
        .num_threads(n)
        .thread_name(|i| format!("afm-cpu-{i}"))
        .build_global()
}

/// Threads in the pool the kernels use.
pub fn num_threads() -> usize {
    rayon::current_num_threads()
}

/// Run `f` on a pool thread (directly, when already on one) and return its result.
pub fn install<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    rayon::scope(|_| f())
}

#[cfg(test)]
mod tests {
    #[test]
    fn install_runs_on_a_pool_thread_and_returns_the_result() {
        assert_eq!(rayon::current_thread_index(), None);
        let (on_pool, value) = super::install(|| (rayon::current_thread_index().is_some(), 41 + 1));
        assert!(on_pool);
        assert_eq!(value, 42);
        // Nested calls run in place.
        assert_eq!(super::install(|| super::install(|| 7)), 7);
    }
}
