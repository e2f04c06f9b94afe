//! Prints `x·Wᵀ` for one GGUF tensor and a fixed input, as raw f32, for checking the kernels
//! against an independent implementation: `matmul_probe <gguf> <tensor> <out.bin>`.

use std::io::Write;

use afm_models::weights::GgufFile;

fn main() {
    let a: Vec<String> = std::env::args().collect();
    let g = GgufFile::open(std::path::Path::new(&a[1])).expect("open");
    let w = g
        .tensor(&a[2])
        .expect("tensor")
        .into_matrix()
        .expect("matrix");
    let x: Vec<f32> = (0..w.cols())
        .map(|i| ((i * 7919 % 1000) as f32 / 500.0 - 1.0) * 0.7)
        .collect();
    let mut y = vec![0.0; w.rows()];
    w.matmul(&x, 1, &mut y);
    let mut f = std::fs::File::create(&a[3]).expect("create");
    for v in y {
        f.write_all(&v.to_le_bytes()).expect("write");
    }
}
