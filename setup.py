"""setup.py: metadata lives in pyproject.toml; this file only adds the optional CUDA extension from csrc/.

The extension (``humanline_kernels._sync_cuda``, the multi-tensor copy/cast kernel of the reference sync) is built
when torch with CUDA and a CUDA toolchain are importable in the build environment, e.g.
``pip install --no-build-isolation .`` on a GPU machine. Otherwise (isolated build without torch, CPU torch, no
nvcc, or ``HUMANLINE_NO_CUDA_EXT=1``) the package installs as pure Python and the syncer JIT-builds the kernel
from a source checkout on first use or falls back to ``torch._foreach_copy_``.
"""
import os

from setuptools import setup


def _ext_modules():
    if os.environ.get("HUMANLINE_NO_CUDA_EXT", "0") == "1":
        return [], {}
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension
    except Exception:
        return [], {}
    if CUDA_HOME is None or torch.version.cuda is None:
        return [], {}
    here = os.path.dirname(os.path.abspath(__file__))
    ext = CUDAExtension(
        name="humanline_kernels._sync_cuda",
        sources=[os.path.join("csrc", "multi_tensor_copy.cu")],
        include_dirs=[os.path.join(here, "csrc")],
        extra_compile_args={"cxx": ["-O3"], "nvcc": ["-O3", "-std=c++17"]},
    )
    return [ext], {"build_ext": BuildExtension}


ext_modules, cmdclass = _ext_modules()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
