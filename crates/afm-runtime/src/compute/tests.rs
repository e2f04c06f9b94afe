//! Device dispatch: the CPU arm is the host code; with `--features cuda` and
//! `AFM_TEST_DEVICE=cuda`, every op on the GPU matches the CPU arm.

use super::*;

#[test]
fn device_choice_parses_what_users_type() {
    assert_eq!("cpu".parse::<DeviceChoice>(), Ok(DeviceChoice::Cpu));
    assert_eq!("cuda".parse::<DeviceChoice>(), Ok(DeviceChoice::Cuda(0)));
    assert_eq!("CUDA:3".parse::<DeviceChoice>(), Ok(DeviceChoice::Cuda(3)));
    assert!("cuda:x".parse::<DeviceChoice>().is_err());
    assert!("metal".parse::<DeviceChoice>().is_err());
    assert_eq!(DeviceChoice::Cuda(1).to_string(), "cuda:1");
}

#[test]
fn cpu_linear_is_the_host_matmul_plus_bias() {
    let dev = Device::Cpu;
    let w = WeightMatrix::from_f32(3, 2, &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
    let w = dev.weight(w).expect("cpu weight");
    let b = dev.vector(vec![0.5, 0.0, -1.0]).expect("cpu vector");
    let x = Tensor::from_host(2, 2, vec![1.0, 1.0, 0.0, 2.0]).expect("shape");
    let y = dev
        .to_host(dev.linear(&x, &w, Some(&b)).expect("linear"))
        .expect("host");
    assert_eq!(y, vec![3.5, 7.0, 10.0, 4.5, 8.0, 11.0]);
}

#[test]
fn shape_errors_name_the_operand() {
    let dev = Device::Cpu;
    let w = dev
        .weight(WeightMatrix::from_f32(2, 2, &[0.0; 4]))
        .expect("weight");
    let x = Tensor::from_host(1, 3, vec![0.0; 3]).expect("shape");
    let err = dev
        .linear(&x, &w, None)
        .err()
        .expect("width mismatch")
        .to_string();
    assert!(
        err.contains("linear input width") && err.contains('3'),
        "{err}"
    );
    let err = dev
        .embed(&w, &[5], 1.0)
        .err()
        .expect("id out of range")
        .to_string();
    assert!(err.contains("token id"), "{err}");
}

#[cfg(not(feature = "cuda"))]
#[test]
fn cuda_is_refused_by_a_cpu_build() {
    let err = Device::open(DeviceChoice::Cuda(0))
        .expect_err("no cuda")
        .to_string();
    assert!(err.contains("--features cuda"), "{err}");
}

#[cfg(feature = "cuda")]
mod gpu;
