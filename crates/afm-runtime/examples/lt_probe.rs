//! Probe: every cuBLASLt heuristic algorithm for the decode GEMMs of Qwen3-0.6B and Qwen3-8B
//! at 16..64 rows (bf16 weights and x, f32 output), timed with weights rotated past the L2,
//! against `cublasGemmEx` with the default algorithm (what the runtime calls). Prints one line
//! per algorithm: µs per call, its tile / split-K / stages / cluster ids.
//! Run: `lt_probe [ROWS...]` (default 64).

use std::ffi::c_void;
use std::mem::MaybeUninit;

use cudarc::cublas::sys as blas;
use cudarc::cublaslt::sys as lt;
use cudarc::driver::{CudaContext, CudaSlice, DevicePtr};

type R<T> = Result<T, Box<dyn std::error::Error>>;

fn check(s: lt::cublasStatus_t, what: &str) -> R<()> {
    if s == lt::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
        Ok(())
    } else {
        Err(format!("{what}: {s:?}").into())
    }
}

fn cfg_attr(algo: &lt::cublasLtMatmulAlgo_t, a: lt::cublasLtMatmulAlgoConfigAttributes_t) -> i64 {
    let mut v: u64 = 0;
    let mut written = 0usize;
    // SAFETY: v has 8 bytes; the attribute is at most 8 (u32/u16/i32 ones fit).
    unsafe {
        lt::cublasLtMatmulAlgoConfigGetAttribute(
            algo,
            a,
            (&mut v) as *mut u64 as *mut c_void,
            8,
            &mut written,
        );
    }
    match written {
        2 => (v & 0xffff) as i64,
        4 => (v & 0xffff_ffff) as i64,
        _ => v as i64,
    }
}

fn main() -> R<()> {
    let rows_list: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse().expect("rows"))
        .collect();
    let rows_list = if rows_list.is_empty() {
        vec![64]
    } else {
        rows_list
    };
    let ctx = CudaContext::new(0)?;
    let stream = ctx.default_stream();
    let cs = stream.cu_stream() as lt::cudaStream_t;
    let mut handle = MaybeUninit::uninit();
    // SAFETY: plain handle creation.
    let handle = unsafe {
        check(lt::cublasLtCreate(handle.as_mut_ptr()), "create")?;
        handle.assume_init()
    };
    let mut bh = MaybeUninit::uninit();
    // SAFETY: plain handle creation.
    let bh = unsafe {
        blas::cublasCreate_v2(bh.as_mut_ptr());
        bh.assume_init()
    };
    unsafe { blas::cublasSetStream_v2(bh, cs as _) };
    let ws_bytes = 32usize << 20;
    let ws: CudaSlice<u8> = stream.alloc_zeros(ws_bytes)?;
    let (wsp, _g) = ws.device_ptr(&stream);
    // name, m (weight rows), k (cols), beta
    let shapes: [(&str, usize, usize, f32); 10] = [
        ("0.6B qkv", 4096, 1024, 0.0),
        ("0.6B o", 1024, 2048, 1.0),
        ("0.6B gateup", 6144, 1024, 0.0),
        ("0.6B down", 1024, 3072, 1.0),
        ("0.6B lm_head", 151936, 1024, 0.0),
        ("8B qkv", 6144, 4096, 0.0),
        ("8B o", 4096, 4096, 1.0),
        ("8B gateup", 24576, 4096, 0.0),
        ("8B down", 4096, 12288, 1.0),
        ("8B lm_head", 151936, 4096, 0.0),
    ];
    // Random bf16 of magnitude 2^-7..1 (zeros would draw less power than real weights).
    let mut seed = 0x9E37_79B9_7F4A_7C15u64;
    let host: Vec<u16> = (0..151936 * 4096)
        .map(|_| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            let r = seed as u16;
            (r & 0x807f) | ((120 + (r >> 8) % 7) << 7)
        })
        .collect();
    for &n in &rows_list {
        for &(name, m, k, beta) in &shapes {
            let wbytes = m * k * 2;
            let copies = (512usize << 20).div_ceil(wbytes).clamp(2, 64);
            let ws_: Vec<CudaSlice<u16>> = (0..copies)
                .map(|_| stream.clone_htod(&host[..m * k]))
                .collect::<Result<_, _>>()?;
            let x: CudaSlice<u16> = stream.clone_htod(&host[..n * k])?;
            let out: CudaSlice<f32> = stream.alloc_zeros(n * m)?;
            let wps: Vec<u64> = ws_.iter().map(|w| w.device_ptr(&stream).0).collect();
            let (xp, _gx) = x.device_ptr(&stream);
            let (op, _go) = out.device_ptr(&stream);
            let alpha = 1.0f32;
            let bf = lt::cudaDataType::CUDA_R_16BF;
            let f32t = lt::cudaDataType::CUDA_R_32F;
            // SAFETY: descriptors and layouts created and used on valid sizes below.
            unsafe {
                let mut desc = MaybeUninit::uninit();
                check(
                    lt::cublasLtMatmulDescCreate(
                        desc.as_mut_ptr(),
                        lt::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                        f32t,
                    ),
                    "desc",
                )?;
                let desc = desc.assume_init();
                let t = blas::cublasOperation_t::CUBLAS_OP_T;
                check(
                    lt::cublasLtMatmulDescSetAttribute(
                        desc,
                        lt::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA,
                        (&t) as *const _ as *const c_void,
                        std::mem::size_of_val(&t),
                    ),
                    "transa",
                )?;
                let layout = |ty, r: usize, c: usize, ld: usize| -> R<lt::cublasLtMatrixLayout_t> {
                    let mut l = MaybeUninit::uninit();
                    check(
                        lt::cublasLtMatrixLayoutCreate(
                            l.as_mut_ptr(),
                            ty,
                            r as u64,
                            c as u64,
                            ld as i64,
                        ),
                        "layout",
                    )?;
                    Ok(l.assume_init())
                };
                let la = layout(bf, k, m, k)?;
                let lb = layout(bf, k, n, k)?;
                let lc = layout(f32t, m, n, m)?;
                let mut pref = MaybeUninit::uninit();
                check(
                    lt::cublasLtMatmulPreferenceCreate(pref.as_mut_ptr()),
                    "pref",
                )?;
                let pref = pref.assume_init();
                check(
                    lt::cublasLtMatmulPreferenceSetAttribute(
                        pref,
                        lt::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                        (&ws_bytes) as *const usize as *const c_void,
                        8,
                    ),
                    "pref ws",
                )?;
                let mut res: Vec<lt::cublasLtMatmulHeuristicResult_t> =
                    vec![std::mem::zeroed(); 64];
                let mut cnt = 0;
                check(
                    lt::cublasLtMatmulAlgoGetHeuristic(
                        handle,
                        desc,
                        la,
                        lb,
                        lc,
                        lc,
                        pref,
                        64,
                        res.as_mut_ptr(),
                        &mut cnt,
                    ),
                    "heuristic",
                )?;
                let reps = 40;
                let time = |f: &mut dyn FnMut(usize) -> R<()>| -> R<f64> {
                    for i in 0..3 {
                        f(i)?;
                    }
                    let mut best = Vec::new();
                    for _ in 0..5 {
                        let e0 = stream.record_event(Some(
                            cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT,
                        ))?;
                        for i in 0..reps {
                            f(i)?;
                        }
                        let e1 = stream.record_event(Some(
                            cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT,
                        ))?;
                        e1.synchronize()?;
                        best.push(e0.elapsed_ms(&e1)? as f64 * 1000.0 / reps as f64);
                    }
                    best.sort_by(|a, b| a.partial_cmp(b).unwrap());
                    Ok(best[2])
                };
                let us_default = time(&mut |i| {
                    let s = blas::cublasGemmEx(
                        bh,
                        blas::cublasOperation_t::CUBLAS_OP_T,
                        blas::cublasOperation_t::CUBLAS_OP_N,
                        m as i32,
                        n as i32,
                        k as i32,
                        (&alpha) as *const f32 as *const c_void,
                        wps[i % copies] as *const c_void,
                        blas::cudaDataType_t::CUDA_R_16BF,
                        k as i32,
                        xp as *const c_void,
                        blas::cudaDataType_t::CUDA_R_16BF,
                        k as i32,
                        (&beta) as *const f32 as *const c_void,
                        op as *mut c_void,
                        blas::cudaDataType_t::CUDA_R_32F,
                        m as i32,
                        blas::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                        blas::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                    );
                    if s != blas::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
                        return Err(format!("gemmex {s:?}").into());
                    }
                    Ok(())
                })?;
                let ideal = wbytes as f64 / 4.26e6;
                println!(
                    "{name} n={n} m={m} k={k}: GemmEx default {us_default:.2} us ({:.2} TB/s; copy-rate {ideal:.2} us), {cnt} algos",
                    wbytes as f64 / us_default / 1e6
                );
                for (j, r) in res.iter().take(cnt as usize).enumerate() {
                    if r.state != lt::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
                        continue;
                    }
                    let algo = r.algo;
                    let us = time(&mut |i| {
                        check(
                            lt::cublasLtMatmul(
                                handle,
                                desc,
                                (&alpha) as *const f32 as *const c_void,
                                wps[i % copies] as *const c_void,
                                la,
                                xp as *const c_void,
                                lb,
                                (&beta) as *const f32 as *const c_void,
                                op as *const c_void,
                                lc,
                                op as *mut c_void,
                                lc,
                                &algo,
                                wsp as *mut c_void,
                                ws_bytes,
                                cs,
                            ),
                            "matmul",
                        )
                    });
                    use lt::cublasLtMatmulAlgoConfigAttributes_t as A;
                    let us = match us {
                        Ok(u) => format!("{u:8.2}"),
                        Err(e) => format!("err {e}"),
                    };
                    println!(
                        "  #{j:2} {us} us  id {} tile {} splitk {} red {} swz {} stages {} inner {} cluster {} ws {} waves {:.2}",
                        cfg_attr(&algo, A::CUBLASLT_ALGO_CONFIG_ID),
                        cfg_attr(&algo, A::CUBLASLT_ALGO_CONFIG_TILE_ID),
                        cfg_attr(&algo, A::CUBLASLT_ALGO_CONFIG_SPLITK_NUM),
                        cfg_attr(&algo, A::CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME),
                        cfg_attr(&algo, A::CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING),
                        cfg_attr(&algo, A::CUBLASLT_ALGO_CONFIG_STAGES_ID),
                        cfg_attr(&algo, A::CUBLASLT_ALGO_CONFIG_INNER_SHAPE_ID),
                        cfg_attr(&algo, A::CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID),
                        r.workspaceSize,
                        r.wavesCount
                    );
                }
                lt::cublasLtMatmulPreferenceDestroy(pref);
                lt::cublasLtMatrixLayoutDestroy(la);
                lt::cublasLtMatrixLayoutDestroy(lb);
                lt::cublasLtMatrixLayoutDestroy(lc);
                lt::cublasLtMatmulDescDestroy(desc);
            }
        }
    }
    Ok(())
}
