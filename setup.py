"""setup.py: metadata lives in pyproject.toml; this file only adds the optional CUDA extension from csrc/.

The extension (``humanline_kernels._sync_cuda``, the multi-tensor copy/cast kernel of the reference sync) is built
when torch with CUDA and a CUDA toolchain are importable in the build environment, e.g.
``pip install --no-build-isolation .`` on a GPU machine. Otherwise (isolated build without torch, CPU torch, no
nvcc, or ``HUMANLINE_NO_CUDA_EXT=1``) the package installs as pure Python and the syncer JIT-builds the kernel
from a source checkout on first use or falls back to ``torch._foreach_copy_``.

The build is optional: if it fails (nvcc's CUDA major version differs from torch's, nvcc or the host compiler
fails, ...), a warning is printed and the package installs without the extension instead of the install
failing. pip shows that warning only with ``pip install -v``.
"""
import os
import sys

from setuptools import setup

EXT_NAME = "humanline_kernels._sync_cuda"


def _warn_skipped(names, err) -> None:
    msg = (f"WARNING: humanline_kernels: could not build the optional CUDA extension(s) {', '.join(names)} "
           f"({type(err).__name__}: {err}). Installing without it: the reference syncer JIT-builds the kernel "
           "from a source checkout on first use or falls back to torch._foreach_copy_. Set HUMANLINE_NO_CUDA_EXT=1 "
           "to skip the build.")
    print(msg, file=sys.stderr, flush=True)


def optional_build_ext(base):
    """A subclass of torch's ``BuildExtension`` (``base``) whose build failures skip the extension with a warning.

    Both places where torch's build can fail are covered: ``build_extensions`` (pre-checks for all extensions:
    nvcc's CUDA version against torch's raises RuntimeError) and ``build_extension`` (the compile: RuntimeError
    from ninja, CalledProcessError, distutils CompileError/CCompilerError, OSError for a missing compiler).
    Skipped extensions are marked ``optional`` (setuptools then does not copy their missing file in place) and
    dropped from the command's outputs.
    """
    class OptionalBuildExtension(base):
        def run(self):
            self._skipped = set()
            for ext in self.extensions:
                ext.optional = True
            super().run()
            self.extensions = [e for e in self.extensions if e.name not in self._skipped]

        def _skip(self, exts, err):
            names = [e.name for e in exts if e.name not in self._skipped]
            self._skipped.update(names)
            if names:
                _warn_skipped(names, err)

        def build_extensions(self):
            try:
                super().build_extensions()
            except Exception as e:  # any failure here only costs speed: the pure-Python fallback is correct
                self._skip(self.extensions, e)

        def build_extension(self, ext):
            try:
                super().build_extension(ext)
            except Exception as e:
                self._skip([ext], e)

    return OptionalBuildExtension


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
        name=EXT_NAME,
        # the binding (host compiler, torch headers) and the kernels (nvcc, no torch headers): csrc/multi_tensor_copy.h
        sources=[os.path.join("csrc", "multi_tensor_copy.cpp"), os.path.join("csrc", "multi_tensor_copy_kernel.cu")],
        include_dirs=[os.path.join(here, "csrc")],
        extra_compile_args={"cxx": ["-O3"], "nvcc": ["-O3"]},  # torch adds the C++ standard its headers need
    )
    ext.optional = True
    return [ext], {"build_ext": optional_build_ext(BuildExtension)}


ext_modules, cmdclass = _ext_modules()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
