"""Test configuration.

CPU tensors go through the Triton interpreter (``TRITON_INTERPRET=1``, read by the dispatch at call time); CUDA
tensors always go through the compiled kernels, whatever that variable says (``humanline_kernels.ops._jit``).
Without CUDA the variable is set for the whole run (spawned processes inherit it). With CUDA it is set for each
test not marked ``gpu`` and removed for the ``gpu`` tests, so that third-party Triton kernels (Liger, Inductor)
decorated during a GPU test are compiled too. GPU-only tests skip without CUDA.
"""
import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _interpret_env(request, monkeypatch):
    if HAS_CUDA:
        if "gpu" in request.keywords:
            monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        else:
            monkeypatch.setenv("TRITON_INTERPRET", "1")
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
