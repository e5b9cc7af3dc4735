"""The sdist carries what building and testing need (csrc, tests with their helpers, docs, examples, LICENSE), and
the wheel carries the package and its license; both built here from this checkout (``python -m build``)."""
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytest.importorskip("build")


@pytest.fixture(scope="module")
def dists(tmp_path_factory):
    src = tmp_path_factory.mktemp("src")
    out = tmp_path_factory.mktemp("dist")
    # build from a copy: the build writes egg-info and build/ next to the sources
    shutil.copytree(ROOT, src / "p", ignore=shutil.ignore_patterns(".git", "*.egg-info", "build", "dist",
                                                                    "__pycache__", ".whl", ".gl", "out"))
    env = {**os.environ, "HUMANLINE_NO_CUDA_EXT": "1"}
    r = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(src / "p")],
                       capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    (sdist,) = out.glob("*.tar.gz")
    (wheel,) = out.glob("*.whl")
    with tarfile.open(sdist) as t:
        sdist_names = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
        t.extractall(out / "unpacked")
    with zipfile.ZipFile(wheel) as z:
        wheel_names = set(z.namelist())
        meta = next(z.read(n).decode() for n in wheel_names if n.endswith(".dist-info/METADATA"))
    (unpacked,) = (out / "unpacked").iterdir()
    return sdist_names, wheel_names, meta, r.stdout + r.stderr, unpacked


def test_sdist_has_everything_to_build_and_test(dists):
    names = dists[0]
    need = ["LICENSE", "README.md", "CHANGELOG.md", "CITATION.cff", "pyproject.toml", "setup.py", "MANIFEST.in",
            "csrc/multi_tensor_copy.cpp", "csrc/multi_tensor_copy.h", "csrc/multi_tensor_copy_kernel.cu",
            "csrc/multi_tensor_copy_kernel.cuh", "tests/conftest.py", "tools/distributed.py",
            "tools/compile_gate.py", "tools/fuzz_api.py", "tests/test_fused_losses.py", "tests/ops/test_fold.py",
            "docs/kernels.md", "examples/tiny.py",
            "examples/data/toy_preferences.jsonl", "humanline_kernels/ops/_jit.py", "humanline_kernels/ops/tuned.json",
            "bench/bench_gpu.py", "bench/cli.py"]
    missing = [n for n in need if n not in names]
    assert not missing, missing
    # every test helper a test module imports travels with it
    for mod in ("tools/distributed", "tools/verl_cpu", "tools/compile_gate", "tests/test_fused_losses"):
        assert f"{mod}.py" in names
    assert not any(n.startswith(("bench/out/", "bench/results/")) or "__pycache__" in n for n in names)


def test_wheel_has_the_package_and_its_license(dists):
    names, meta = dists[1], dists[2]
    for mod in ("__init__", "reference", "losses", "fused", "fused_linear", "_params", "_eager", "ops/_jit",
                "ops/constants", "ops/linear", "ops/common", "ops/logprobs", "ops/token_terms", "ops/fold", "ops/dpo",
                "ops/kto", "ops/grpo", "ops/sequence", "ops/kernels", "ops/tuning", "sync/_syncer",
                "integrations/trl/__init__", "integrations/trl/grpo", "demo/__init__", "demo/__main__", "demo/cli",
                "demo/task"):
        assert f"humanline_kernels/{mod}.py" in names, mod
    assert "humanline_kernels/ops/tuned.json" in names  # the tuning table the launchers read (package data)
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert not any(n.startswith(("tests/", "bench/")) for n in names)
    assert "License-Expression: Apache-2.0" in meta
    assert "Requires-Dist: torch>=2.11" in meta


def test_build_has_no_license_deprecation_warning(dists):
    assert "project.license` as a TOML table is deprecated" not in dists[3]


def test_setup_py_in_the_sdist_finds_the_cuda_sources(dists, monkeypatch):
    """On a machine with nvcc and a CUDA torch, the unpacked sdist's setup.py declares the extension from sources
    that are there (CUDA faked: the compile itself is checked by tests/sync/test_sync_kernel.py)."""
    import importlib.util

    import setuptools
    import torch
    from torch.utils import cpp_extension
    root = dists[4]
    monkeypatch.setattr(setuptools, "setup", lambda **kw: None)
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", "/usr/local/cuda")
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.delenv("HUMANLINE_NO_CUDA_EXT", raising=False)
    spec = importlib.util.spec_from_file_location("_hk_sdist_setup", root / "setup.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    (ext,), _ = mod._ext_modules()
    assert ext.name == "humanline_kernels._sync_cuda"
    for src in ext.sources:
        assert (root / src).is_file(), src
    assert any(os.path.isfile(os.path.join(root, d, "multi_tensor_copy_kernel.cuh")) for d in ext.include_dirs)
