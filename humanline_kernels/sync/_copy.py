"""Grouped multi-tensor copy: one launch per (target device, source device, source dtype, target dtype) group.

On CUDA a same-device, same-dtype group is copied by the copy engines (``copy_engine``, below); a casting group by
the csrc/ kernel (16-byte vector accesses, hundreds of tensors per launch, casts fused) when it is built
(``setup.py``) or can be JIT-built from a source checkout; otherwise ``torch._foreach_copy_``, whose fast path is
also a single multi-tensor kernel per group when all sources share one dtype (which grouping guarantees).
``use_kernel=False`` never uses or builds the extension (the copy engines then copy tensor by tensor).

A group is issued on the stream of its *stream device*: the target's device, or the source's when the target
is on the CPU and the source on CUDA (a CPU-offloaded reference, as verl's and FSDP's ``CPUOffload`` keep it). Such
a device-to-host copy is then ordered on that CUDA device's streams like any other, and it is issued with
``non_blocking=True`` when every target is pinned, so it runs asynchronously (copy and cast).
"""
from __future__ import annotations

import importlib
import os
import warnings

import torch

_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_ext = None
_ext_tried = False


def load_extension(build: bool = True):
    """The compiled extension module, or ``None``. Tries the installed one, then a JIT build from ``csrc/``."""
    global _ext, _ext_tried
    if _ext is not None or _ext_tried:
        return _ext
    _ext_tried = True
    if not torch.cuda.is_available():
        return None
    try:  # the compiled module setup.py builds beside the package's Python files, when it builds one
        _ext = importlib.import_module("humanline_kernels._sync_cuda")
        return _ext
    except ImportError:
        pass
    if not build:
        return None
    csrc = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "csrc"))
    srcs = [os.path.join(csrc, f) for f in ("multi_tensor_copy.cpp", "multi_tensor_copy_kernel.cu")]
    if not all(os.path.exists(s) for s in srcs):
        return None
    try:
        from torch.utils.cpp_extension import load
        _ext = load(name="humanline_sync_cuda", sources=srcs,
                    extra_cuda_cflags=["-O3"], verbose=False)
    except Exception as e:  # no nvcc/ninja, incompatible toolkit: the fallback is correct, only slower
        warnings.warn(f"humanline_kernels: could not JIT-build the sync copy kernel ({type(e).__name__}: {e}); "
                      "using torch._foreach_copy_", RuntimeWarning, stacklevel=3)
        _ext = None
    return _ext


_CUT = 256  # elements: where split() cuts a tensor (keeps 16-byte alignment for 1- to 8-byte dtypes)


def _nbytes(d, s) -> int:
    return d.numel() * (d.element_size() + s.element_size())


class CopyPlan:
    """``dsts[i].copy_(srcs[i])`` for all i, grouped so that each group is one multi-tensor launch.

    ``use_kernel``: the csrc/ extension when available (None), required (True) or never used nor built (False).
    ``copy_engine``: same-device, same-dtype CUDA groups go to the copy engines (the extension's one
    ``cudaMemcpyBatchAsync`` a group, hinted to overlap with compute, or ``copy_`` per tensor without it), which
    take no SMs from the compute beside the copy; False copies them with the kernel too. Casting groups always take
    the kernel (or ``torch._foreach_copy_``)."""

    def __init__(self, dsts, srcs, use_kernel: bool | None = None, copy_engine: bool = True):
        groups: dict = {}
        for d, s in zip(dsts, srcs):
            if d.numel() == 0:
                continue
            key = (d.device, s.device, s.dtype, d.dtype)
            g = groups.get(key)
            if g is None:
                g = groups[key] = ([], [])
            g[0].append(d)
            g[1].append(s)
        self.groups = groups
        self.use_kernel = use_kernel
        self.copy_engine = copy_engine

    def split(self, n: int) -> list[CopyPlan]:
        """``n`` plans that together copy what this one copies, each about ``1/n`` of the bytes (read + written), in
        this plan's order; a contiguous pair is cut into flat views where a share ends (at a multiple of ``_CUT``
        elements, so the kernel's 16-byte vector path still applies), any other pair goes whole. For a sync issued
        in slices through the step (``ReferenceSyncer(slices=n)``); plans may come out empty."""
        pairs = [(d, s) for ds, ss in self.groups.values() for d, s in zip(ds, ss)]
        total = sum(_nbytes(d, s) for d, s in pairs)
        parts: list[tuple[list, list]] = [([], []) for _ in range(n)]

        def share_end(k):  # bytes assigned when part k is full (rounded up)
            return -(-(k + 1) * total // n)
        k, done = 0, 0  # the part being filled, bytes assigned so far
        for d, s in pairs:
            per = d.element_size() + s.element_size()
            flat = d.is_contiguous() and s.is_contiguous()
            a, numel = 0, d.numel()
            while a < numel:
                b = numel
                if k < n - 1 and flat:
                    room = share_end(k) - done  # bytes left in part k's share
                    take = round(room / per / _CUT) * _CUT
                    if take <= 0:  # the share is full to within half a cut: go on to the next part
                        k += 1
                        continue
                    b = min(numel, a + take)
                if a == 0 and b == numel:
                    parts[k][0].append(d)
                    parts[k][1].append(s)
                else:
                    parts[k][0].append(d.view(-1)[a:b])
                    parts[k][1].append(s.view(-1)[a:b])
                done += (b - a) * per
                a = b
                while k < n - 1 and done >= share_end(k):  # a whole pair may fill several shares
                    k += 1
        return [CopyPlan(ds, ss, use_kernel=self.use_kernel, copy_engine=self.copy_engine) for ds, ss in parts]

    @staticmethod
    def stream_device(key):
        """The device whose stream issues a group: the target's, or the CUDA source's for a CPU target."""
        dd, sd = key[0], key[1]
        return sd if dd.type == "cpu" and sd.type == "cuda" else dd

    def devices(self):
        return list(dict.fromkeys(self.stream_device(k) for k in self.groups))

    def run(self, device) -> None:
        """Launch every group whose stream device is ``device`` on that device's current stream."""
        for key, (d, s) in self.groups.items():
            if self.stream_device(key) != device:
                continue
            dd, sd, st, dt = key
            if self.copy_engine and dd == sd and dd.type == "cuda" and st == dt:
                ext = load_extension() if self.use_kernel is not False else None
                if getattr(ext, "multi_tensor_copy_engine", None) and all(
                        t.is_contiguous() for t in d + s):  # an extension built before it has no batched copy
                    with torch.cuda.device(dd):
                        ext.multi_tensor_copy_engine(d, s, torch.cuda.current_stream(dd).cuda_stream)
                else:
                    for a, b in zip(d, s):
                        a.copy_(b, non_blocking=True)
            elif self._kernel_ok(dd, sd, st, dt, d, s):
                with torch.cuda.device(dd):
                    _ext.multi_tensor_copy(d, s, torch.cuda.current_stream(dd).cuda_stream)
            elif dd != sd:  # device to pinned host memory: asynchronous on the current (side) stream of ``sd``
                torch._foreach_copy_(d, s, non_blocking=all(t.is_pinned() for t in d))
            else:
                torch._foreach_copy_(d, s)

    def _kernel_ok(self, dd, sd, st, dt, d, s) -> bool:
        if self.use_kernel is False or dd.type != "cuda" or dd != sd:
            return False
        if st not in _KERNEL_DTYPES or dt not in _KERNEL_DTYPES:
            return False
        ext = load_extension()
        if ext is None:
            if self.use_kernel:
                raise RuntimeError("use_kernel=True but the humanline sync CUDA extension is not available")
            return False
        return all(t.is_contiguous() for t in d) and all(t.is_contiguous() for t in s)
