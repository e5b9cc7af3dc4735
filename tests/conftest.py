"""Test configuration: Triton kernels run in the interpreter on CPU; GPU-only tests skip without CUDA."""
import os

# Must be set before triton decorates any kernel (at import of humanline_kernels.ops.*).
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

try:  # import triton now, in interpreter mode: a first import under a test's TRITON_INTERPRET=0 would stick
    import triton  # noqa: E402,F401
except ImportError:  # pragma: no cover
    pass


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
