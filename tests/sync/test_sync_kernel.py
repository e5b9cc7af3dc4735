"""The csrc/ copy kernel: compiles with nvcc (when present); on CUDA, bit-exact vs torch's copy_ for every dtype
pair, odd sizes, misaligned views and more tensors than one launch holds; the grouped fallback on CPU."""
import os
import re
import shutil
import subprocess
import sys
import sysconfig

import pytest
import torch

from humanline_kernels.sync._copy import CopyPlan, load_extension

pytestmark = pytest.mark.slow  # the copy extension's C++ and CUDA builds

CSRC = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "csrc")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
nvcc = shutil.which("nvcc")


def _torch_cxx_std():
    """The C++ standard torch's extension builder passes to nvcc (C++17 up to torch 2.11, C++20 in 2.13)."""
    from torch.utils import cpp_extension
    with open(cpp_extension.__file__) as f:
        m = re.search(r"cpp_flag_prefix \+ 'c\+\+(\d+)'", f.read())
    return f"c++{m.group(1) if m else 17}"


def _no_spills(out):
    frames = re.findall(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", out)
    assert frames, out[-2000:]
    assert all(f == ("0", "0", "0") for f in frames), [f for f in frames if f != ("0", "0", "0")]
    return len(frames)


@pytest.fixture(scope="module")
def kernel_build(tmp_path_factory):
    """``build(arch) -> (object file, ptxas report)``: the extension's torch-free translation unit as torch's extension
    builder compiles it (its C++ standard and nvcc flags) for sm_<arch>, once per architecture."""
    from torch.utils.cpp_extension import COMMON_NVCC_FLAGS
    builds = {}

    def build(arch):
        if arch not in builds:
            obj = tmp_path_factory.mktemp(f"sm{arch}") / "k.o"
            cmd = [nvcc, "-c", os.path.join(CSRC, "multi_tensor_copy_kernel.cu"), "-o", str(obj),
                   f"-std={_torch_cxx_std()}", "-O3", "-gencode", f"arch=compute_{arch},code=sm_{arch}",
                   "--compiler-options", "-fPIC", "--resource-usage", *COMMON_NVCC_FLAGS]
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            assert r.returncode == 0, r.stderr[-4000:]
            builds[arch] = obj, r.stdout + r.stderr
        return builds[arch]
    return build


@pytest.mark.skipif(nvcc is None, reason="nvcc not on PATH")
@pytest.mark.parametrize("arch", [90, 80])
def test_kernel_compiles_with_nvcc_without_spills(kernel_build, arch):
    # its dispatch instantiates the kernel for all 9 (source, target) dtype pairs
    obj, report = kernel_build(arch)
    assert obj.stat().st_size > 0
    assert _no_spills(report) == 9  # one report per kernel instantiation


def _compile_binding(obj):
    """The binding (host C++, torch headers) as torch's extension builder compiles it (its C++ standard, ABI and
    defines), with warnings on: none from our file."""
    from torch.utils.cpp_extension import include_paths
    cxx = os.environ.get("CXX", "c++")
    cmd = [cxx, "-c", os.path.join(CSRC, "multi_tensor_copy.cpp"), "-o", str(obj), f"-std={_torch_cxx_std()}",
           "-O3", "-fPIC", "-Wall", "-Wextra", "-DTORCH_EXTENSION_NAME=hk_test", "-DTORCH_API_INCLUDE_EXTENSION_H",
           f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
           "-I", sysconfig.get_paths()["include"]] + [f"-I{p}" for p in include_paths()]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    ours = [ln for ln in out.splitlines() if "warning" in ln and "multi_tensor_copy" in ln]
    assert not ours, ours


def _hk_symbols(obj, defined):
    """The hk_sync:: functions an object file defines (or, ``defined=False``, needs from elsewhere)."""
    out = subprocess.run(["nm", "-C", "--defined-only" if defined else "--undefined-only", str(obj)],
                         capture_output=True, text=True, check=True).stdout
    # "<address> T name" for a defined symbol, "U name" for an undefined one
    return {re.match(r"\s*(?:[0-9a-f]+\s+)?\w\s+(.*)$", ln).group(1) for ln in out.splitlines() if "hk_sync::" in ln}


@pytest.fixture(scope="module")
def binding(tmp_path_factory):
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no host C++ compiler")
    obj = tmp_path_factory.mktemp("binding") / "b.o"
    _compile_binding(obj)
    return obj


def test_binding_compiles_with_torchs_flags(binding):
    """The torch binding compiles with the host compiler and torch's flags, without CUDA headers or nvcc (about 40 s
    on 2 cores: torch's headers; it was 200 s through nvcc when binding and kernels were one file)."""
    assert binding.stat().st_size > 0


@pytest.mark.skipif(nvcc is None or shutil.which("nm") is None, reason="nvcc or nm not on PATH")
def test_extension_halves_link(binding, kernel_build):
    """The kernel half (sm_90, torch's nvcc flags) defines every hk_sync:: function the binding calls, with the
    same signatures (C++ mangling carries them)."""
    needed = _hk_symbols(binding, defined=False)
    assert needed >= {"hk_sync::max_tensors_per_launch()", "hk_sync::current_device(int*)"}, needed
    assert needed <= _hk_symbols(kernel_build(90)[0], defined=True), needed


def _make(dt_src, dt_dst, device, n=300):
    g = torch.Generator().manual_seed(0)
    sizes = [1, 3, 7, 8, 4095, 4096, 4097, 1 << 14, 123457]
    sizes += [int(x) for x in torch.randint(1, 3000, (n,), generator=g)]
    srcs = [torch.randn(k, generator=g).mul_(1e3).to(dt_src).to(device) for k in sizes]
    dsts = [torch.zeros(k, dtype=dt_dst, device=device) for k in sizes]
    # misaligned views (offset by one element): the scalar path
    base_s = torch.randn(1001, generator=g).to(dt_src).to(device)
    base_d = torch.zeros(1001, dtype=dt_dst, device=device)
    srcs.append(base_s[1:])
    dsts.append(base_d[1:])
    return dsts, srcs


@pytest.mark.parametrize("dt_src", DTYPES)
@pytest.mark.parametrize("dt_dst", DTYPES)
def test_grouped_copy_cpu_matches_copy(dt_src, dt_dst):
    dsts, srcs = _make(dt_src, dt_dst, "cpu", n=20)
    mixed_d = dsts + [torch.zeros(5, dtype=torch.int64)]
    mixed_s = srcs + [torch.arange(5)]
    plan = CopyPlan(mixed_d, mixed_s)
    assert len(plan.groups) == 2
    plan.run(torch.device("cpu"))
    for d, s in zip(mixed_d, mixed_s):
        assert torch.equal(d, s.to(d.dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("dt_src", DTYPES)
@pytest.mark.parametrize("dt_dst", DTYPES)
def test_kernel_bit_exact_on_cuda(dt_src, dt_dst):
    ext = load_extension()
    if ext is None:
        pytest.skip("extension neither built nor JIT-buildable here")
    dsts, srcs = _make(dt_src, dt_dst, "cuda", n=400)  # more tensors than one launch's table holds
    assert len(dsts) > ext.max_tensors_per_launch
    ext.multi_tensor_copy(dsts, srcs, torch.cuda.current_stream().cuda_stream)
    for d, s in zip(dsts, srcs):
        assert torch.equal(d, s.to(d.dtype))  # torch's copy_ rounds to nearest even too


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("stream", ["side", "default"])
def test_copy_engine_bit_exact_on_cuda(dtype, stream):
    """multi_tensor_copy_engine: one cudaMemcpyBatchAsync on a side stream; on the legacy default stream, which a
    batch refuses, cudaMemcpyAsync per copy. Bit-exact either way; a cast is refused."""
    ext = load_extension()
    if ext is None:
        pytest.skip("extension neither built nor JIT-buildable here")
    dsts, srcs = _make(dtype, dtype, "cuda", n=400)
    s = torch.cuda.Stream() if stream == "side" else torch.cuda.default_stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        ext.multi_tensor_copy_engine(dsts, srcs, s.cuda_stream)
    torch.cuda.current_stream().wait_stream(s)
    for d, x in zip(dsts, srcs):
        assert torch.equal(d, x)
    other = next(t for t in DTYPES if t != dtype)
    with pytest.raises(RuntimeError, match="copies without a cast only"):
        ext.multi_tensor_copy_engine([dsts[0].to(other)], [srcs[0]], s.cuda_stream)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
