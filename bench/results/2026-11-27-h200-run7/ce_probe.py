"""Run 7's copy-engine probe (issue 54, target 3): where does a same-device copy run, and does a copy the driver is
asked to put on the copy engines hide under compute-bound GEMMs?

Run 6 measured the overlapped bf16 sync costing the GEMM chain about the copy's own time whether our kernel or
``copy_`` (cudaMemcpyAsync, device to device) did it. Two questions, one measurement each:
1. ``spin``: a kernel holding every SM's thread slots (2 x 1024 threads an SM) spins for ~40 ms on stream A; a
   256 MiB copy is queued on stream B just after it. A copy run by SM kernels cannot start until the spin ends; one
   run by the copy engines ends ~its own time after it is queued. Control: a dtype-converting copy (always a kernel).
2. ``overlap``: ``bench sync``'s GEMM chain (bf16 8192^3) alone, and with the bf16 layout's 290 tensors copied on a
   side stream by per-tensor ``copy_`` and by one ``cudaMemcpyBatchAsync`` (CUDA >= 12.8) with
   ``cudaMemcpyFlagPreferOverlapWithCompute``, the runtime's hint to use the copy engines (called through ctypes
   on the libcudart torch loaded, so the same context and streams).
A record of what ran (like run6a.sh), not package code. Writes ``OUT/ce_probe.json``.
"""
import ctypes
import json
import sys
import time

import torch
import triton
import triton.language as tl

sys.path.insert(0, ".")
from bench.bench_sync import Flat, layout, time_reps  # noqa: E402


@triton.jit
def spin(out_ptr, iters, a, b, BLOCK: tl.constexpr):
    # dependent FMAs for ``iters`` rounds: a runtime count, so the kernel's length is set without recompiling
    x = tl.arange(0, BLOCK).to(tl.float32)
    for _ in range(iters):
        x = x * a + b
    tl.store(out_ptr + tl.program_id(0) * BLOCK + tl.arange(0, BLOCK), x)


def launch_spin(out, iters, sms):
    spin[(2 * sms,)](out, iters, 0.999, 0.001, BLOCK=1024, num_warps=32)


def cudart():
    """The libcudart that torch loaded (read from /proc/self/maps after CUDA is initialised)."""
    for line in open("/proc/self/maps"):
        if "libcudart" in line:
            return ctypes.CDLL(line.split()[-1])
    return ctypes.CDLL("libcudart.so")


class Loc(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class Attr(ctypes.Structure):
    _fields_ = [("srcAccessOrder", ctypes.c_int), ("srcLocHint", Loc), ("dstLocHint", Loc), ("flags", ctypes.c_uint)]


def batch_copier(dst, src, lib, version):
    n = len(dst)
    P = ctypes.c_void_p * n
    S = ctypes.c_size_t * n
    d = P(*[t.data_ptr() for t in dst])
    s = P(*[t.data_ptr() for t in src])
    sz = S(*[t.numel() * t.element_size() for t in src])
    dev = torch.cuda.current_device()
    attr = Attr(1, Loc(1, dev), Loc(1, dev), 1)  # order: stream; device -> device; PreferOverlapWithCompute
    idx = (ctypes.c_size_t * 1)(0)
    fail = ctypes.c_size_t(0)

    def copy(stream):
        h = ctypes.c_void_p(stream.cuda_stream)
        if version >= 13000:
            rc = lib.cudaMemcpyBatchAsync(d, s, sz, ctypes.c_size_t(n), ctypes.byref(attr), idx, ctypes.c_size_t(1), h)
        else:
            rc = lib.cudaMemcpyBatchAsync(d, s, sz, ctypes.c_size_t(n), ctypes.byref(attr), idx, ctypes.c_size_t(1),
                                          ctypes.byref(fail), h)
        if rc:
            raise RuntimeError(f"cudaMemcpyBatchAsync returned {rc}")
    return copy


def main(out_dir):
    dev = "cuda"
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    lib = cudart()
    v = ctypes.c_int(0)
    lib.cudaRuntimeGetVersion(ctypes.byref(v))
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "cudart": v.value, "sms": sms}
    side = torch.cuda.Stream()
    out = torch.empty(2 * sms * 1024, device=dev)

    # 1. spin: calibrate ~40 ms, then queue each copy behind it on a side stream
    # Triton specialises an int argument on divisibility by 16: every count used is a multiple of 16, and each
    # is launched once before it is timed, so no compile falls inside a timed window (call 1 timed one: 1.2 ms spins)
    launch_spin(out, 100000, sms)
    torch.cuda.synchronize()
    e = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
    e[0].record(); launch_spin(out, 100000, sms); e[1].record(); torch.cuda.synchronize()
    iters = 16 * int(100000 * 40 / e[0].elapsed_time(e[1]) / 16)
    launch_spin(out, iters, sms)
    torch.cuda.synchronize()
    n = 128 << 20
    a16, b16, a32 = (torch.randn(n, device=dev).to(torch.bfloat16), torch.empty(n, device=dev, dtype=torch.bfloat16),
                     torch.randn(n, device=dev))
    copies = {"copy_ bf16 -> bf16 (cudaMemcpyAsync)": lambda s: b16.copy_(a16),
              "copy_ fp32 -> bf16 (a kernel: control)": lambda s: b16.copy_(a32)}
    try:
        copies["cudaMemcpyBatchAsync bf16 (prefer overlap)"] = (
            lambda s, c=batch_copier([b16], [a16], lib, v.value): c(s))
    except Exception as ex:  # noqa: BLE001
        res["batch_error"] = repr(ex)
    spin_rows = []
    for name, fn in copies.items():
        try:
            with torch.cuda.stream(side):  # alone
                fn(side)
            torch.cuda.synchronize()
            e[0].record(side)
            with torch.cuda.stream(side):
                fn(side)
            e[1].record(side)
            torch.cuda.synchronize()
            alone = e[0].elapsed_time(e[1])
            e[0].record(); launch_spin(out, iters, sms); e[1].record()
            side.wait_event(e[0])  # the copy is queued after the spin has been queued, not after it ends
            with torch.cuda.stream(side):
                fn(side)
            e[3].record(side)
            torch.cuda.synchronize()
            row = {"copy": name, "alone_ms": alone, "spin_ms": e[0].elapsed_time(e[1]),
                   "copy_done_after_spin_start_ms": e[0].elapsed_time(e[3])}
            row["ran_beside_the_spin"] = row["copy_done_after_spin_start_ms"] < row["spin_ms"]
        except Exception as ex:  # noqa: BLE001
            row = {"copy": name, "error": repr(ex)}
        print(row, flush=True)
        spin_rows.append(row)
    res["spin"] = spin_rows
    del a16, b16, a32

    # 2. overlap: bench sync's GEMM chain with the bf16 layout copied on a side stream
    shapes = layout(1)
    pol, ref = Flat(shapes, torch.bfloat16, dev), Flat(shapes, torch.bfloat16, dev)
    src, dst = [p.data for p in pol.ps], [p.data for p in ref.ps]
    nbytes = sum(t.numel() * t.element_size() for t in src)
    m = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16) / 8192 ** 0.5
    k = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    gemms = 60

    def work():
        for _ in range(gemms):
            torch.mm(m, k)

    arms = {"per-tensor copy_": lambda s: [d.copy_(x) for d, x in zip(dst, src)]}
    try:
        arms["cudaMemcpyBatchAsync (prefer overlap)"] = lambda s, c=batch_copier(dst, src, lib, v.value): c(s)
    except Exception as ex:  # noqa: BLE001
        res["batch_error_overlap"] = repr(ex)

    def with_copy(fn):
        def step():
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                fn(side)
            work()
            torch.cuda.current_stream().wait_stream(side)
        return step

    base = time_reps(work, reps=30)
    rows = [{"impl": "GEMMs alone", "ms": base, "added_pct": 0.0}]
    for name, fn in arms.items():
        try:
            with torch.cuda.stream(side):
                fn(side)
            torch.cuda.synchronize()
            with torch.cuda.stream(side):  # the copy alone, timed on the stream it runs on
                alone = time_reps(lambda fn=fn: fn(side), reps=30)
            ms = time_reps(with_copy(fn), reps=30)
            row = {"impl": f"GEMMs + overlapped {name}", "ms": ms, "added_pct": 100 * (ms - base) / base,
                   "copy_alone_ms": alone, "copy_TBps": 2 * nbytes / alone / 1e9}
        except Exception as ex:  # noqa: BLE001
            row = {"impl": name, "error": repr(ex)}
        print(row, flush=True)
        rows.append(row)
    res["overlap"] = {"rows": rows, "gemms": gemms, "bytes_each_side": nbytes, "tensors": len(src)}
    with open(f"{out_dir}/ce_probe.json", "w") as f:
        json.dump(res, f, indent=2)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    t0 = time.time()
    main(sys.argv[1])
    print(f"ce_probe {time.time() - t0:.0f} s")
