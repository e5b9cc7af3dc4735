"""Compile gate of the CUDA cluster kernel (ops/gif_cluster.cu), without a GPU: every configuration the dispatch
can choose (each dtype, CTAs a cluster, threads a CTA) builds for sm_90a with no spills, no stack frame and no local
memory, with NVRTC as a user's first call builds it (the ``nvidia-cuda-nvrtc`` wheel a CUDA build of torch
installs: CI's torch 2.11 stage) and with nvcc where one is on the path; the layout of ``Params`` is checked by the
compile (static_asserts against the ctypes mirror). Skips a compiler it cannot find.
"""
import re
import shutil
import subprocess

import pytest

from humanline_kernels.ops import _nvrtc, cluster

CONFIGS = [(dt, c, t) for dt in cluster.DTYPES.values() for c in cluster.CTAS for t in cluster.THREADS]
ENTRY = re.compile(r"Compiling entry function '(\w+)' for '(sm_\w+)'")
FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
USED = re.compile(r"Used (\d+) registers(?:, used \d+ barriers)?(?:, (\d+) bytes smem)?")


def _ptxas(log):
    """``{kernel: (registers, static smem, stack, spill stores, spill loads)}`` from a ``ptxas -v`` log."""
    out, name = {}, None
    frame = None
    for line in log.splitlines():
        if m := ENTRY.search(line):
            name, frame = m.group(1), None
            assert m.group(2) == "sm_90a", line
        elif (m := FRAME.search(line)) and name:
            frame = tuple(int(g) for g in m.groups())
        elif (m := USED.search(line)) and name:
            out[name] = (int(m.group(1)), int(m.group(2) or 0), *(frame or (0, 0, 0)))
    return out


def _nvrtc_log():
    try:
        lib = _nvrtc.load_nvrtc()
    except _nvrtc.NvrtcNotFound as e:
        pytest.skip(f"no NVRTC here: {str(e)[:200]}")
    return _nvrtc.compile_cubin(cluster.source(*CONFIGS), "gif_cluster", cluster.ARCH, ["-Xptxas=-v"], lib=lib)[1]


def _nvcc_log(tmp_path):
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("no nvcc on the path")
    src = tmp_path / "gif_cluster.cu"
    src.write_text(cluster.source(*CONFIGS))
    p = subprocess.run([nvcc, "-cubin", f"-arch={cluster.ARCH}", "-O3", "-std=c++17", "-Xptxas", "-v", str(src),
                        "-o", str(tmp_path / "gif_cluster.cubin")], capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout + p.stderr


@pytest.mark.parametrize("compiler", ["nvrtc", "nvcc"])
def test_every_configuration_compiles_without_spills(compiler, tmp_path):
    log = _nvrtc_log() if compiler == "nvrtc" else _nvcc_log(tmp_path)
    res = _ptxas(log)
    names = {cluster.kernel_name(*c) for c in CONFIGS}
    assert set(res) == names, sorted(names ^ set(res))
    for name, (regs, smem, stack, st, ld) in sorted(res.items()):
        threads = int(name.rsplit("_", 1)[1])
        assert stack == st == ld == 0, (name, res[name])
        assert regs * threads <= 65536 and smem + 16 <= cluster.STATIC_SMEM, (name, res[name])
    for name, r in sorted(res.items()):  # (shown with -s: bench/NOTES.md's table)
        print(compiler, name, "registers", r[0], "static smem", r[1])


def test_ptxas_log_parser():
    log = ("ptxas info    : Compiling entry function 'k_0_4_256' for 'sm_90a'\nptxas info    : Function properties "
           "for k_0_4_256\n    8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads\nptxas info    : Used 40 "
           "registers, used 1 barriers, 256 bytes smem\n")
    assert _ptxas(log) == {"k_0_4_256": (40, 256, 8, 4, 4)}
