//! Batches of 3–4 rows on AVX-512 VNNI: the `vnni_lanes` idea for a group of four activation
//! rows, each row's block as two quads of dwords in a 512-bit register.
//!
//! The activations are re-laid once per matmul call (`Q8Quads`, from `Q8Rows`, same bytes):
//! ```text
//! per 32-value block k:
//!   qs:   [quad q = 0..2][row 0..4][16 bytes]   128 B  (values 16q..16q+16 of each row)
//!   ds:   [d of rows 0..4, each four times][s = d·Σq of rows 0..4]   20 f32
//! ```
//! i32 lane `4r + i` meets dword `4q + i` of row r, so the weight operand is the block's 16
//! bytes of quad q broadcast to every 128-bit quarter (one `vbroadcasti32x4` load), and one
//! `vpdpbusd`, one conversion and one FMA cover a quad of four rows. Each (row, dword) lane
//! is the per-row kernel's lane with its own FMA chain, summed at the end in `hsum`'s order
//! (docs/DECISIONS.md), so a row's output is the same alone and in a batch. The offset and
//! minimum handling is `vnni_lanes`' (`Form`, `Operands`).

use super::activations::{Q8Rows, Q8_BLOCK};
use super::prefetch_ahead;
use super::vnni_lanes::{Form, Operands};
use super::vnni_legacy::{Block, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0};
use crate::DType;
use std::arch::x86_64::*;

/// Activation rows of a quad group.
pub const ROWS: usize = 4;
/// f32 scales per block in `Q8Quads::ds`: each row's `d` four times, then its `s`.
const DS: usize = 20;

/// Up to four Q8 activation rows interleaved by quad (see the module header), zero rows
/// past the end of the batch (their outputs are 0 and dropped).
pub struct Q8Quads {
    blocks: usize,
    qs: Vec<i8>,
    ds: Vec<f32>,
}

impl Q8Quads {
    /// The (at most four) rows of `x` regrouped for weights of `dtype`.
    pub fn from_rows(x: &Q8Rows, dtype: DType) -> Self {
        let cols = x.cols;
        let blocks = cols / Q8_BLOCK;
        let n = x.qs.len().checked_div(cols).unwrap_or(0).min(ROWS);
        // `q + 128` (the offset formats) as an unsigned byte is `q` with its top bit flipped.
        let flip = if matches!(dtype, DType::Q4_0 | DType::Q5_0 | DType::Q8_0) {
            i8::MIN
        } else {
            0
        };
        let mut l = Self {
            blocks,
            qs: vec![flip; blocks * 128],
            ds: vec![0f32; blocks * DS],
        };
        for r in 0..n {
            let row = &x.qs[r * cols..(r + 1) * cols];
            for (k, block) in row.chunks_exact(Q8_BLOCK).enumerate() {
                let [d, s] = x.ds[r * blocks + k];
                l.ds[k * DS + 4 * r..k * DS + 4 * r + 4].fill(d);
                l.ds[k * DS + 16 + r] = s;
                for (q, half) in block.chunks_exact(16).enumerate() {
                    let at = 128 * k + 64 * q + 16 * r;
                    for (t, &b) in l.qs[at..at + 16].iter_mut().zip(half) {
                        *t = b ^ flip;
                    }
                }
            }
        }
        l
    }
}

/// The 16 bytes at `p` broadcast to every 128-bit quarter (a `vbroadcasti32x4` load).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn bcast16(p: *const u8) -> __m512i {
    _mm512_broadcast_i32x4(_mm_loadu_si128(p as *const __m128i))
}

/// The two quads of a weight block's values, each broadcast to every quarter: quad q holds
/// dwords 4q..4q+4.
trait Quads: Form {
    /// Through `values` and a stack copy unless the stored bytes can be broadcast directly.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn quads(p: *const u8) -> [__m512i; 2] {
        #[repr(align(32))]
        struct Buf([u8; 32]);
        let mut buf = Buf([0; 32]);
        _mm256_store_si256(buf.0.as_mut_ptr() as *mut __m256i, Self::values(p));
        std::array::from_fn(|q| bcast16(buf.0.as_ptr().add(16 * q)))
    }
}

/// Quads of plain nibbles at `qs` (weights 0..15 the low nibbles of bytes 0..15, 16..31 the
/// high ones); with `shift` false the high nibbles stay in place (`HIGH_X16`).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn nibble_quads(qs: *const u8, shift: bool) -> [__m512i; 2] {
    let raw = bcast16(qs);
    let m4 = _mm512_set1_epi8(0x0F);
    let high = if shift {
        _mm512_and_si512(_mm512_srli_epi16(raw, 4), m4)
    } else {
        _mm512_and_si512(raw, _mm512_set1_epi8(-16))
    };
    [_mm512_and_si512(raw, m4), high]
}

impl Quads for Q4_0 {
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn quads(p: *const u8) -> [__m512i; 2] {
        nibble_quads(p.add(2), true)
    }
}
impl Quads for Q4_1 {
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn quads(p: *const u8) -> [__m512i; 2] {
        nibble_quads(p.add(4), false)
    }
}
impl Quads for Q8_0 {
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn quads(p: *const u8) -> [__m512i; 2] {
        [bcast16(p.add(2)), bcast16(p.add(18))]
    }
}
impl Quads for Q5_0 {}
impl Quads for Q5_1 {}

/// `out[r] = w · row r` for r = 0..4 (`out[4..8]` zeroed: the driver's tiles are 8 wide), in
/// `vnni_legacy`'s order.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn tile<B: Quads>(w: &[u8], x: &Q8Quads, out: &mut [f32]) {
    let mut acc = [_mm512_setzero_ps(); 2];
    let mut summs = _mm_setzero_ps();
    for k in 0..x.blocks {
        let p = w.as_ptr().add(k * B::BYTES);
        prefetch_ahead(p, 1);
        let sc = B::scales(p);
        let dw = _mm512_broadcastss_ps(sc);
        let ops = Operands::new::<B>(B::quads(p));
        let xq = x.qs.as_ptr().add(128 * k) as *const __m512i;
        let prod = _mm512_mul_ps(dw, _mm512_loadu_ps(x.ds.as_ptr().add(k * DS)));
        let prod_hi = if B::HIGH_X16 {
            _mm512_mul_ps(prod, _mm512_set1_ps(1.0 / 16.0))
        } else {
            prod
        };
        for (i, a) in acc.iter_mut().enumerate() {
            let lanes = ops.dot::<B>(i, _mm512_loadu_si512(xq.add(i)));
            let p = if i == 0 { prod } else { prod_hi };
            *a = _mm512_fmadd_ps(p, _mm512_cvtepi32_ps(lanes), *a);
        }
        if B::HAS_MIN {
            let mw = _mm_broadcastss_ps(_mm_movehdup_ps(sc));
            let sx = _mm_loadu_ps(x.ds.as_ptr().add(k * DS + 16));
            summs = _mm_add_ps(summs, _mm_mul_ps(mw, sx));
        }
    }
    // `hsum`'s order, ((l0+l4)+(l2+l6))+((l1+l5)+(l3+l7)), within each quarter: lane 4r + i
    // of `x` is l_i + l_{4+i} of row r; `e` adds the quarter's other half (lanes i and i+2),
    // `f` its neighbour (even + odd in lane 4r).
    let x = _mm512_add_ps(acc[0], acc[1]);
    let e = _mm512_add_ps(x, _mm512_permute_ps::<0x4E>(x));
    let f = _mm512_add_ps(e, _mm512_permute_ps::<0xB1>(e));
    let rows = _mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
    let v = _mm_add_ps(
        _mm512_castps512_ps128(_mm512_permutexvar_ps(rows, f)),
        summs,
    );
    _mm_storeu_ps(out.as_mut_ptr(), v);
    _mm_storeu_ps(out.as_mut_ptr().add(ROWS), _mm_setzero_ps());
}

/// One weight row `w` against the quad group; `out` is 8 wide (rows 4..8 zero).
pub type QuadsKernel = fn(w: &[u8], x: &Q8Quads, out: &mut [f32]);

macro_rules! entry {
    ($name:ident, $block:ty) => {
        pub(super) fn $name(w: &[u8], x: &Q8Quads, out: &mut [f32]) {
            assert_eq!(
                w.len(),
                x.blocks * <$block as Block>::BYTES,
                "a quads tile takes one weight row as long as the activation rows"
            );
            assert_eq!(out.len(), 2 * ROWS, "a quads tile writes 8 outputs");
            // SAFETY: selected by `quads_kernel` only when AVX-512 VNNI/BW/VL and
            // AVX2/FMA/F16C are present; the asserts above bound every read and write.
            unsafe { tile::<$block>(w, x, out) }
        }
    };
}

entry!(dot_q4_0, Q4_0);
entry!(dot_q4_1, Q4_1);
entry!(dot_q5_0, Q5_0);
entry!(dot_q5_1, Q5_1);
entry!(dot_q8_0, Q8_0);
