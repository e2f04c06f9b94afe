//! The GGUF reader against files laid out byte by byte in the tests: every metadata type,
//! alignment, and each malformed case mapped to its error.

use super::*;
use crate::weights::testfiles::{put_str, GgufBuilder, TestTensor};

fn err_of(bytes: Vec<u8>) -> WeightsError {
    GgufFile::from_bytes(bytes).expect_err("should be refused")
}

fn one_tensor(t: TestTensor) -> Vec<u8> {
    GgufBuilder::new()
        .kv("general.architecture", GgufValue::Str("llama".into()))
        .tensor(t)
        .build()
}

fn every_type() -> Vec<(&'static str, GgufValue)> {
    use GgufValue::*;
    vec![
        ("u8", U8(200)),
        ("i8", I8(-100)),
        ("u16", U16(60000)),
        ("i16", I16(-30000)),
        ("u32", U32(4_000_000_000)),
        ("i32", I32(-2_000_000_000)),
        ("f32", F32(1.5)),
        ("bool", Bool(true)),
        ("str", Str("héllo".into())),
        ("u64", U64(u64::MAX)),
        ("i64", I64(i64::MIN)),
        ("f64", F64(-0.25)),
        (
            "strings",
            Array(vec![Str("a".into()), Str("".into()), Str("ccc".into())]),
        ),
        (
            "nested",
            Array(vec![Array(vec![I32(1), I32(2)]), Array(vec![I32(3)])]),
        ),
        ("empty", Array(vec![])),
    ]
}

#[test]
fn reads_every_metadata_type_in_v2_and_v3() {
    for version in [2, 3] {
        let mut b = GgufBuilder::new();
        b.version = version;
        for (k, v) in every_type() {
            b = b.kv(k, v);
        }
        let f = GgufFile::from_bytes(b.build()).unwrap();
        assert_eq!(f.version(), version);
        let want: BTreeMap<String, GgufValue> = every_type()
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect();
        assert_eq!(f.metadata(), &want);
        assert_eq!(f.tensor_names().count(), 0);
        assert_eq!(f.alignment(), 32);
    }
}

#[test]
fn accessors_convert_between_number_types() {
    use GgufValue::*;
    assert_eq!(U8(7).as_u64(), Some(7));
    assert_eq!(I32(7).as_u64(), Some(7));
    assert_eq!(I32(-1).as_u64(), None);
    assert_eq!(U64(u64::MAX).as_i64(), None);
    assert_eq!(I16(-3).as_i64(), Some(-3));
    assert_eq!(F32(0.5).as_f64(), Some(0.5));
    assert_eq!(U32(3).as_f64(), Some(3.0));
    assert_eq!(F32(1.0).as_u64(), None);
    assert_eq!(Str("x".into()).as_str(), Some("x"));
    assert_eq!(Bool(false).as_bool(), Some(false));
    assert_eq!(U8(1).as_bool(), None);
    assert_eq!(Array(vec![U8(1)]).as_array(), Some([U8(1)].as_slice()));
}

#[test]
fn tensors_are_outermost_first_slices_of_the_file() {
    let bytes = GgufBuilder::new()
        .kv("general.architecture", GgufValue::Str("llama".into()))
        .tensor(TestTensor::f32("w", &[3, 2], &[1., 2., 3., 4., 5., 6.]))
        .tensor(TestTensor::f32("b", &[2], &[7., 8.]))
        .build();
    let f = GgufFile::from_bytes(bytes).unwrap();
    assert_eq!(f.architecture(), Some("llama"));
    assert_eq!(f.tensor_names().collect::<Vec<_>>(), ["w", "b"]);
    let w = f.tensor("w").unwrap();
    assert_eq!(
        (w.dtype, w.shape.clone(), w.numel()),
        (DType::F32, vec![2, 3], 6)
    );
    assert_eq!(w.to_f32().unwrap(), [1., 2., 3., 4., 5., 6.]);
    let m = w.into_matrix().unwrap();
    assert_eq!((m.rows(), m.cols()), (2, 3));
    assert_eq!(f.tensor("b").unwrap().to_f32().unwrap(), [7., 8.]);
    assert!(f.contains("b") && !f.contains("c"));
    assert!(matches!(f.tensor("c"), Err(WeightsError::MissingTensor { name }) if name == "c"));
}

#[test]
fn honours_general_alignment() {
    // Fillers of 8..64 bytes end the header at every 8-byte position mod 64, so about half
    // of these read the right values only if data starts at the 64-byte boundary, not 32.
    for filler in 0..8 {
        let mut b = GgufBuilder::new()
            .kv("general.alignment", GgufValue::U32(64))
            .kv("filler", GgufValue::Str("x".repeat(filler * 8)));
        b.alignment = 64;
        let b = b
            .tensor(TestTensor::f32("a", &[3], &[1., 2., 3.]))
            .tensor(TestTensor::f32("b", &[2], &[4., 5.]));
        let (bytes, data_start) = b.build_with_data_start();
        assert_eq!(data_start % 64, 0);
        let f = GgufFile::from_bytes(bytes).unwrap();
        assert_eq!(f.alignment(), 64);
        assert_eq!(f.tensor("a").unwrap().to_f32().unwrap(), [1., 2., 3.]);
        assert_eq!(f.tensor("b").unwrap().to_f32().unwrap(), [4., 5.]);
    }
    for bad in [
        GgufValue::U32(0),
        GgufValue::U32(48),
        GgufValue::I32(-64),
        GgufValue::Str("64".into()),
    ] {
        let err = err_of(GgufBuilder::new().kv("general.alignment", bad).build());
        assert!(err.to_string().contains("general.alignment"), "{err}");
    }
}

#[test]
fn quantized_tensor_uses_block_geometry_and_dequantizes() {
    // Q8_0: 32 weights per block as f16 scale + 32 i8; scale 0.5 (0x3800), q = -16..16.
    let mut block = vec![0x00, 0x38];
    block.extend((-16i8..16).map(|q| q as u8));
    let data: Vec<u8> = [block.clone(), block].concat();
    let t = TestTensor {
        name: "q".into(),
        dims: vec![32, 2],
        type_id: 8,
        data,
        offset: None,
    };
    let f = GgufFile::from_bytes(one_tensor(t)).unwrap();
    let q = f.tensor("q").unwrap();
    assert_eq!(
        (q.dtype, q.shape.clone(), q.bytes.len()),
        (DType::Q8_0, vec![2, 32], 68)
    );
    let want: Vec<f32> = (-16..16).map(|q| q as f32 * 0.5).collect();
    assert_eq!(q.to_f32().unwrap(), [want.clone(), want].concat());
}

#[test]
fn refuses_bad_magic_and_versions() {
    let good = GgufBuilder::new().build();
    assert!(matches!(err_of(vec![]), WeightsError::BadMagic { .. }));
    assert!(matches!(
        err_of(b"GGU".to_vec()),
        WeightsError::BadMagic { .. }
    ));
    let mut bad = good.clone();
    bad[0] = b'X';
    assert!(matches!(err_of(bad), WeightsError::BadMagic { .. }));
    for v in [1u32, 4, 0] {
        let mut b = GgufBuilder::new();
        b.version = v;
        let err = err_of(b.build());
        assert!(matches!(err, WeightsError::UnsupportedVersion { version, .. } if version == v));
    }
    let mut big_endian = good;
    big_endian[4..8].copy_from_slice(&3u32.to_be_bytes());
    assert!(err_of(big_endian).to_string().contains("big-endian"));
}

#[test]
fn every_truncation_is_an_error() {
    let bytes = GgufBuilder::new()
        .kv("general.architecture", GgufValue::Str("llama".into()))
        .kv(
            "tokens",
            GgufValue::Array(vec![GgufValue::Str("ab".into()); 3]),
        )
        .tensor(TestTensor::f32("w", &[4], &[1., 2., 3., 4.]))
        .build();
    for len in 0..bytes.len() {
        assert!(
            GgufFile::from_bytes(bytes[..len].to_vec()).is_err(),
            "prefix of {len} bytes"
        );
    }
    // 26 bytes after the 24-byte header pass the count checks; the 28-byte key does not fit.
    match err_of(bytes[..50].to_vec()) {
        WeightsError::Truncated { what, offset } => {
            assert!(what.contains("metadata entry 0"), "{what}");
            assert_eq!(offset, 32);
        }
        other => panic!("{other}"),
    }
}

#[test]
fn hostile_counts_are_refused_before_allocating() {
    let good = one_tensor(TestTensor::f32("w", &[1], &[1.]));
    let mut huge_tensors = good.clone();
    huge_tensors[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
    assert!(matches!(
        err_of(huge_tensors),
        WeightsError::CountTooLarge {
            count: u64::MAX,
            ..
        }
    ));
    let mut huge_kvs = good;
    huge_kvs[16..24].copy_from_slice(&(1u64 << 40).to_le_bytes());
    assert!(matches!(
        err_of(huge_kvs),
        WeightsError::CountTooLarge { .. }
    ));

    // An array claiming 2^60 u32 elements, and a string claiming u64::MAX bytes.
    let mut b = b"GGUF".to_vec();
    b.extend(3u32.to_le_bytes());
    b.extend(0u64.to_le_bytes());
    b.extend(1u64.to_le_bytes());
    put_str(&mut b, "arr");
    let header_end = b.len();
    b.extend(9u32.to_le_bytes());
    b.extend(4u32.to_le_bytes());
    b.extend((1u64 << 60).to_le_bytes());
    b.extend([0; 64]);
    let err = err_of(b.clone());
    assert!(
        matches!(&err, WeightsError::CountTooLarge { what, .. } if what.contains("arr")),
        "{err}"
    );
    b.truncate(header_end);
    b.extend(8u32.to_le_bytes());
    b.extend(u64::MAX.to_le_bytes());
    b.extend([0; 64]);
    assert!(matches!(err_of(b), WeightsError::Truncated { .. }));
}

#[test]
fn tensor_placement_is_checked() {
    let at = |offset| TestTensor {
        offset: Some(offset),
        ..TestTensor::f32("w", &[4], &[0.; 4])
    };
    let err = err_of(one_tensor(at(64)));
    assert!(
        matches!(err, WeightsError::TensorOutOfBounds { ref name, offset: 64, size: 16, .. } if name == "w"),
        "{err}"
    );
    let err = err_of(one_tensor(at(u64::MAX / 32 * 32)));
    assert!(
        matches!(err, WeightsError::TensorOutOfBounds { .. }),
        "{err}"
    );
    let err = err_of(one_tensor(at(4)));
    assert!(
        matches!(
            err,
            WeightsError::Misaligned {
                offset: 4,
                alignment: 32,
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn tensor_types_and_shapes_are_checked() {
    for id in [15, 40, 1000] {
        let t = TestTensor {
            type_id: id,
            ..TestTensor::f32("blk.0.x", &[1], &[0.])
        };
        let err = err_of(one_tensor(t));
        assert!(
            matches!(&err, WeightsError::UnknownTensorType { name, id: got } if name == "blk.0.x" && *got == id),
            "{err}"
        );
        assert!(err.to_string().contains("blk.0.x") && err.to_string().contains(&id.to_string()));
    }
    let five = TestTensor::f32("x", &[1, 1, 1, 1, 1], &[0.]);
    assert!(err_of(one_tensor(five)).to_string().contains("n_dims is 5"));
    for dims in [vec![u64::MAX, 2], vec![1 << 62]] {
        let t = TestTensor {
            dims,
            ..TestTensor::f32("x", &[1], &[0.])
        };
        assert!(matches!(
            err_of(one_tensor(t)),
            WeightsError::Overflow { .. }
        ));
    }
    let half_block = TestTensor {
        type_id: 8,
        ..TestTensor::f32("x", &[16], &[0.; 5])
    };
    assert!(matches!(
        err_of(one_tensor(half_block)),
        WeightsError::BadShape { .. }
    ));
}

#[test]
fn malformed_metadata_is_refused() {
    let dup = GgufBuilder::new()
        .kv("a", GgufValue::U8(1))
        .kv("a", GgufValue::U8(2))
        .build();
    assert!(err_of(dup).to_string().contains("appears twice"));
    let dup_tensor = GgufBuilder::new()
        .tensor(TestTensor::f32("w", &[1], &[0.]))
        .tensor(TestTensor::f32("w", &[1], &[0.]))
        .build();
    assert!(err_of(dup_tensor).to_string().contains("appears twice"));

    let mut deep = GgufValue::U8(0);
    for _ in 0..=MAX_ARRAY_DEPTH {
        deep = GgufValue::Array(vec![deep]);
    }
    assert!(err_of(GgufBuilder::new().kv("deep", deep).build())
        .to_string()
        .contains("nested"));

    // Offsets: 24-byte header, then key length (8) and key, then the u32 type, then the value.
    let mut bool2 = GgufBuilder::new().kv("flag", GgufValue::Bool(true)).build();
    bool2[24 + 8 + 4 + 4] = 2;
    assert!(err_of(bool2).to_string().contains("bool byte is 2"));

    let mut unknown = GgufBuilder::new().kv("k", GgufValue::U8(0)).build();
    unknown[24 + 8 + 1..24 + 8 + 1 + 4].copy_from_slice(&13u32.to_le_bytes());
    assert!(err_of(unknown)
        .to_string()
        .contains("unknown value type 13"));

    let mut bad_key = GgufBuilder::new().kv("k", GgufValue::U8(0)).build();
    bad_key[24 + 8] = 0xff;
    assert!(err_of(bad_key).to_string().contains("UTF-8"));
}

#[test]
fn mutated_files_never_panic() {
    let good = GgufBuilder::new()
        .kv("general.architecture", GgufValue::Str("llama".into()))
        .kv(
            "nested",
            GgufValue::Array(vec![GgufValue::Array(vec![GgufValue::I32(1)])]),
        )
        .tensor(TestTensor::f32("w", &[2, 2], &[1., 2., 3., 4.]))
        .build();
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    for _ in 0..5000 {
        let mut bytes = good.clone();
        for _ in 0..1 + next() % 4 {
            let i = (next() % bytes.len() as u64) as usize;
            bytes[i] = next() as u8;
        }
        if let Ok(f) = GgufFile::from_bytes(bytes) {
            for name in f.tensor_names() {
                let _ = f.tensor(name).map(|t| t.to_f32());
            }
        }
    }
}

/// Integer tensors (GGML I8/I16/I32/I64, as llama.cpp writes DeepSeek V4's hash table) read
/// back as i64 with their sign, outermost dimension first, and are refused as weights.
#[test]
fn integer_tensors_read_as_signed_tables() {
    let int = |name: &str, type_id: u32, dims: &[u64], data: Vec<u8>| TestTensor {
        name: name.into(),
        dims: dims.to_vec(),
        type_id,
        data,
        offset: None,
    };
    let i32s: Vec<u8> = [0i32, 3, -2, 7, 1, -2_000_000_000]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    let bytes = GgufBuilder::new()
        .tensor(int("tid2eid", 26, &[2, 3], i32s))
        .tensor(int("i8", 24, &[3], vec![0xff, 0x7f, 0x80]))
        .tensor(int("i16", 25, &[1], (-300i16).to_le_bytes().to_vec()))
        .tensor(int("i64", 27, &[1], i64::MIN.to_le_bytes().to_vec()))
        .tensor(TestTensor::f32("w", &[2], &[1.0, 2.0]))
        .build();
    let g = GgufFile::from_bytes(bytes).expect("valid file");
    let (shape, ids) = g.integers("tid2eid").expect("I32 table");
    assert_eq!(shape, vec![3, 2]);
    assert_eq!(ids, vec![0, 3, -2, 7, 1, -2_000_000_000]);
    assert_eq!(g.integers("i8").unwrap().1, vec![-1, 127, -128]);
    assert_eq!(g.integers("i16").unwrap().1, vec![-300]);
    assert_eq!(g.integers("i64").unwrap().1, vec![i64::MIN]);
    let as_weights = g.tensor("tid2eid").expect_err("a table is not weights");
    assert!(
        as_weights.to_string().contains("integer table"),
        "{as_weights}"
    );
    let as_table = g.integers("w").expect_err("weights are not a table");
    assert!(as_table.to_string().contains("F32"), "{as_table}");
}
