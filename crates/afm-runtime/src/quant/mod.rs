//! GGML block formats: dequantization and quantized dot products.

use crate::DType;

/// Decode one row stored as `dtype` into f32.
pub fn dequantize_row(dtype: DType, src: &[u8], out: &mut [f32]) {
    match dtype {
        DType::F32 => {
            for (o, c) in out.iter_mut().zip(src.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        other => unimplemented!("dequantize {}", other.name()),
    }
}
