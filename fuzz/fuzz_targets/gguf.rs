//! GGUF parser on arbitrary bytes: parsing, metadata access and every tensor view must end in
//! `Ok` or a `WeightsError`, never a panic, and never read outside the file.
#![no_main]

use afm_models::weights::GgufFile;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(file) = GgufFile::from_bytes(data.to_vec()) else {
        return;
    };
    let _ = file.architecture();
    let _ = file.alignment();
    for value in file.metadata().values() {
        let _ = (value.as_u64(), value.as_i64(), value.as_f64(), value.as_str());
    }
    let names: Vec<String> = file.tensor_names().map(str::to_string).collect();
    for name in names {
        if let Ok(view) = file.tensor(&name) {
            // A view that parsed lies inside the file, so converting it is bounded by its size.
            let _ = view.to_f32();
        }
    }
});
