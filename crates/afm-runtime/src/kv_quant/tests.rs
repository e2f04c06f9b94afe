use super::*;

const D: usize = 64;
const BS: usize = 16;
const HEADS: usize = 2;

fn layer(bits: Bits, num_blocks: usize) -> QuantLayer {
    QuantLayer::new(
        QuantShape {
            num_blocks,
            block_size: BS,
            n_kv_heads: HEADS,
            head_dim: D,
        },
        bits,
    )
}

/// Keys shaped like Qwen2.5's: a large per-channel offset (up to ±60) plus a small
/// token-dependent part; values without offsets.
fn key(t: usize, h: usize) -> Vec<f32> {
    (0..D)
        .map(|c| {
            let bias = ((c * 13 + h * 5) % 17) as f32 * 7.5 - 60.0;
            bias + ((t * 31 + c * 7) % 23) as f32 / 11.0 - 1.0
        })
        .collect()
}

fn value(t: usize, h: usize) -> Vec<f32> {
    (0..D)
        .map(|c| ((t * 17 + c * 5 + h) % 29) as f32 / 7.0 - 2.0)
        .collect()
}

fn token(t: usize) -> (Vec<f32>, Vec<f32>) {
    let k = (0..HEADS).flat_map(|h| key(t, h)).collect();
    let v = (0..HEADS).flat_map(|h| value(t, h)).collect();
    (k, v)
}

/// Writes tokens `t0..t1` of a sequence whose positions start at `t0 = 0` into `table`.
fn write_tokens(q: &mut QuantLayer, table: &[u32], t0: usize, t1: usize) {
    for t in t0..t1 {
        let (k, v) = token(t);
        q.write(table[t / BS], t % BS, false, &k, &v);
    }
}

/// Largest error of every key channel and value group of block `b` (tokens `t0..t0 + n`)
/// relative to half a quantization step of that channel's or group's own range.
fn worst_step_fraction(q: &QuantLayer, block: u32, t0: usize, n: usize, levels: f32) -> f32 {
    let mut worst = 0f32;
    for h in 0..HEADS {
        let mut ks = vec![0.0; n * D];
        let mut vs = vec![0.0; n * D];
        q.read_keys(block, h, 0, &mut ks);
        q.read_values(block, h, 0, &mut vs);
        for c in 0..D {
            let col: Vec<f32> = (0..n).map(|s| key(t0 + s, h)[c]).collect();
            let range = col.iter().fold(f32::MIN, |m, &x| m.max(x))
                - col.iter().fold(f32::MAX, |m, &x| m.min(x));
            for (s, &want) in col.iter().enumerate() {
                let err = (ks[s * D + c] - want).abs();
                worst = worst.max(err / (range / levels / 2.0));
            }
        }
        let g = group_size(D, q.bits);
        for s in 0..n {
            let want = value(t0 + s, h);
            for gi in 0..D / g {
                let grp = &want[gi * g..(gi + 1) * g];
                let range = grp.iter().fold(f32::MIN, |m, &x| m.max(x))
                    - grp.iter().fold(f32::MAX, |m, &x| m.min(x));
                for j in 0..g {
                    let err = (vs[s * D + gi * g + j] - grp[j]).abs();
                    worst = worst.max(err / (range / levels / 2.0));
                }
            }
        }
    }
    worst
}

#[test]
fn full_blocks_round_trip_within_half_a_step_of_each_channel() {
    for (bits, levels) in [(Bits::Eight, 255.0), (Bits::Four, 15.0)] {
        let mut q = layer(bits, 4);
        let table = [3u32, 1];
        write_tokens(&mut q, &table, 0, 2 * BS);
        for (b, &block) in table.iter().enumerate() {
            let worst = worst_step_fraction(&q, block, b * BS, BS, levels);
            // The f16 grid is rounded outward, widening a step by well under 1%.
            assert!(worst <= 1.02, "{bits:?} block {block}: {worst} half-steps");
        }
        assert!(q.staged.is_empty(), "full blocks are quantized, not staged");
    }
}

#[test]
fn a_block_being_filled_reads_back_exactly() {
    let mut q = layer(Bits::Four, 2);
    write_tokens(&mut q, &[1], 0, 5);
    let mut ks = vec![0.0; 5 * D];
    let mut vs = vec![0.0; 5 * D];
    q.read_keys(1, 1, 0, &mut ks);
    q.read_values(1, 1, 0, &mut vs);
    for s in 0..5 {
        assert_eq!(ks[s * D..(s + 1) * D], key(s, 1)[..]);
        assert_eq!(vs[s * D..(s + 1) * D], value(s, 1)[..]);
    }
    // A read of a later span of the same block.
    let mut k2 = vec![0.0; 2 * D];
    q.read_keys(1, 0, 3, &mut k2);
    assert_eq!(k2[..D], key(3, 0)[..]);
}

#[test]
fn writing_one_block_leaves_the_others_untouched() {
    let mut q = layer(Bits::Four, 3);
    write_tokens(&mut q, &[0], 0, BS);
    let mut before = vec![0.0; BS * D];
    q.read_keys(0, 1, 0, &mut before);
    write_tokens(&mut q, &[2, 1], 0, 2 * BS);
    let mut after = vec![0.0; BS * D];
    q.read_keys(0, 1, 0, &mut after);
    assert_eq!(before, after);
}

#[test]
fn staged_blocks_beyond_the_limit_are_quantized_and_resume_correctly() {
    let n = STAGED_BLOCKS + 8;
    let mut q = layer(Bits::Eight, n);
    // n sequences, one block each, filled round-robin as a batch would: 5 tokens, then the rest.
    for t in 0..5 {
        for b in 0..n as u32 {
            let (k, v) = token(t);
            q.write(b, t, false, &k, &v);
        }
    }
    assert!(q.staged.len() <= STAGED_BLOCKS + 1);
    for t in 5..BS {
        for b in 0..n as u32 {
            let (k, v) = token(t);
            q.write(b, t, false, &k, &v);
        }
    }
    assert!(q.staged.is_empty());
    for b in 0..n as u32 {
        // Early quantization of the first 5 slots (then f16 and requantized once more) costs
        // at most about one extra step.
        let worst = worst_step_fraction(&q, b, 0, BS, 255.0);
        assert!(worst <= 3.0, "block {b}: {worst} half-steps");
    }
}

#[test]
fn rewriting_the_last_slot_of_a_full_block_keeps_the_block() {
    // The engine recomputes a sequence's last position when a step returned no token.
    let mut q = layer(Bits::Four, 2);
    write_tokens(&mut q, &[1], 0, BS);
    let mut before = vec![0.0; BS * D];
    q.read_keys(1, 0, 0, &mut before);
    write_tokens(&mut q, &[1], BS - 1, BS);
    let mut after = vec![0.0; BS * D];
    q.read_keys(1, 0, 0, &mut after);
    let worst = before
        .iter()
        .zip(&after)
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    assert!(worst < 0.5, "{worst}");
    assert!(q.staged.is_empty());
}

#[test]
fn the_f16_grid_covers_large_offsets() {
    for (lo, hi) in [
        (1000.3f32, 1000.9f32),
        (-77.77, -77.1),
        (0.0, 0.0),
        (-1e-3, 5.0),
    ] {
        for bits in [Bits::Eight, Bits::Four] {
            let g = Grid::new(lo, hi, bits);
            let top = g.min.to_f32() + g.levels * g.scale.to_f32();
            assert!(
                g.min.to_f32() <= lo && top >= hi,
                "{lo}..{hi}: {g:?}",
                g = (g.min, g.scale)
            );
            let step = (g.scale.to_f32() / 2.0).max(lo.abs() * 1e-3);
            for x in [lo, hi, (lo + hi) / 2.0] {
                let y = g.code(x) as f32 * g.scale.to_f32() + g.min.to_f32();
                assert!((y - x).abs() <= step * 1.0001, "{x} -> {y} ({bits:?})");
            }
        }
    }
}

#[test]
fn bytes_per_block_counts_codes_and_parameters() {
    let s = QuantShape {
        num_blocks: 1,
        block_size: 16,
        n_kv_heads: 2,
        head_dim: 64,
    };
    // K and V codes 2·16·64 each; key params 64 channels × 4 B; value params 16 slots ×
    // 2 groups (8-bit) or 4 groups (4-bit) × 4 B, for each of the 2 heads.
    assert_eq!(
        s.bytes_per_block(Bits::Eight),
        2 * (2 * 16 * 64) + 2 * 64 * 4 + 2 * 16 * 2 * 4
    );
    assert_eq!(
        s.bytes_per_block(Bits::Four),
        2 * (16 * 64) + 2 * 64 * 4 + 2 * 16 * 4 * 4
    );
}

/// Dequantization cost per element against the f16 cache's conversion (attention reads every
/// cached element once per step). `cargo test --release -p afm-runtime --lib read_speed --
/// --ignored --nocapture`.
#[test]
#[ignore = "timing"]
fn read_speed() {
    use half::slice::HalfFloatSliceExt;
    let (nb, reps) = (64, 200);
    let elems = (reps * nb * HEADS * 2 * BS * D) as f64;
    let mut out = vec![0f32; BS * D];
    for bits in [Bits::Eight, Bits::Four] {
        let mut q = layer(bits, nb);
        let table: Vec<u32> = (0..nb as u32).collect();
        write_tokens(&mut q, &table, 0, nb * BS);
        let t = std::time::Instant::now();
        for _ in 0..reps {
            for b in 0..nb as u32 {
                for h in 0..HEADS {
                    q.read_keys(b, h, 0, &mut out);
                    q.read_values(b, h, 0, &mut out);
                }
            }
        }
        let ns = t.elapsed().as_nanos() as f64 / elems;
        println!("{bits:?}: {ns:.2} ns per element");
    }
    let f16s = vec![f16::from_f32(0.5); BS * D];
    let t = std::time::Instant::now();
    for _ in 0..reps * nb * HEADS * 2 {
        f16s.convert_to_f32_slice(&mut out);
        std::hint::black_box(&out);
    }
    println!(
        "f16: {:.2} ns per element",
        t.elapsed().as_nanos() as f64 / elems
    );
}
