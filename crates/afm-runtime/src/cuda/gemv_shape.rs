//! The block shape of the one-row 16-bit GEMVs (gemv.cu): how many weight rows R a block owns
//! (1, 2, 4 or 8) and whether a thread keeps two units of each row in flight ("u2", the
//! one-matrix kernels at R = 2 and 4), chosen per kernel family from the grid size and the
//! matrices' width by a measured table ([`half_rows_rule`]), or forced (`AFM_GEMV_R`,
//! [`force`]) for A/B runs. Every shape gives the same bits, so the choice moves only times.
//! Integer-only; `matmul.rs` launches what it picks.

use super::matmul::GEMV_ROWS;
use super::{CudaError, Result};

/// Weight rows per block of the one-row 16-bit GEMV kernels (gemv.cu `GEMV_R_ALL`): 4 (the
/// multi-row kernels' `GEMV_ROWS`, no suffix) and 1, 2, 8 (names ending `_r1`, `_r2`, `_r8`).
pub(super) const GEMV_HALF_ROWS: [usize; 4] = [1, 2, 4, 8];
/// R at which the one-matrix kernels (`gemv_*`, `gemva_*`) also come with two units of each row
/// in flight per thread (gemv.cu `GEMV_U2`; names ending `_r2u2`, `_r4u2`).
pub(super) const GEMV_HALF_U2_ROWS: [usize; 2] = [2, 4];

/// The one-row 16-bit GEMV kernels, each with its own R rule ([`half_rows_rule`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum HalfKernel {
    /// `gemv_*`, `gemva_*`: one matrix (O and down with the residual add folded in, lm_head).
    Plain,
    /// `gemv3_*`: Q/K/V in one launch.
    Qkv,
    /// `gemv3n_*`: Q/K/V of `rms_norm(x)`.
    QkvNorm,
    /// `gemvg_*`: gate + up with the activation.
    Gated,
    /// `gemvgn_*`: the same of `rms_norm(x)`.
    GatedNorm,
}

/// The block shape of a one-row 16-bit GEMV launch: `rows` (R) weight rows per block, and
/// `units` units (8 weights) of each row a thread loads before its first product.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct HalfShape {
    pub(super) rows: usize,
    pub(super) units: usize,
}

impl HalfShape {
    const fn new(rows: usize, units: usize) -> Self {
        Self { rows, units }
    }

    /// Whether `k`'s kernels come in this shape (gemv.cu `GEMV_R_ALL`, `GEMV_U2`).
    fn exists_for(self, k: HalfKernel) -> bool {
        GEMV_HALF_ROWS.contains(&self.rows)
            && (self.units == 1
                || (self.units == 2
                    && k == HalfKernel::Plain
                    && GEMV_HALF_U2_ROWS.contains(&self.rows)))
    }

    /// This shape forced on `k`: itself, or where `k` lacks it (more units in flight) one unit
    /// at its R.
    fn for_kernel(self, k: HalfKernel) -> Self {
        if self.exists_for(k) {
            self
        } else {
            Self::new(self.rows, 1)
        }
    }

    /// The kernel name's suffix (gemv.cu: none at `GEMV_ROWS` with one unit).
    pub(super) fn suffix(self) -> String {
        match (self.rows, self.units) {
            (GEMV_ROWS, 1) => String::new(),
            (r, 1) => format!("_r{r}"),
            (r, u) => format!("_r{r}u{u}"),
        }
    }

    /// Every shape some kernel family comes in.
    #[cfg(test)]
    fn all() -> impl Iterator<Item = Self> {
        let one = GEMV_HALF_ROWS.into_iter().map(|r| Self::new(r, 1));
        one.chain(GEMV_HALF_U2_ROWS.into_iter().map(|r| Self::new(r, 2)))
    }
}

/// One candidate of a family's R rule: taken where its grid leaves at least
/// `min_blocks_per_sm` blocks per SM and the matrices have at least `min_cols` columns.
#[derive(Debug, Clone, Copy)]
struct HalfPick {
    shape: HalfShape,
    min_blocks_per_sm: usize,
    min_cols: usize,
}

const fn pick(rows: usize, units: usize, min_blocks_per_sm: usize) -> HalfPick {
    HalfPick {
        shape: HalfShape::new(rows, units),
        min_blocks_per_sm,
        min_cols: 0,
    }
}

/// A candidate for rows of at least `min_cols` columns only.
const fn wide(rows: usize, units: usize, min_cols: usize) -> HalfPick {
    HalfPick {
        shape: HalfShape::new(rows, units),
        min_blocks_per_sm: 0,
        min_cols,
    }
}

/// The shape for one kernel family at one activation row: the first candidate whose grid
/// leaves enough blocks per SM and whose width fits (the last asks for nothing).
/// `cuda_bench gemv_rows` on the H200 (session 9, µs at R = 1 / 2 / 4 / 8 / 2u2 / 4u2, weights
/// rotated through more than L2): Qwen3-8B O 12.96 / 10.14 / 11.08 / 12.44 / 10.52 / 10.07,
/// down 27.95 / 25.52 / 28.97 / 32.47 / 25.67 / 25.32, lm_head 281 / 280 / 282 / 282 / 275 / 277;
/// Q/K/V with the norm folded 20.5 / 14.7 / 16.4 / 15.1, gate+up with the norm 67.6 / 49.4 /
/// 53.1 / 48.8. Qwen3-0.6B (1,024–3,072 columns): O and down within ±0.2 µs at R = 2 / 4 / 2u2,
/// two units in flight slower where a row has fewer units than two per thread (lm_head 71.5 at
/// R = 4 against 82.1 at 4u2). Forcing R = 2 everywhere moved Qwen3-8B's batch-1 decode only
/// 234.7 → 235.8 tok/s (in a graph the next launch already overlaps a grid's tail), so the
/// rule keeps session 8's picks and adds two units in flight (4u2) for one-matrix products of
/// at least 4,096 columns, where the gain is in the steady state (more bytes in flight per
/// thread), not the tail. R = 16 won nowhere (session 8), so it has no kernels.
/// Session 12 (same bench, µs at R = 1 / 2 / 4 / 8 / the old pick): Q/K/V alone 15.0 / 13.6 /
/// 14.6 / 13.8 / 14.1 on Qwen3-8B and 5.84 / 4.04 / 4.48 / 4.57 / 4.41 on Qwen3-0.6B; with the
/// norm folded 20.5 / 14.6 / 16.4 / 15.0 / 15.3 (8B) and 7.03 / 4.77 / 4.34 / 4.50 / 4.35 (0.6B).
/// So Q/K/V take R = 2, with the norm from 4,096 columns (R = 4 below).
fn half_rows_rule(k: HalfKernel) -> &'static [HalfPick] {
    const QKV: &[HalfPick] = &[pick(2, 1, 0)];
    const QKV_NORM: &[HalfPick] = &[wide(2, 1, 4096), pick(4, 1, 0)];
    const GATED_NORM: &[HalfPick] = &[pick(8, 1, 2), pick(4, 1, 0)];
    const PLAIN: &[HalfPick] = &[wide(4, 2, 4096), pick(4, 1, 0)];
    const FOUR: &[HalfPick] = &[pick(4, 1, 0)];
    match k {
        HalfKernel::Qkv => QKV,
        HalfKernel::QkvNorm => QKV_NORM,
        HalfKernel::GatedNorm => GATED_NORM,
        HalfKernel::Plain => PLAIN,
        HalfKernel::Gated => FOUR,
    }
}

/// Shape forced for every one-row 16-bit GEMV ([`CudaContext::set_gemv_half`]), as
/// `rows << 8 | units` (0: none).
static HALF_SHAPE_FORCED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
/// Whether gate+up folds the norm in at any width ([`CudaContext::set_gemv_half`]).
static GATED_NORM_ANY_WIDTH: std::sync::atomic::AtomicBool =
    std::sync::atomic::AtomicBool::new(false);

/// The shapes one can force: what the one-matrix kernels come in (every family has its R).
const HALF_SHAPES_SUPPORTED: &str = "1, 2, 4, 8, 2u2 or 4u2 (R, or R u units in flight)";

/// "R" or "RuU" (units in flight), for a shape the one-matrix kernels come in.
fn parse_half_rows(v: &str) -> Option<HalfShape> {
    let v = v.trim();
    let (r, u) = v.split_once('u').unwrap_or((v, "1"));
    let shape = HalfShape::new(r.parse().ok()?, u.parse().ok()?);
    shape.exists_for(HalfKernel::Plain).then_some(shape)
}

fn bad_half_rows(what: &'static str, value: String) -> CudaError {
    CudaError::Unsupported {
        what,
        value,
        supported: HALF_SHAPES_SUPPORTED,
    }
}

/// `AFM_GEMV_R` (read once): the shape forced for every one-row 16-bit GEMV; an error on each
/// use where it is set to anything else.
fn half_rows_env() -> Result<Option<HalfShape>> {
    static ENV: std::sync::OnceLock<std::result::Result<Option<HalfShape>, String>> =
        std::sync::OnceLock::new();
    ENV.get_or_init(|| match std::env::var("AFM_GEMV_R") {
        Err(std::env::VarError::NotPresent) => Ok(None),
        Err(std::env::VarError::NotUnicode(v)) => Err(v.to_string_lossy().into_owned()),
        Ok(v) => parse_half_rows(&v).map(Some).ok_or(v),
    })
    .clone()
    .map_err(|v| bad_half_rows("AFM_GEMV_R", v))
}

/// The block shape of a 16-bit GEMV launch over matrices of `rows` rows each, for `n`
/// activation rows: R = 4 with one unit except at one row (and for the preloading "p" kernels,
/// `pre`).
pub(super) fn half_rows(
    k: HalfKernel,
    rows: &[usize],
    cols: usize,
    n: usize,
    pre: bool,
    sm_count: usize,
) -> Result<HalfShape> {
    let four = HalfShape::new(GEMV_ROWS, 1);
    if n != 1 || pre {
        return Ok(four);
    }
    let forced = HALF_SHAPE_FORCED.load(std::sync::atomic::Ordering::Relaxed);
    let forced = if forced != 0 {
        Some(HalfShape::new(forced >> 8, forced & 0xff))
    } else {
        half_rows_env()?
    };
    if let Some(s) = forced {
        return Ok(s.for_kernel(k));
    }
    let blocks = |r: usize| rows.iter().map(|m| m.div_ceil(r)).sum::<usize>();
    let rule = half_rows_rule(k);
    Ok(rule
        .iter()
        .find(|p| blocks(p.shape.rows) >= p.min_blocks_per_sm * sm_count && cols >= p.min_cols)
        .or(rule.last())
        .map_or(four, |p| p.shape))
}

/// Process-wide overrides ([`CudaContext::set_gemv_half`](super::CudaContext::set_gemv_half)):
/// the shape forced for every one-row GEMV (`None`: `AFM_GEMV_R` or the table), and whether
/// gate+up folds the norm in at any width. An error (nothing changed) for a shape the kernels
/// do not come in.
pub(super) fn force(shape: Option<&str>, gated_norm_any_width: bool) -> Result<()> {
    let forced = match shape {
        None => 0,
        Some(v) => {
            let s = parse_half_rows(v)
                .ok_or_else(|| bad_half_rows("GEMV block shape", v.to_string()))?;
            s.rows << 8 | s.units
        }
    };
    use std::sync::atomic::Ordering::Relaxed;
    HALF_SHAPE_FORCED.store(forced, Relaxed);
    GATED_NORM_ANY_WIDTH.store(gated_norm_any_width, Relaxed);
    Ok(())
}

/// Whether gate+up folds the norm in at any width ([`force`]).
pub(super) fn gated_norm_any_width() -> bool {
    GATED_NORM_ANY_WIDTH.load(std::sync::atomic::Ordering::Relaxed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::matmul::kernel_names;

    /// The table's picks on the H200 (132 SMs) at the shapes issue #9 measured ([`half_rows_rule`]);
    /// more than one row, or the preloading kernels, always 4. Needs no device (unless
    /// `AFM_GEMV_R` is set, which forces them).
    #[test]
    fn rows_per_block_follow_the_grid_size() {
        if std::env::var_os("AFM_GEMV_R").is_some() {
            eprintln!("skipped: AFM_GEMV_R forces R");
            return;
        }
        let pick = |k, rows: &[usize], cols, n, pre| {
            let s = half_rows(k, rows, cols, n, pre, 132).expect("pick");
            (s.rows, s.units)
        };
        use HalfKernel::*;
        // Qwen3-8B: Q/K/V 4096+1024+1024, O and down 4096 rows (4,096 and 12,288 columns),
        // gate+up 12288, lm_head: one-matrix products that wide take two units in flight.
        assert_eq!(pick(QkvNorm, &[4096, 1024, 1024], 4096, 1, false), (2, 1));
        assert_eq!(pick(Qkv, &[4096, 1024, 1024], 4096, 1, false), (2, 1));
        assert_eq!(pick(Plain, &[4096], 4096, 1, false), (4, 2));
        assert_eq!(pick(Plain, &[4096], 12288, 1, false), (4, 2));
        assert_eq!(pick(Gated, &[12288], 4096, 1, false), (4, 1));
        assert_eq!(pick(GatedNorm, &[12288], 4096, 1, false), (8, 1));
        assert_eq!(pick(Plain, &[151_936], 4096, 1, false), (4, 2));
        // Qwen3-0.6B: Q/K/V 2048+1024+1024, gate+up 3072, O and down 1024 rows (2,048 and
        // 3,072 columns), lm_head of 1,024 columns: one unit.
        assert_eq!(pick(Qkv, &[2048, 1024, 1024], 1024, 1, false), (2, 1));
        assert_eq!(pick(QkvNorm, &[2048, 1024, 1024], 1024, 1, false), (4, 1));
        assert_eq!(pick(GatedNorm, &[3072], 1024, 1, false), (8, 1));
        assert_eq!(pick(Plain, &[1024], 2048, 1, false), (4, 1));
        assert_eq!(pick(Plain, &[1024], 3072, 1, false), (4, 1));
        assert_eq!(pick(Plain, &[151_936], 1024, 1, false), (4, 1));
        // More than one activation row, or the preloading kernels: always R = 4, one unit.
        assert_eq!(pick(Plain, &[151_936], 4096, 2, false), (GEMV_ROWS, 1));
        assert_eq!(
            pick(Qkv, &[4096, 1024, 1024], 4096, 1, true),
            (GEMV_ROWS, 1)
        );
    }

    /// `AFM_GEMV_R` / `set_gemv_half` take every shape the one-matrix kernels come in, by R or
    /// R and units, and nothing else.
    #[test]
    fn forced_shapes_parse() {
        for (v, r, u) in [
            ("1", 1, 1),
            ("2", 2, 1),
            (" 4 ", 4, 1),
            ("8", 8, 1),
            ("4u1", 4, 1),
            ("2u2", 2, 2),
            ("4u2", 4, 2),
        ] {
            assert_eq!(parse_half_rows(v), Some(HalfShape::new(r, u)), "{v:?}");
        }
        for bad in [
            "", "0", "3", "5", "16", "32", "x", "-4", "8u2", "1u2", "4u", "u2", "4u3",
        ] {
            assert_eq!(parse_half_rows(bad), None, "{bad:?}");
        }
    }

    /// Every family's rule ends in a candidate that always applies, and every candidate and
    /// every forced shape maps to a kernel that is listed (so loaded) for both 16-bit types.
    #[test]
    fn every_rows_per_block_has_its_kernels() {
        let names = kernel_names();
        use HalfKernel::*;
        let families = [
            (Plain, ["gemv", "gemva"].as_slice()),
            (Qkv, &["gemv3"]),
            (QkvNorm, &["gemv3n"]),
            (Gated, &["gemvg"]),
            (GatedNorm, &["gemvgn"]),
        ];
        for (k, prefixes) in families {
            let rule = half_rows_rule(k);
            assert_eq!(rule.last().map(|p| p.min_blocks_per_sm), Some(0), "{k:?}");
            let picks = rule.iter().map(|p| p.shape);
            let forced = HalfShape::all().map(|s| s.for_kernel(k));
            for s in picks.chain(forced) {
                assert!(s.exists_for(k), "{k:?} {s:?}");
                for p in prefixes {
                    for t in ["bf16", "f16"] {
                        let name = format!("{p}_{t}_1{}", s.suffix());
                        assert!(names.contains(&name), "{name} not listed");
                    }
                }
            }
        }
        // Shapes with more units come only for the one-matrix kernels.
        assert!(HalfShape::new(4, 2).exists_for(Plain));
        assert!(!HalfShape::new(4, 2).exists_for(Gated));
        assert!(!HalfShape::new(8, 2).exists_for(Plain));
    }
}
