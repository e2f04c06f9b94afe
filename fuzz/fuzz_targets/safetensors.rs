//! safetensors header parser on arbitrary bytes: `Ok` or a `WeightsError`, never a panic; a
//! tensor view that parses lies inside the file.
#![no_main]

use afm_models::weights::SafetensorsSet;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(set) = SafetensorsSet::from_bytes(data.to_vec()) else {
        return;
    };
    for name in set.tensor_names() {
        let _ = set.dtype_of(&name);
        if let Ok(view) = set.tensor(&name) {
            let _ = view.to_f32();
        }
    }
});
