"""setup.py: the CUDA extension build is optional. A failing build (nvcc/torch CUDA mismatch, compiler error)
must print a warning and install the pure-Python package, not stop the install."""
import importlib.util
import os
import subprocess
import sys

import pytest
import setuptools
import torch
from setuptools import Distribution, Extension

cpp_extension = pytest.importorskip("torch.utils.cpp_extension")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def setup_py(monkeypatch):
    """setup.py as a module, without running setup()."""
    monkeypatch.setattr(setuptools, "setup", lambda **kw: None)
    spec = importlib.util.spec_from_file_location("_hk_setup", os.path.join(ROOT, "setup.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _build(cmdclass, ext, tmp_path):
    dist = Distribution({"name": "hk_setup_test", "ext_modules": [ext], "cmdclass": {"build_ext": cmdclass}})
    cmd = dist.get_command_obj("build_ext")
    cmd.build_lib, cmd.build_temp = str(tmp_path / "lib"), str(tmp_path / "tmp")
    cmd.ensure_finalized()
    cmd.run()
    return cmd


def test_compile_error_skips_extension_with_warning(setup_py, tmp_path, capfd):
    src = tmp_path / "broken.cpp"
    src.write_text("this is not C++;\n")
    cls = setup_py.optional_build_ext(cpp_extension.BuildExtension)
    assert issubclass(cls, cpp_extension.BuildExtension)
    cmd = _build(cls, Extension("hk_broken_ext", [str(src)], language="c++"), tmp_path)  # must not raise
    err = capfd.readouterr().err
    assert "could not build the optional CUDA extension(s) hk_broken_ext" in err and "_foreach_copy_" in err
    assert cmd.extensions == [] and cmd.get_outputs() == []
    # the unwrapped torch class raises: the test exercises a real failure
    with pytest.raises(RuntimeError, match="Error compiling objects"):
        _build(cpp_extension.BuildExtension, Extension("hk_broken_ext2", [str(src)], language="c++"),
               tmp_path / "plain")


def test_cuda_version_check_failure_skips_extension(setup_py, tmp_path, capfd, monkeypatch):
    """torch checks nvcc's CUDA major version against its own in build_extensions, before any build_extension."""
    def mismatch(self):
        raise RuntimeError("The detected CUDA version (13.0) mismatches the version that was used to compile "
                           "PyTorch (12.8).")
    monkeypatch.setattr(cpp_extension.BuildExtension, "build_extensions", mismatch)
    cls = setup_py.optional_build_ext(cpp_extension.BuildExtension)
    cmd = _build(cls, Extension("hk_cuda_ext", [str(tmp_path / "x.cu")]), tmp_path)
    err = capfd.readouterr().err
    assert "hk_cuda_ext" in err and "RuntimeError" in err and "mismatches" in err
    assert cmd.extensions == []


def test_ext_modules_use_optional_build_and_env_skips(setup_py, monkeypatch):
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", "/usr/local/cuda")
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.delenv("HUMANLINE_NO_CUDA_EXT", raising=False)
    exts, cmdclass = setup_py._ext_modules()
    assert [e.name for e in exts] == ["humanline_kernels._sync_cuda"] and exts[0].optional
    assert issubclass(cmdclass["build_ext"], cpp_extension.BuildExtension)
    assert cmdclass["build_ext"].build_extension is not cpp_extension.BuildExtension.build_extension
    monkeypatch.setenv("HUMANLINE_NO_CUDA_EXT", "1")
    assert setup_py._ext_modules() == ([], {})


def test_setup_py_version_runs():
    out = subprocess.run([sys.executable, "setup.py", "--version"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1][0].isdigit()
