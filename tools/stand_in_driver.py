"""A Triton driver that compiles for a GPU without one: the compile gate's and bench's (its host proxy and
``bench.compare_compiled``) active driver while they specialise and compile launches on a CPU machine."""


class _Utils:
    """The driver utilities a compiled kernel asks for before its first launch: an H100's limits, a dummy
    module and function handle."""

    def get_device_properties(self, device):
        return {"max_shared_mem": 232448, "multiprocessor_count": 132, "max_num_regs": 65536, "warpSize": 32}

    def load_binary(self, name, kernel, shared, device):
        return 1, 1, 32, 0, 1024  # module, function, registers, spills, max threads a block

    def unload_module(self, module):
        pass


class StandInDriver:
    """A Triton driver for ``sm_<arch>`` on device 0, stream 0, whose kernel launcher only counts (``launched``):
    enough for ``JITFunction.run`` to specialise, compile and "launch" without a GPU (the compile gate's,
    tools/compile_gate.py, and bench's host proxy and compiled-code comparison)."""

    def __init__(self, arch=90):
        from triton.backends.compiler import GPUTarget
        self.target, self.utils, self.launched = GPUTarget("cuda", arch, 32), _Utils(), 0

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def launcher_cls(self, src, metadata):
        def launch(*args):
            self.launched += 1
        return launch
