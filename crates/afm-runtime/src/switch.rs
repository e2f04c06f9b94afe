//! Process-wide A/B switches of the kernels: read from the environment once, and settable at
//! run time by tests and benchmarks that compare two paths in one process.

use std::sync::atomic::{AtomicU8, Ordering};

/// `var`'s value as a switch: a default-on switch is off only at `0`, a default-off one on only
/// at `1`; unset (or not Unicode) is the default.
pub(crate) fn from_env(var: &str, default: bool) -> bool {
    match std::env::var(var) {
        Ok(v) if default => v != "0",
        Ok(v) => v == "1",
        Err(_) => default,
    }
}

/// A switch read from `var` ([`from_env`]) on first use, unless [`set`](Self::set) came first.
pub(crate) struct Switch {
    /// 0 not read yet, 1 on, 2 off.
    state: AtomicU8,
    var: &'static str,
    default: bool,
}

impl Switch {
    pub(crate) const fn new(var: &'static str, default: bool) -> Self {
        Self {
            state: AtomicU8::new(0),
            var,
            default,
        }
    }

    pub(crate) fn on(&self) -> bool {
        match self.state.load(Ordering::Relaxed) {
            0 => {
                let on = from_env(self.var, self.default);
                self.set(on);
                on
            }
            s => s == 1,
        }
    }

    /// Sets the switch for the whole process, whatever the environment says.
    pub(crate) fn set(&self, on: bool) {
        self.state.store(if on { 1 } else { 2 }, Ordering::Relaxed);
    }
}

/// A number an A/B run may force through `var` (`AFM_ATTN_DEC_PER_SM=4`): read and parsed once;
/// unset or not a number is `None` (the caller's rule applies).
pub(crate) struct Knob {
    value: std::sync::OnceLock<Option<usize>>,
    var: &'static str,
}

impl Knob {
    pub(crate) const fn new(var: &'static str) -> Self {
        Self {
            value: std::sync::OnceLock::new(),
            var,
        }
    }

    pub(crate) fn get(&self) -> Option<usize> {
        *self
            .value
            .get_or_init(|| std::env::var(self.var).ok().and_then(|v| v.parse().ok()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A set switch holds whatever the environment says (the variable here is never set, so
    /// the first read gives the default).
    #[test]
    fn set_overrides_and_default_applies() {
        let s = Switch::new("AFM_TEST_SWITCH_NEVER_SET", true);
        assert!(s.on());
        s.set(false);
        assert!(!s.on());
        let off = Switch::new("AFM_TEST_SWITCH_NEVER_SET", false);
        assert!(!off.on());
        off.set(true);
        assert!(off.on());
    }
}
