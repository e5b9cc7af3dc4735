"""CUDA C++ compiled at first use with NVRTC and launched through the CUDA driver API, both through ctypes.

What a user has after ``pip install`` on a GPU machine, without a CUDA toolkit: a CUDA build of torch brings NVRTC
(the ``nvidia-cuda-nvrtc`` wheel for CUDA 13, ``nvidia-cuda-nvrtc-cu12`` for CUDA 12, as a dependency of torch or
of its ``cuda-toolkit[nvrtc]``) and the GPU brings the driver (``libcuda.so.1``). :func:`compile_cubin` turns a
source into a cubin for the card's architecture (a real ``sm_XX`` target, so the driver loads machine code and
JIT-compiles nothing); :class:`Module` loads it into the device's primary context, the one torch uses, and launches
its kernels on torch's current stream. Nothing here imports Triton; compiling needs no GPU (the compile test runs
it on CPU machines).
"""
from __future__ import annotations

import ctypes
import glob
import importlib.util
import os
import threading

import torch


class NvrtcNotFound(RuntimeError):
    """NVRTC could not be loaded (the message names the places searched and the package that provides it)."""


_NVRTC = {}  # path -> (libnvrtc, libnvrtc-builtins) kept loaded
_LOCK = threading.Lock()


def _major(cuda_version):
    return None if not cuda_version else int(str(cuda_version).split(".")[0])


def candidates(major=None) -> list:
    """Paths of ``libnvrtc.so.*`` in the ``nvidia`` wheels of this environment, for CUDA ``major`` (None: any,
    the newest first): ``nvidia/cu13/lib`` (CUDA 13's wheels) and ``nvidia/cuda_nvrtc/lib`` (CUDA 12's)."""
    spec = importlib.util.find_spec("nvidia")
    roots = list(spec.submodule_search_locations or []) if spec is not None else []
    found = []
    for root in roots:
        found += glob.glob(os.path.join(root, "*", "lib", "libnvrtc.so.*[0-9]"))
    found = [p for p in found if ".alt." not in os.path.basename(p) and "builtins" not in os.path.basename(p)]
    if major is not None:
        found = [p for p in found if os.path.basename(p).split(".so.")[1].split(".")[0] == str(major)]
    return sorted(set(found), key=lambda p: os.path.basename(p).split(".so.")[1], reverse=True)


def not_found_message(major, searched) -> str:
    package = {12: "nvidia-cuda-nvrtc-cu12", None: "nvidia-cuda-nvrtc"}.get(major, "nvidia-cuda-nvrtc")
    return (f"NVRTC (libnvrtc.so.{major if major is not None else '*'}) was not found; searched: "
            f"{', '.join(searched) or 'nothing'}. humanline_kernels compiles its CUDA kernels with it at first use. A "
            f"CUDA build of torch installs it (torch.version.cuda = {torch.version.cuda}); install it with "
            f"`pip install {package}` for that CUDA version, or put the toolkit's libnvrtc on the library path.")


def load_nvrtc(major=None) -> ctypes.CDLL:
    """libnvrtc for CUDA ``major`` (default: torch's CUDA major), the first of: the ``nvidia`` wheels
    (:func:`candidates`), the library search path (``libnvrtc.so.MAJOR``). Its builtins library (which libnvrtc
    opens by name at the first compile) is loaded first from the same folder. Raises :class:`NvrtcNotFound` naming
    what was searched."""
    if major is None:
        major = _major(torch.version.cuda)
    searched = []
    for cand in candidates(major) + [f"libnvrtc.so.{major}" if major else "libnvrtc.so"]:
        searched.append(cand)
        with _LOCK:
            if cand in _NVRTC:
                return _NVRTC[cand][0]
            try:
                folder = os.path.dirname(cand)
                builtins = sorted(glob.glob(os.path.join(folder, "libnvrtc-builtins.so.*"))) if folder else []
                keep = [ctypes.CDLL(b, mode=ctypes.RTLD_GLOBAL) for b in builtins if ".alt." not in b][-1:]
                lib = ctypes.CDLL(cand)
            except OSError:
                continue
            _NVRTC[cand] = (lib, keep)
            return lib
    raise NvrtcNotFound(not_found_message(major, searched))


def _check_nvrtc(lib, res, what):
    if res:
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        raise RuntimeError(f"NVRTC {what} failed: {lib.nvrtcGetErrorString(res).decode()}")


def compile_cubin(source: str, name: str, arch: str, options=(), lib=None) -> tuple[bytes, str]:
    """``(cubin, log)`` of ``source`` for ``arch`` (e.g. ``"sm_90a"``). ``options``: more NVRTC options (e.g.
    ``-Xptxas=-v``, whose report lands in the log). Raises RuntimeError with the log on a compile error."""
    lib = lib or load_nvrtc()
    prog = ctypes.c_void_p()
    _check_nvrtc(lib, lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), f"{name}.cu".encode(), 0, None,
                                             None), "nvrtcCreateProgram")
    try:
        opts = [f"--gpu-architecture={arch}", "-std=c++17", *options]
        res = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts]))
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        buf = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, buf)
        log = buf.value.decode(errors="replace")
        if res:
            raise RuntimeError(f"NVRTC could not compile {name} for {arch}:\n{log}")
        _check_nvrtc(lib, lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "nvrtcGetCUBINSize")
        cubin = ctypes.create_string_buffer(size.value)
        _check_nvrtc(lib, lib.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
        return cubin.raw, log
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


# ------------------------------------------------------------------------------------------- the driver (GPU only)
_CUDA = []
MAX_DYNAMIC_SHARED_SIZE_BYTES = 8  # CUfunction_attribute
MAX_SHARED_MEMORY_PER_BLOCK_OPTIN = 97  # CUdevice_attribute


def driver() -> ctypes.CDLL:
    """``libcuda.so.1`` (the driver torch's CUDA runtime uses), its calls typed, ``cuInit`` done."""
    if not _CUDA:
        cu = ctypes.CDLL("libcuda.so.1")
        cu.cuLaunchKernel.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
        check(cu, cu.cuInit(0))
        _CUDA.append(cu)
    return _CUDA[0]


def check(cu, res):
    if res:
        name = ctypes.c_char_p()
        cu.cuGetErrorName(res, ctypes.byref(name))
        raise RuntimeError(f"CUDA driver error {res} ({name.value.decode() if name.value else '?'})")


_PRIMARY = {}  # device index -> its primary context (retained once, never released: torch holds it too)


def make_current(index: int) -> None:
    """Device ``index``'s primary context (torch's) current on this thread: a module loads into, and a launch runs
    in, the current context, which a thread that has not used the device through the runtime yet may not have."""
    cu = driver()
    ctx = _PRIMARY.get(index)
    if ctx is None:
        dev = ctypes.c_int()
        check(cu, cu.cuDeviceGet(ctypes.byref(dev), index))
        ctx = ctypes.c_void_p()
        check(cu, cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev))
        _PRIMARY[index] = ctx
    cur = ctypes.c_void_p()
    check(cu, cu.cuCtxGetCurrent(ctypes.byref(cur)))
    if cur.value != ctx.value:
        check(cu, cu.cuCtxSetCurrent(ctx))


class Function:
    """A kernel of a loaded module, its dynamic shared memory opted into up to the device's per-block limit."""

    def __init__(self, module, name: str, index: int):
        cu = driver()
        self.fn = ctypes.c_void_p()
        check(cu, cu.cuModuleGetFunction(ctypes.byref(self.fn), module, name.encode()))
        limit = ctypes.c_int()
        dev = ctypes.c_int()
        check(cu, cu.cuDeviceGet(ctypes.byref(dev), index))
        check(cu, cu.cuDeviceGetAttribute(ctypes.byref(limit), MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, dev))
        static = ctypes.c_int()
        check(cu, cu.cuFuncGetAttribute(ctypes.byref(static), 1, self.fn))  # CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES
        self.max_dynamic = limit.value - static.value
        check(cu, cu.cuFuncSetAttribute(self.fn, MAX_DYNAMIC_SHARED_SIZE_BYTES, ctypes.c_int(self.max_dynamic)))

    def launch(self, grid: int, block: int, smem: int, params: ctypes.Structure, stream: int) -> None:
        """One launch of ``grid`` blocks of ``block`` threads with the struct ``params`` as the kernel's one
        argument (copied at the launch, so a CUDA graph captures it)."""
        args = (ctypes.c_void_p * 1)(ctypes.addressof(params))
        cu = driver()
        check(cu, cu.cuLaunchKernel(self.fn, grid, 1, 1, block, 1, 1, smem, stream, args, None))


def load(cubin: bytes, names, index: int) -> dict:
    """The cubin loaded into device ``index``'s primary context: ``{name: Function}``."""
    make_current(index)
    cu = driver()
    module = ctypes.c_void_p()
    check(cu, cu.cuModuleLoadData(ctypes.byref(module), ctypes.c_char_p(cubin)))
    return {n: Function(module, n, index) for n in names}
