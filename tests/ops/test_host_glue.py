"""Host glue budget: the Python work one forward + backward does around its kernels, counted, not timed.

``bench.host_proxy`` runs each entry point's compiled-kernel branch on tiny CPU tensors with every Triton launch a
no-op; here ``sys.setprofile`` counts the Python and C function calls of one steady-state call. The count is
deterministic (the same on torch 2.11 and 2.13 within a few calls) and tracks the proxy's time (about 0.5 us a
call on the CI machine), so a change that adds host work fails here instead of hiding in a benchmark nobody
reran. Ceilings are today's counts plus about 10 %; ``python -m bench host --proxy`` gives the times and the
ratios to the floor (docs/kernels.md).
"""
import gc
import sys

import pytest
import torch

pytest.importorskip("triton")

from bench import host_proxy  # noqa: E402

# counts on torch 2.13 at the time of writing (torch 2.11: 3 fewer each; issue 53's sweep configuration added ~8 to
# each logits-level loss, e.g. fused.grpo 260 -> 268): floor 51 (autograd's own share),
# token_logprobs 155, fused.grpo 256, fused.dpo 215, fused.kto 285, fused_linear.grpo 350 (one chunk), fused_linear.kto
# 396; Liger's triton_grpo_loss 150 and its fused-linear GRPO 3296. GRPO grew by ~20 with TRL's per-token options
# (issue 37: five more inputs through the autograd.Function) and the layouts' token-map argument (issue 33).
# The fused-linear losses grew by 34 (grpo 352 -> 386, dpo 307 -> 341, kto 398 -> 432) when dW x grad_output became
# a Triton launch (scale_rows_out) instead of torch.mul: run 4's H200 profile measured that mul at 2.21 ms of GPU
# time (1.4 TB/s) for a 128256 x 4096 dW, against ~34 x 0.5 us of host work here.
CEILINGS = {
    "floor": 60,
    "token_logprobs": 170,
    "token_logprobs(entropy)": 170,
    "fused.grpo": 280,
    "fused.grpo(validate)": 285,
    "fused.grpo(grad_in_forward)": 295,
    "fused.grpo(inplace)": 285,
    "fused.dpo": 235,
    "fused.dpo(validate)": 240,
    "fused.kto": 310,
    "fused.sequence_logratios": 225,
    "fused_linear.grpo": 425,
    "fused_linear.grpo(2 chunks)": 510,
    "fused_linear.dpo": 375,
    "fused_linear.dpo(1 pair a chunk)": 375,
    "fused_linear.kto": 475,
}


def _count(fn):
    n = 0

    def prof(frame, event, arg):
        nonlocal n
        n += event in ("call", "c_call")
    fn()  # first-call work (Triton's binder, caches) is not the steady state
    # a collection inside the counted call runs finalizers of whatever earlier tests left behind (CI's oldest-pair
    # stage counted 4 more in one worker than alone): the count is the call's, so the collector waits outside it
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(None)
        if enabled:
            gc.enable()
    return n


@pytest.fixture(scope="module")
def counts():
    with host_proxy.stubbed_launches():
        calls = host_proxy._calls()
        return {name: _count(fn) for name, fn in calls.items() if name in CEILINGS}


@pytest.mark.parametrize("name", sorted(CEILINGS))
def test_host_calls_within_budget(counts, name):
    assert counts[name] <= CEILINGS[name], f"{name}: {counts[name]} Python/C calls a forward + backward"


def test_count_sees_the_glue(counts):
    """The counter is not blind: every loss does measurably more than the floor, and splitting a fused-linear
    call into chunks adds calls."""
    assert all(counts[n] > counts["floor"] + 50 for n in CEILINGS if n != "floor")
    assert counts["fused_linear.grpo(2 chunks)"] > counts["fused_linear.grpo"]


def test_stubbed_launches_restores_triton():
    from triton.runtime.jit import JITFunction

    from humanline_kernels.ops import _jit
    run = JITFunction.run
    with host_proxy.stubbed_launches():
        assert JITFunction.run is not run and "cpu" in _jit.COMPILED_DEVICES
    assert JITFunction.run is run and "cpu" not in _jit.COMPILED_DEVICES


def test_triton_launch_path_runs_triton_and_restores_it():
    """``bench host --proxy --triton``: inside the stand-in, a call goes through Triton's own JITFunction.run (binder,
    cache, compile for sm_90 on the first call) to the driver's launcher, once per kernel launch; afterwards the
    driver, the stub and every kernel's caches are as before."""
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    import humanline_kernels as hk
    from humanline_kernels.ops import logprobs as LPK
    x = torch.randn(2, 4, 16, requires_grad=True)
    y = torch.randint(0, 16, (2, 4))
    previous = driver._active
    with host_proxy.stubbed_launches():
        stub, caches = JITFunction.run, LPK._logprobs_fwd_kernel.device_caches
        with host_proxy.stand_in_driver() as stand_in, host_proxy.triton_runs():
            assert JITFunction.run is not stub
            hk.token_logprobs(x, y, validate=False).sum().backward()
            assert stand_in.launched == 2  # forward and backward kernels, each through the driver's launcher
            assert len(LPK._logprobs_fwd_kernel.device_caches[0][0]) == 1  # compiled once, cached by Triton
        assert JITFunction.run is stub and LPK._logprobs_fwd_kernel.device_caches is caches
    assert driver._active is previous


def test_the_count_does_not_depend_on_the_active_driver(counts):
    """On a GPU machine Triton's CUDA driver is active once any CUDA test ran in the worker; the proxy's CPU tensors
    then asked it for its target twice a call (run 6, H100: grad_in_forward 298 calls in the suite, 262 here).
    With a driver active (the stand-in, whose target costs a call), the count is the same as with none."""
    from triton.runtime import driver
    previous = driver._active
    driver.set_active(host_proxy.StandInDriver())
    try:
        with host_proxy.stubbed_launches():
            got = _count(host_proxy._calls()["fused.grpo(grad_in_forward)"])
    finally:
        driver._active = previous
    assert got == counts["fused.grpo(grad_in_forward)"]
