//! The CPU worker pool the kernels run on: rayon's global pool, sized once at startup.
//!
//! `matmul` splits its output rows over this pool. A decode-step matmul takes tens of µs,
//! about what it takes to wake a sleeping worker, so left alone the other workers would sleep
//! through most of a forward pass. `install` therefore runs a whole pass on one pool thread
//! while the other threads poll for work (as llama.cpp's threads spin during a graph), and
//! lets them sleep again when the pass returns.

use std::sync::atomic::{AtomicBool, Ordering};

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

/// Run `f` (a forward pass) on a pool thread with the other threads kept polling for work,
/// and return its result. Inside a pool thread already, this is `with_hot_workers(f)`.
pub fn install<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    if rayon::current_thread_index().is_some() {
        return with_hot_workers(f);
    }
    // From outside the pool, `scope` runs its body on a pool thread and waits for it.
    rayon::scope(|_| with_hot_workers(f))
}

/// Run `f` on the current pool thread while every other thread of the pool polls for work
/// (`rayon::yield_now`) instead of sleeping, so the pieces `f`'s matmuls hand out start at
/// once. Outside a pool this is just `f()`.
pub fn with_hot_workers<R>(f: impl FnOnce() -> R) -> R {
    let Some(me) = rayon::current_thread_index() else {
        return f();
    };
    let done = AtomicBool::new(false);
    rayon::in_place_scope(|s| {
        for _ in 1..rayon::current_num_threads() {
            s.spawn(|_| {
                // On `f`'s own thread (picked up while `f` waits) a poller would block `f`.
                if rayon::current_thread_index() == Some(me) {
                    return;
                }
                let mut idle = 0u32;
                while !done.load(Ordering::Acquire) {
                    if rayon::yield_now() == Some(rayon::Yield::Executed) {
                        idle = 0;
                    } else if idle < 256 {
                        idle += 1;
                        std::hint::spin_loop();
                    } else {
                        // Long idle: let other processes have the core (a shared machine).
                        std::thread::yield_now();
                    }
                }
            });
        }
        // Set even if `f` panics, so the pollers end and the scope can unwind.
        let _release = SetOnDrop(&done);
        f()
    })
}

struct SetOnDrop<'a>(&'a AtomicBool);

impl Drop for SetOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Release);
    }
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

    #[test]
    fn work_inside_install_completes_and_a_panic_still_returns() {
        use rayon::prelude::*;
        let sum: u64 = super::install(|| (0..10_000u64).into_par_iter().sum());
        assert_eq!(sum, 49_995_000);
        let caught =
            std::panic::catch_unwind(|| super::install(|| panic!("inside a forward pass")));
        assert!(caught.is_err());
    }
}
