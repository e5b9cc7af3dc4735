"""Issue 53, target 2, the second bare calibration: a row of logits held on chip by a thread-block cluster
(``gif_cluster.cu``; its header has the design and the math), against the same 2-pass floor as ``gif_split.py``.

Built with nvcc for sm_90a at the start (a cubin, seconds; no torch extension), loaded and launched through the CUDA
driver API (ctypes on libcuda: cuModuleLoadData, cuLaunchKernel on torch's current stream). Every configuration
(CL CTAs a cluster x THREADS) is checked against torch in fp32 (the same reference as ``gif_split.py``) and timed with
``triton.testing.do_bench``; rows whose slice does not fit in shared memory or does not divide into 16-byte vectors
are listed as skipped.

Usage: python bench/probes/gif_cluster.py OUT [--vocab V ...]; ``--compile-only`` builds here (nvcc, no GPU) and
prints ptxas' registers and spills. Writes OUT/gif_cluster.json. A record of what ran.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import subprocess
import sys
import tempfile

import torch
from gif_split import ADV, INV_T, failed, problem, sweep

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
SRC = os.path.join(HERE, "gif_cluster.cu")
CONFIGS = [(1, 512), (2, 256), (2, 512), (2, 1024), (4, 256), (4, 512), (8, 256), (8, 512)]  # as the .cu's kernels
SMEM_OPTIN = 232448  # bytes of shared memory a block may opt into on sm_90 (227 KiB)
STATIC_SMEM = 1024  # the kernels' static shared memory (<= 400 B, ptxas) with room to spare


def nvcc():
    from torch.utils.cpp_extension import CUDA_HOME
    for cand in ([os.path.join(CUDA_HOME, "bin", "nvcc")] if CUDA_HOME else []) + [shutil.which("nvcc")]:
        if cand and os.path.exists(cand):
            return cand
    raise RuntimeError("nvcc not found (CUDA_HOME, PATH)")


def build(out_dir, verbose=False):
    """nvcc: ``gif_cluster.cu`` into ``OUT/gif_cluster.cubin``; returns its path and ptxas' report (``-v``)."""
    cubin = os.path.join(out_dir, "gif_cluster.cubin")
    cmd = [nvcc(), "-cubin", "-arch=sm_90a", "-O3", "-std=c++17", "-Xptxas", "-v", SRC, "-o", cubin]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode or verbose:
        print(p.stdout + p.stderr, flush=True)
    if p.returncode:
        raise RuntimeError("nvcc failed")
    return cubin, p.stdout + p.stderr


class Driver:
    """The few CUDA driver calls the probe needs, through ctypes."""

    def __init__(self, cubin):
        self.cu = ctypes.CDLL("libcuda.so.1")
        self.cu.cuLaunchKernel.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
        torch.cuda.init()
        torch.empty(1, device="cuda")  # the runtime makes the primary context current on this thread
        self.mod = ctypes.c_void_p()
        with open(cubin, "rb") as f:
            self.image = f.read()
        self.check(self.cu.cuModuleLoadData(ctypes.byref(self.mod), ctypes.c_char_p(self.image)))

    def check(self, res):
        if res:
            name = ctypes.c_char_p()
            self.cu.cuGetErrorName(res, ctypes.byref(name))
            raise RuntimeError(f"CUDA driver error {res} ({name.value.decode() if name.value else '?'})")

    def function(self, name, smem):
        fn = ctypes.c_void_p()
        self.check(self.cu.cuModuleGetFunction(ctypes.byref(fn), self.mod, name.encode()))
        self.check(self.cu.cuFuncSetAttribute(fn, 8, ctypes.c_int(smem)))  # MAX_DYNAMIC_SHARED_SIZE_BYTES
        return fn

    def launcher(self, fn, grid, block, smem, args):
        keep = [ctypes.c_void_p(a.data_ptr()) if torch.is_tensor(a) else
                (ctypes.c_float(a) if isinstance(a, float) else ctypes.c_int(a)) for a in args]
        params = (ctypes.c_void_p * len(keep))(*[ctypes.cast(ctypes.pointer(k), ctypes.c_void_p) for k in keep])

        def launch():
            stream = torch.cuda.current_stream().cuda_stream
            self.check(self.cu.cuLaunchKernel(fn, *grid, block, 1, 1, smem, ctypes.c_void_p(stream), params, None))
        launch.keep = (keep, params)
        return launch


def measure(drv, N, V, bw, do_bench):
    inv_t, adv, rows = INV_T, ADV, []
    x, y, r, floor, g_ref, lp_ref, out, logp = problem(N, V, bw)
    for cl, threads in CONFIGS:
        name = f"cluster CL={cl} threads={threads}"
        smem = V // cl * 2
        if V % (8 * cl) or smem + STATIC_SMEM > SMEM_OPTIN:
            rows.append({"V": V, "impl": name, "skipped": "slice not 16-byte vectors" if V % (8 * cl) else
                         f"slice {smem} B + static > {SMEM_OPTIN} B of shared memory"})
            print(f"V={V:6d} {name:30s} skipped ({rows[-1]['skipped']})", flush=True)
            continue
        try:
            launch = drv.launcher(drv.function(f"gif_cluster_{cl}_{threads}", smem), (cl, N, 1), threads, smem,
                                  [x, y, r, adv, out, logp, V, inv_t])
            out.zero_()
            launch()
            torch.cuda.synchronize()
            err = ((out.float() - g_ref).abs().max().item(), (logp - lp_ref).abs().max().item())
            ms = do_bench(launch, warmup=25, rep=100, return_mode="median")
            rows.append({"V": V, "impl": name, "ms": ms, "floor2_ms": floor, "ratio_2pass": ms / floor,
                         "smem_bytes": smem, "max_abs_err_grad": err[0], "max_abs_err_logp": err[1],
                         "max_abs_grad": g_ref.abs().max().item()})
            print(f"V={V:6d} {name:30s} {ms:7.3f} ms  {ms / floor:5.3f}x 2-pass floor  err grad {err[0]:.2e} "
                  f"(of {rows[-1]['max_abs_grad']:.2e}) logp {err[1]:.2e}", flush=True)
        except Exception as ex:  # report every configuration
            rows.append(failed(V, name, ex))
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(prog="gif_cluster.py", description=__doc__.splitlines()[0])
    p.add_argument("out", nargs="?", default=None)
    p.add_argument("--vocab", type=int, nargs="+", default=[128256, 151936, 32000])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--compile-only", action="store_true", help="build the cubin here (nvcc, no GPU)")
    a = p.parse_args(argv)
    if a.compile_only:
        with tempfile.TemporaryDirectory() as d:
            build(d, verbose=True)
        return 0
    if a.out is None or not torch.cuda.is_available():
        p.error("needs OUT and a CUDA device (or --compile-only)")
    sys.path.insert(0, ROOT)
    from triton.testing import do_bench

    drv = Driver(build(a.out)[0])
    return sweep(a.out, "gif_cluster.json", a.tokens, a.vocab, lambda V, bw: measure(drv, a.tokens, V, bw, do_bench))


if __name__ == "__main__":
    sys.exit(main())
