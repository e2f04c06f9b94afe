//! Reproducible pseudo-random token ids, for the examples that measure or compare models on
//! prompts no tokenizer made (`step_time`, `device_compare`, `gpu_bench`, `graph_check`): the
//! same seed gives the same prompt on every machine, so runs on the CPU and the GPU, or before
//! and after a change, read the same tokens.

/// `n` ids below `vocab` from seed `seed` (splitmix64).
pub fn random_token_ids(seed: u64, n: usize, vocab: usize) -> Vec<u32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = s;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            ((z ^ (z >> 31)) % vocab.max(1) as u64) as u32
        })
        .collect()
}
