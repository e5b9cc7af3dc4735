"""Every kernel exists twice: compiled (CUDA tensors) and interpreted (CPU tensors under ``TRITON_INTERPRET=1``).

``triton.jit`` decides at decoration time, from ``TRITON_INTERPRET``, whether a kernel is compiled or interpreted,
for the whole process. That sent CUDA tensors into the interpreter on a GPU machine whose test suite had set the
variable for its CPU tests. Here :func:`jit` always builds the compiled kind (``JITFunction``) and
:func:`interpreted` derives the interpreted twin on first use, with its own copy of the kernel's globals in which
every ``@jit`` helper is replaced by its interpreted twin too. :func:`launcher` picks the twin for a tensor and
counts the launch (``LAUNCHES``), so tests can assert which path ran and how many kernels a call launches.

:func:`custom_op` registers a launcher as a ``torch.library`` op: traced by ``torch.compile``, called directly
otherwise.
"""
from __future__ import annotations

import collections
import types

import torch
from triton.runtime.jit import JITFunction

# (path, kernel name) -> launches since the last reset; path is "compiled", "interpreted" or "eager"
LAUNCHES: collections.Counter = collections.Counter()
# device types whose tensors go to the compiled kernels ("meta" is added by the ahead-of-time compile check)
COMPILED_DEVICES = {"cuda"}

_INTERPRETED: dict = {}


def jit(fn=None, *, interpret_as=None, **kwargs):
    """``@triton.jit`` that always builds the compiled kind, whatever ``TRITON_INTERPRET`` says at import.

    ``interpret_as``: a function with the same signature whose body the interpreted twin runs instead, for a device
    function the interpreter cannot run (inline PTX); the compiled kind is the only one the compile gate and a GPU
    see, so its body must compute the same thing up to what the PTX instruction documents (e.g. flushing
    denormals)."""
    def build(f):
        kernel = JITFunction(f, **kwargs)
        kernel.interpret_as = interpret_as  # (read by interpreted())
        kernel.hk_launch = _Launch(kernel)
        return kernel
    return build if fn is None else build(fn)


def interpreted(kernel: JITFunction):
    """The interpreted twin of a ``@jit`` function (cached; its ``@jit`` callees are interpreted as well)."""
    # keyed by id: a JITFunction's hash parses its source, which fails while the interpreter patches triton.language
    hit = _INTERPRETED.get(id(kernel))
    if hit is not None:
        return hit[1]
    from triton.runtime.interpreter import InterpretedFunction

    _patch_interpreter()
    fn = getattr(kernel, "interpret_as", None) or kernel.fn
    scope = dict(fn.__globals__)  # the interpreter writes its own names into the globals it runs with
    copy = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__qualname__, copy.__module__, copy.__doc__ = fn.__qualname__, fn.__module__, fn.__doc__
    twin = InterpretedFunction(copy)
    twin.hk_launch = _Launch(twin)
    _INTERPRETED[id(kernel)] = (kernel, twin)  # the kernel is kept so that its id is not reused
    for name, value in list(scope.items()):
        if isinstance(value, JITFunction):
            scope[name] = interpreted(value)
    return twin


# Fused multiply-adds on, stated at every launch: the kernels' error bounds assume them (the folded
# ``1/T * log2(e)`` scaling is one), and Triton's default for them is announced to change (to off in Triton 3.10).
FP_FUSION = True


class _Launch:
    """``kernel[grid](**kwargs)`` with ``enable_fp_fusion`` stated (the interpreter ignores it). One per kernel, made
    with it: a launch costs the host no Python call more than Triton's own ``kernel[grid]``."""
    __slots__ = ("kernel",)

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        kernel = self.kernel  # (its run is looked up at the launch: the compile gate replaces JITFunction.run)
        return lambda *args, **kwargs: kernel.run(*args, grid=grid, warmup=False, enable_fp_fusion=FP_FUSION,
                                                  **kwargs)


def launcher(kernel: JITFunction, t):
    """The twin of ``kernel`` that runs on ``t``'s device, counted in ``LAUNCHES``; launched with the package's
    explicit options (:data:`FP_FUSION`)."""
    if t.device.type in COMPILED_DEVICES:
        LAUNCHES[("compiled", kernel.fn.__name__)] += 1
        return kernel.hk_launch
    LAUNCHES[("interpreted", kernel.fn.__name__)] += 1
    return interpreted(kernel).hk_launch


def custom_op(name: str, mutates_args: tuple, bumps: tuple = ()):
    """Register the launcher ``fn`` as the ``torch.library`` op ``humanline::<name>`` (it writes into its
    preallocated tensor arguments ``mutates_args`` and returns nothing, so it needs no fake implementation).

    The returned callable, called with keywords, runs the op while ``torch.compile`` traces (the op stays opaque in
    the graph) and ``fn`` itself otherwise: the dispatcher's own work (schema binding, autograd and Dynamo wrappers,
    redispatch) costs more than everything else a call does on the host. ``bumps``: the names of arguments that
    belong to the caller (e.g. logits overwritten by their gradient), whose version counter the direct call bumps
    as the op would, so that a later use of the overwritten tensor fails loudly. ``.op`` is the registered op,
    ``.fn`` the launcher itself.
    """
    def register(fn):
        op = torch.library.custom_op(f"humanline::{name}", mutates_args=mutates_args)(fn)

        def call(**kwargs):
            if torch.compiler.is_compiling():
                return op(**kwargs)
            fn(**kwargs)
            for arg in bumps:
                torch.autograd.graph.increment_version(kwargs[arg])
        call.op, call.fn = op, fn
        call.__name__ = call.__qualname__ = fn.__name__
        call.__doc__ = fn.__doc__
        return call
    return register


def stdlib_functions(kind) -> list:
    """``(module, name, function)`` for every function of Triton's standard library (``tl.max``, ``tl.sum``, ...)
    that is of ``kind``: ``JITFunction`` or the interpreter's ``InterpretedFunction``, which one depending on
    ``TRITON_INTERPRET`` at ``import triton``."""
    import triton.language as tl
    return [(mod, name, value) for mod in {tl, tl.core, tl.standard, tl.math}
            for name, value in list(vars(mod).items()) if isinstance(value, kind)]


_PATCHED = False


def _patch_interpreter():
    """Gaps of Triton's interpreter when it runs next to compiled kernels, closed for the run of each interpreted
    kernel (through the interpreter's own patch scope, restored after the launch), and one cost:

    * Triton's standard library (``tl.max``, ``tl.sum``, ...) is made of ``@jit`` functions, interpreted only when
      ``TRITON_INTERPRET=1`` was set before ``import triton``; on a GPU machine they are compiled-kind objects, which
      an interpreted kernel cannot call. Each is replaced by its interpreted twin.
    * A device-function call inside an interpreted kernel (a ``@jit`` helper, ``tl.max``'s body) patches
      ``triton.language`` for that function and never restores it (``InterpretedFunction.__call__``, triton 3.6
      and 3.9): after one interpreted launch, 60-odd builtins of ``tl.core`` (``where``, ``maximum``, ``load``,
      ...) stayed the interpreter's in a process that also compiles kernels for the GPU. Each launch now puts
      the namespaces it may patch back as they were before it.
    * Triton <= 3.6 turns a scalar kernel argument (a 1-element array) into a Python int with ``int(array)``,
      which NumPy >= 2.4 refuses for arrays of one dimension (``range(0, V, BLOCK)`` then fails). Its tensors get
      an ``__index__`` that takes the one element.
    * Triton patches ``triton.language`` again on every device-function call (``inspect.getmembers`` of five
      namespaces), half the time of an interpreted launch of ours. Within a launch a namespace set is patched
      once; nothing restores it before the launch ends.
    """
    global _PATCHED
    if _PATCHED:
        return
    _PATCHED = True
    import numpy as np
    from triton.runtime import interpreter as interp
    from triton.runtime import jit as _rt_jit

    # Triton 3.9 imports its Gluon modules on the first argument specialisation, and they assert that
    # triton.language holds compiled-kind functions: trigger that import now, before any patching
    _rt_jit.mangle_type(1)

    # built now, outside any patching
    stdlib = [(mod, name, interpreted(value)) for mod, name, value in stdlib_functions(JITFunction)]
    original_lang = interp._patch_lang
    import triton.language as tl
    # the language modules (tl, tl.core) patched so far by the launch running now (None between launches): they
    # alone decide what a patch does (``fn`` only names them, through its globals)
    launch = {"patched": None}

    def patch_lang(fn):
        langs = {v for v in fn.__globals__.values() if v is tl or v is tl.core}
        done = launch["patched"]
        if done and langs and langs <= done:  # a device-function call: its namespaces are patched until the
            return None                       # launch ends (Triton ignores this call's scope)
        scope = original_lang(fn)
        for mod, name, twin in stdlib:
            scope.set_attr(mod, name, twin)
        if done is not None:
            done |= langs
        return scope

    interp._patch_lang = patch_lang
    spaces = [ns for ns in (tl, tl.core, tl.core.tensor, tl.math, tl.standard,
                            getattr(tl.core, "tensor_descriptor_base", None)) if ns is not None]
    original_call = interp.GridExecutor.__call__

    def call(self, *args, **kwargs):
        saved = [dict(vars(ns)) for ns in spaces]
        launch["patched"] = set()
        try:
            return original_call(self, *args, **kwargs)
        finally:
            launch["patched"] = None
            for ns, before in zip(spaces, saved):
                _restore(ns, before)

    interp.GridExecutor.__call__ = call
    try:
        int(np.array([1]))
        return
    except TypeError:
        pass
    original_tensor = interp._patch_lang_tensor

    def patch_tensor(tensor, scope):
        original_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(_one(self.handle.data)))

    interp._patch_lang_tensor = patch_tensor


def _restore(ns, before):
    """Put back the attributes of module or class ``ns`` that a launch replaced. Names it added stay: the
    interpreter adds its own (``interpreter_semantic``) to the globals its cached rewrites of Triton's standard
    library read."""
    for name, value in list(vars(ns).items()):
        if name in before and before[name] is not value:
            setattr(ns, name, before[name])


def _one(a):
    return a.reshape(-1)[0] if a.size == 1 else a
