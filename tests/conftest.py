"""Test configuration.

CPU tensors go through the Triton interpreter, CUDA tensors through the compiled kernels, whatever
``TRITON_INTERPRET`` says (``humanline_kernels.ops._jit``; tests that set the variable to 0 take the eager path).
Without CUDA the variable is set for the whole run (spawned processes inherit it). With CUDA (or
``HK_TESTS_AS_ON_GPU=1``) it stays unset -- Triton would build other libraries' kernels (Inductor's helpers,
Liger) as interpreted ones too -- and the package's default for CPU tensors is switched to the interpreter
instead. GPU-only tests skip without CUDA.
"""
import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
# HK_TESTS_AS_ON_GPU=1: a GPU machine's import state on a CPU one (the GPU tests still skip), to reproduce there
# what the suite does on a GPU machine apart from the CUDA tensors
AS_ON_GPU = HAS_CUDA or os.environ.get("HK_TESTS_AS_ON_GPU") == "1"
if not AS_ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")
else:
    import humanline_kernels.ops as _ops

    _ops.INTERPRET_CPU_DEFAULT = True
    try:  # decorate Inductor's Triton helpers now, compiled, before a test sets TRITON_INTERPRET=1 for a while
        import torch._inductor.runtime.triton_helpers  # noqa: F401
    except Exception:  # pragma: no cover
        pass


# Under xdist (the README's command: -n auto --dist loadfile) a worker takes a file at a time, so the longest files
# go first (the compile gate's two compilers; the nvcc and host-compiler builds of the copy extension; three trainer
# runs per resume case; the fuzz; then the longest of the README's selection) and the run does not end on one of them
# with the other workers idle. Serial runs only change order.
_FIRST = ("tests/ops/test_compile_gate.py", "tests/sync/test_sync_kernel.py", "tests/integrations/trl/test_resume.py",
          "tests/integrations/trl/test_trl_grpo_offpolicy.py", "tests/test_fuzz.py", "tests/test_layouts.py",
          "tests/test_objectives.py", "tests/ops/test_fold.py",
          "tests/test_tensor_parallel.py")
if os.environ.get("PYTEST_XDIST_WORKER"):  # one intra-op thread pool per core, not per worker
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(_FIRST)}
    # stable: the rest keep their order
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_runtest_logreport(report):
    """``HK_FAILURE_LOG=path``: every failure's traceback appended to ``path`` as it happens. pytest prints them
    only in its end summary, which a run killed at its time cap never reaches (run 4: 23 failures named, no
    reason). Written by the process that reports (xdist's controller, not its workers), flushed at once."""
    path = os.environ.get("HK_FAILURE_LOG")
    if not path or not report.failed or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    text = report.longreprtext
    if len(text) > 6000:  # the end of a traceback says why
        text = "...\n" + text[-6000:]
    with open(path, "a") as f:
        f.write(f"=== {report.nodeid} ({report.when})\n{text}\n\n")


@pytest.fixture(autouse=True)
def _gpu_memory_back_to_the_driver(request):
    """After a GPU test, its worker's cached CUDA blocks go back to the driver: the suite's xdist workers share one
    GPU, and each caching allocator would otherwise keep its largest test's memory for the rest of the run (a
    candidate cause of runs 3 and 4's full-run-only failures: 49 on the 80 GiB H100, 23 on the 139 GiB H200)."""
    yield
    if HAS_CUDA and request.node.get_closest_marker("gpu") is not None and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


@pytest.fixture(autouse=True)
def _gpu_tests_take_the_kernel_grad_in_forward_names(request):
    """A GPU test's ``grad_in_forward=True`` runs the Triton kernel (or the cluster kernel, where a test forces it),
    whatever the tuned table chose for the card: the kernels are what these tests check. The table's choice itself,
    the default path included, is tested on CPU (tests/ops/test_tuning.py)."""
    if request.node.get_closest_marker("gpu") is None:
        yield
        return
    from humanline_kernels.ops import tuning
    with tuning.forced_path("triton"):
        yield


@pytest.fixture
def compiled_kernels():
    """Asserts that the test launched compiled Triton kernels and nothing ran interpreted or eager.

    Yields the launch counter (``(path, kernel) -> launches``) so a test can check more."""
    from humanline_kernels.ops import _jit

    _jit.LAUNCHES.clear()
    yield _jit.LAUNCHES
    paths = {path for path, _ in _jit.LAUNCHES}
    assert "compiled" in paths, f"no compiled kernel ran: {dict(_jit.LAUNCHES)}"
    assert paths == {"compiled"}, f"a CUDA test took another path: {dict(_jit.LAUNCHES)}"
