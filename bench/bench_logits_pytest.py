"""pytest-benchmark suite of the logits path (not collected by the default ``tests/`` run).

``python -m pytest bench/bench_logits_pytest.py --benchmark-only`` (GPU: N=8192, V=128256 bf16; CPU: a tiny shape
on the eager paths). The CLI ``python -m bench logits`` adds floors, memory, peers and the plot.
"""
import pytest
import torch

from bench import bench_logits

GPU = torch.cuda.is_available()
N, V = (8192, 128256) if GPU else (64, 1000)
IMPLS = ["hk.token_logprobs", "hk.token_logprobs(inplace)", "hk.fused.grpo", "hk.fused.grpo(grad_in_fwd)",
         "hk.fused.dpo", "hk.fused.kto", "eager fp32 log_softmax+gather"]


@pytest.fixture(scope="module")
def impls():
    x, y, ref = bench_logits._inputs(N, V, "cuda" if GPU else "cpu", torch.bfloat16)
    return bench_logits._impls(x, y, ref, quick=not GPU)


@pytest.mark.parametrize("name", IMPLS)
def test_logits_fwd_bwd(benchmark, impls, name):
    fn = impls[name][0]

    def run():
        fn()
        if GPU:
            torch.cuda.synchronize()

    benchmark.pedantic(run, rounds=20 if GPU else 3, warmup_rounds=3 if GPU else 1)
