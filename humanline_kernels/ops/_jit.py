"""Every kernel exists twice: compiled (CUDA tensors) and interpreted (CPU tensors under ``TRITON_INTERPRET=1``).

``triton.jit`` decides at decoration time, from ``TRITON_INTERPRET``, whether a kernel is compiled or interpreted,
for the whole process. That sent CUDA tensors into the interpreter on a GPU machine whose test suite had set the
variable for its CPU tests. Here :func:`jit` always builds the compiled kind (``JITFunction``) and
:func:`interpreted` derives the interpreted twin on first use, with its own copy of the kernel's globals in which
every ``@jit`` helper is replaced by its interpreted twin too. :func:`launcher` picks the twin for a tensor and
counts the launch (``LAUNCHES``), so tests can assert which path ran and how many kernels a call launches.
"""
from __future__ import annotations

import collections
import types

from triton.runtime.jit import JITFunction

# (path, kernel name) -> launches since the last reset; path is "compiled", "interpreted" or "eager"
LAUNCHES: collections.Counter = collections.Counter()
# device types whose tensors go to the compiled kernels ("meta" is added by the ahead-of-time compile check)
COMPILED_DEVICES = {"cuda"}

_INTERPRETED: dict = {}


def jit(fn=None, **kwargs):
    """``@triton.jit`` that always builds the compiled kind, whatever ``TRITON_INTERPRET`` says at import."""
    if fn is None:
        return lambda f: JITFunction(f, **kwargs)
    return JITFunction(fn, **kwargs)


def interpreted(kernel: JITFunction):
    """The interpreted twin of a ``@jit`` function (cached; its ``@jit`` callees are interpreted as well)."""
    twin = _INTERPRETED.get(kernel)
    if twin is not None:
        return twin
    from triton.runtime.interpreter import InterpretedFunction

    _patch_interpreter_index()
    fn = kernel.fn
    scope = dict(fn.__globals__)  # the interpreter writes its own names into the globals it runs with
    copy = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__qualname__, copy.__module__, copy.__doc__ = fn.__qualname__, fn.__module__, fn.__doc__
    twin = _INTERPRETED[kernel] = InterpretedFunction(copy)
    for name, value in list(scope.items()):
        if isinstance(value, JITFunction):
            scope[name] = interpreted(value)
    return twin


def launcher(kernel: JITFunction, t):
    """The twin of ``kernel`` that runs on ``t``'s device, counted in ``LAUNCHES``."""
    if t.device.type in COMPILED_DEVICES:
        LAUNCHES[("compiled", kernel.fn.__name__)] += 1
        return kernel
    LAUNCHES[("interpreted", kernel.fn.__name__)] += 1
    return interpreted(kernel)


def count_eager(name: str) -> None:
    LAUNCHES[("eager", name)] += 1


_PATCHED = False


def _patch_interpreter_index():
    """Triton <= 3.6's interpreter turns a scalar kernel argument (a 1-element array) into a Python int with
    ``int(array)``, which NumPy >= 2.4 refuses for arrays of one dimension (``range(0, V, BLOCK)`` then fails).
    Give its tensors an ``__index__`` that takes the one element; only when this NumPy refuses."""
    global _PATCHED
    if _PATCHED:
        return
    _PATCHED = True
    import numpy as np
    try:
        int(np.array([1]))
        return
    except TypeError:
        pass
    from triton.runtime import interpreter as interp

    original = interp._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(_one(self.handle.data)))

    interp._patch_lang_tensor = patched


def _one(a):
    return a.reshape(-1)[0] if a.size == 1 else a
