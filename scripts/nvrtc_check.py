#!/usr/bin/env python3
"""Compiles every CUDA kernel module with NVRTC, as the runtime does, on a machine without a GPU.

    python3 scripts/nvrtc_check.py [--arch compute_90] [--lib PATH/libnvrtc.so.13] [-D MACRO]...

Each crates/afm-runtime/src/cuda/kernels/*.cu is compiled the way cuda/context.rs's
compile_kernels does: kernels/common.cuh's text, a newline, then the module's text, named
"<module>.cu", with the options "--std=c++17" and "--gpu-architecture=<arch>" (the runtime picks
the device's own; compute_90 is the H200's, and skinny.cu takes compute_90a there, as the
runtime gives it). common.cuh is never compiled alone: it is part of every module. No
include paths are given, as none are at run time. Then the module that compute/cuda.rs's
CudaDevice::open builds from Rust string constants (EXTRA_KERNELS, then
compute/cuda/kv_rows.rs's KERNELS), as it does: "compute_extra.cu", the same two options.

-D MACRO (repeatable) puts "#define MACRO 1" in front of every kernel module, as cuda/context.rs's
module_source does for the modules whose compile-time switch (MODULE_DEFINES) is on, e.g.
-D AFM_GEMV_L2PF (gemv.cu's L2 prefetch; the runtime's default) and -D AFM_GEMV_L2PF_LINES.
Without -D the modules compile with every such switch off.

Prints each module's result and NVRTC's log; exits 1 if any module fails (warnings alone pass,
but are printed). Needs only libnvrtc (found by --lib, $AFM_NVRTC_LIB, or the pip wheel
nvidia-cuda-nvrtc under this Python's site-packages).

--resources compiles each module for the architecture's real GPU instead (compute_90 -> sm_90,
a CUBIN as the runtime's kernel cache holds) and also prints, per kernel, what cuobjdump reads from it: registers per thread, stack bytes
per thread, and the local-memory loads and stores in its SASS. A kernel with a stack keeps
arrays or spilled values in local memory, which goes through L1 to L2 (the fused decode step's
phases waited on it: bench/RESULTS.md, session 15). Needs cuobjdump (--cuobjdump,
$AFM_CUOBJDUMP, PATH, or the pip wheel nvidia-cuda-cuobjdump) and, for the SASS, nvdisasm on
PATH or in $NVDISASM_PATH (the pip wheel nvidia-cuda-nvdisasm). --module NAME (repeatable)
limits the run to those modules.
"""

import argparse
import ctypes
import glob
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KERNELS = os.path.join(ROOT, "crates/afm-runtime/src/cuda/kernels")
COMMON = "common.cuh"
COMPUTE = os.path.join(ROOT, "crates/afm-runtime/src/compute")
# (file, constant) in the order CudaDevice::open concatenates them.
EXTRA = [("cuda.rs", "EXTRA_KERNELS"), ("cuda/kv_rows.rs", "KERNELS")]


def rust_raw_string(path, const):
    """The text of `const NAME: &str = r#"..."#;` in a Rust file."""
    with open(path) as f:
        text = f.read()
    m = re.search(r"const " + const + r': &str = r#"(.*?)"#;', text, re.S)
    if not m:
        sys.exit(f"nvrtc_check: no raw string constant {const} in {path}")
    return m.group(1)


def find_lib(given):
    cands = [given, os.environ.get("AFM_NVRTC_LIB")]
    site = sysconfig.get_paths()["purelib"]
    cands += sorted(glob.glob(os.path.join(site, "nvidia/cu*/lib/libnvrtc.so.*")), reverse=True)
    cands += sorted(glob.glob(os.path.join(site, "nvidia/cuda_nvrtc/lib/libnvrtc.so.*")), reverse=True)
    cands += ["/root/.pyenv/versions/3.11.7/lib/python3.11/site-packages/nvidia/cu13/lib/libnvrtc.so.13"]
    for c in cands:
        # libnvrtc-builtins sits next to libnvrtc; skip it and anything absent.
        if c and os.path.isfile(c) and "builtins" not in os.path.basename(c):
            return c
    sys.exit("nvrtc_check: libnvrtc not found (pass --lib or set AFM_NVRTC_LIB)")


class Nvrtc:
    def __init__(self, path):
        # Load the builtins library first from the same folder, so the dlopen inside finds it.
        for b in glob.glob(os.path.join(os.path.dirname(path), "libnvrtc-builtins.so*")):
            ctypes.CDLL(b, mode=ctypes.RTLD_GLOBAL)
            break
        self.lib = ctypes.CDLL(path)
        self.lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        major, minor = ctypes.c_int(), ctypes.c_int()
        self.check(self.lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
        self.version = f"{major.value}.{minor.value}"

    def check(self, rc, what):
        if rc != 0:
            msg = self.lib.nvrtcGetErrorString(rc).decode()
            raise RuntimeError(f"{what}: {msg}")

    def compile(self, source, name, options, cubin=False):
        """Returns (ok, log, ptx, cubin); the CUBIN (with `cubin`: options name a real GPU)
        comes from the same program as the PTX, else it is None."""
        prog = ctypes.c_void_p()
        self.check(
            self.lib.nvrtcCreateProgram(
                ctypes.byref(prog), source.encode(), name.encode(), 0, None, None
            ),
            "nvrtcCreateProgram",
        )
        try:
            opts = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
            rc = self.lib.nvrtcCompileProgram(prog, len(options), opts)
            size = ctypes.c_size_t()
            self.check(self.lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size)), "log size")
            log = ctypes.create_string_buffer(size.value)
            self.check(self.lib.nvrtcGetProgramLog(prog, log), "log")
            ptx, bin_ = b"", None
            if rc == 0:
                self.check(self.lib.nvrtcGetPTXSize(prog, ctypes.byref(size)), "ptx size")
                buf = ctypes.create_string_buffer(size.value)
                self.check(self.lib.nvrtcGetPTX(prog, buf), "ptx")
                ptx = buf.value
            if rc == 0 and cubin:
                self.check(self.lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "cubin size")
                buf = ctypes.create_string_buffer(size.value)
                self.check(self.lib.nvrtcGetCUBIN(prog, buf), "cubin")
                bin_ = buf.raw
            return rc == 0, log.value.decode(errors="replace").strip(), ptx, bin_
        finally:
            self.lib.nvrtcDestroyProgram(ctypes.byref(prog))


def find_cuobjdump(given):
    site = sysconfig.get_paths()["purelib"]
    cands = [given, os.environ.get("AFM_CUOBJDUMP"), shutil.which("cuobjdump")]
    cands += sorted(glob.glob(os.path.join(site, "nvidia/cu*/bin/cuobjdump")), reverse=True)
    cands += sorted(glob.glob(os.path.join(site, "nvidia/cuda_cuobjdump/bin/cuobjdump")))
    for c in cands:
        if c and os.path.isfile(c):
            return c
    sys.exit("nvrtc_check: cuobjdump not found (pass --cuobjdump or set AFM_CUOBJDUMP)")


def resources(cuobjdump, cubin):
    """[(kernel, registers, stack bytes, local loads, local stores)] of a CUBIN."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        def run(flag):
            r = subprocess.run([cuobjdump, flag, f.name], capture_output=True, text=True)
            if r.returncode != 0:
                # e.g. -sass needs nvdisasm on PATH (the nvidia-cuda-nvdisasm wheel has it)
                last = (r.stderr.strip().splitlines() or ["no message"])[-1]
                sys.exit(f"nvrtc_check: cuobjdump {flag} failed: {last}")
            return r.stdout
        usage, sass = run("-res-usage"), run("-sass")
    pattern = r"Function (\w+):\s*REG:(\d+) STACK:(\d+)"
    regs = {n: (int(r), int(st)) for n, r, st in re.findall(pattern, usage)}
    local = {}
    for part in re.split(r"\n\s*Function : ", sass)[1:]:
        name = part.split(None, 1)[0]
        local[name] = (len(re.findall(r"\bLDL\b", part)), len(re.findall(r"\bSTL\b", part)))
    return [(n, r, st) + local.get(n, (0, 0)) for n, (r, st) in sorted(regs.items())]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="compute_90")
    ap.add_argument("--lib")
    ap.add_argument("--dir", default=KERNELS, help="folder of the .cu files and common.cuh")
    ap.add_argument("--save-ptx", metavar="DIR", help="also write each module's PTX there")
    ap.add_argument("-D", "--define", action="append", default=[], metavar="MACRO",
                    help="#define MACRO 1 in front of every kernel module (repeatable)")
    ap.add_argument("--resources", action="store_true",
                    help="registers, stack and local memory per kernel (needs cuobjdump)")
    ap.add_argument("--cuobjdump")
    ap.add_argument("--module", action="append", default=[], metavar="NAME",
                    help="only this module (e.g. decode_fused; repeatable)")
    args = ap.parse_args()
    cuobjdump = find_cuobjdump(args.cuobjdump) if args.resources else None
    nv = Nvrtc(find_lib(args.lib))
    with open(os.path.join(args.dir, COMMON)) as f:
        common = f.read()
    modules = sorted(glob.glob(os.path.join(args.dir, "*.cu")))
    if not modules:
        sys.exit(f"nvrtc_check: no .cu files in {args.dir}")
    # --resources: the real GPU of the architecture (compute_90 -> sm_90), whose program gives
    # the PTX checked below and the CUBIN read for resources, as the runtime's kernel cache does.
    arch = args.arch.replace("compute_", "sm_") if args.resources else args.arch
    options = ["--std=c++17", f"--gpu-architecture={arch}"]
    print(f"NVRTC {nv.version}, options {' '.join(options)}"
          + "".join(f", #define {d} 1" for d in args.define))
    jobs = []
    for path in modules:
        with open(path) as f:
            defines = "".join(f"#define {d} 1\n" for d in args.define)
            name = os.path.basename(path)
            # cuda/context.rs's module_arch: the skinny GEMM's wgmma needs the 90a variant.
            opts = options
            if name == "skinny.cu" and arch.endswith("_90"):
                opts = ["--std=c++17", f"--gpu-architecture={arch}a"]
            jobs.append((name, f"{defines}{common}\n{f.read()}", opts))
    if args.dir == KERNELS:
        extra = "".join(rust_raw_string(os.path.join(COMPUTE, f), c) for f, c in EXTRA)
        jobs.append(("compute_extra.cu", extra, options))
    if args.module:
        jobs = [j for j in jobs if j[0][:-3] in args.module]
    failed = []
    for name, src, opts in jobs:
        ok, log, ptx, cubin = nv.compile(src, name, opts, cubin=args.resources)
        entries = ptx.count(b".entry ")
        print(f"{'ok  ' if ok else 'FAIL'} {name}" + (f" ({entries} entry points)" if ok else ""))
        if log:
            print("    " + log.replace("\n", "\n    "))
        if not ok:
            failed.append(name)
        elif args.save_ptx:
            os.makedirs(args.save_ptx, exist_ok=True)
            with open(os.path.join(args.save_ptx, name[:-3] + ".ptx"), "wb") as f:
                f.write(ptx)
        if ok and cubin:
            for kernel, r, st, ldl, stl in resources(cuobjdump, cubin):
                print(f"    {kernel}: {r} registers, {st} bytes of stack, "
                      f"{ldl} local loads, {stl} local stores")
    if failed:
        print(f"nvrtc_check: {len(failed)} module(s) failed: {', '.join(failed)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
