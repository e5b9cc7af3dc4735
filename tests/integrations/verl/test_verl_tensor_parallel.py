"""verl's ``linear_cross_entropy`` with ``dist_process_group`` on ours, and megatron-core's tensor parallelism
(verl environment with megatron-core; skipped without them).

Two ranks on gloo (CPU, spawned, tools/distributed.py), the vocabulary split evenly and unevenly. Our
``linear_cross_entropy`` (the rebound kernel) with the tensor-parallel group gives the log-probs, the entropy and
the gradients of ``sum(w0 log_probs) - entropy_coeff sum(w1 entropy)`` (verl's ``ppo_loss`` with an entropy bonus)
of verl's own torch path: unsharded (``logprobs_from_logits``, ``entropy_from_logits`` on the whole logits) and, for
the even split, sharded (megatron-core's ``vocab_parallel_cross_entropy`` through verl's
``vocab_parallel_log_probs_from_logits``, verl's ``vocab_parallel_entropy``; megatron-core takes every slice to be
as large as its own). Then megatron-core's ``ColumnParallelLinear`` is the lm_head, its tensor-parallel state
initialised on gloo: its local logits through ``hk.token_logprobs`` / ``hk.fused.grpo`` and its weight through
``hk.fused_linear.grpo`` behind megatron's ``copy_to_tensor_model_parallel_region`` match the unsharded calls.
"""
import pytest

pytest.importorskip("verl")
pytest.importorskip("megatron.core")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import humanline_kernels as hk  # noqa: E402
from humanline_kernels.integrations.verl import _kernel  # noqa: E402
from tools.distributed import run  # noqa: E402

D, N = 8, 10
SPLITS = ((16, 13), (15, 15))  # the vocabulary's slices: uneven (ours only), even (megatron-core's too)
COEFF = 0.01  # verl's entropy_coeff


def close(a, b, what, tol=1e-5):
    torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol, msg=lambda m: f"{what}: {m}")


def _objective(lp, ent, g):
    return (lp * g[0]).sum() - COEFF * (ent * g[1]).sum()


def _leaf(t):
    return t.detach().clone().requires_grad_()


def _verl_worker(rank, world):
    torch._dynamo.config.disable = True  # verl's vocab_parallel_entropy compiles a helper; its math is what counts
    from megatron.core import parallel_state
    from verl.utils.megatron.tensor_parallel import vocab_parallel_entropy, vocab_parallel_log_probs_from_logits
    from verl.utils.torch_functional import entropy_from_logits, logprobs_from_logits

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    tp = parallel_state.get_tensor_model_parallel_group()
    for split, temperature in ((SPLITS[0], 1.0), (SPLITS[1], 1.0), (SPLITS[1], 0.7)):
        V, s = sum(split), sum(split[:rank])
        e = s + split[rank]
        gen = torch.Generator().manual_seed(V)
        h, w = torch.randn(N, D, generator=gen), torch.randn(V, D, generator=gen) / 2
        y = torch.randint(0, V, (N,), generator=gen)
        g = torch.randn(N, generator=gen), torch.randn(N, generator=gen)
        # ours, sharded
        hh, ww = _leaf(h), _leaf(w[s:e])
        lp, ent = _kernel.linear_cross_entropy(hh, ww, y, temperature, "none", tp)
        _objective(lp, ent, g).backward()
        # verl's torch path, unsharded
        uh, uw = _leaf(h), _leaf(w)
        logits = (uh @ uw.T) / temperature
        u_lp, u_ent = logprobs_from_logits(logits, y), entropy_from_logits(logits)
        _objective(u_lp, u_ent, g).backward()
        what = f"{split=} {temperature=}"
        close(lp, u_lp, f"{what} log-probs vs verl's unsharded torch path")
        close(ent, u_ent, f"{what} entropy vs verl's unsharded torch path")
        close(ww.grad, uw.grad[s:e], f"{what} dW vs the slice of verl's unsharded")
        dh = hh.grad.clone()
        dist.all_reduce(dh, group=tp)
        close(dh, uh.grad, f"{what} dh (the parts summed) vs verl's unsharded")
        if split[0] != split[1]:
            continue
        # verl's torch path, sharded (megatron-core's vocab-parallel cross-entropy, verl's vocab-parallel entropy)
        sh, sw = _leaf(h), _leaf(w[s:e])
        local = (sh @ sw.T) / temperature
        s_lp = vocab_parallel_log_probs_from_logits(local.clone(), y)
        s_ent = vocab_parallel_entropy(local.clone())
        _objective(s_lp, s_ent, g).backward()
        close(lp, s_lp, f"{what} log-probs vs verl's sharded torch path")
        close(ent, s_ent, f"{what} entropy vs verl's sharded torch path")
        close(ww.grad, sw.grad, f"{what} dW vs verl's sharded")
        close(hh.grad, sh.grad, f"{what} dh (this slice's part) vs verl's sharded")


def test_linear_cross_entropy_sharded_matches_verls_torch_paths():
    run(_verl_worker)


def _megatron_worker(rank, world):
    from megatron.core import parallel_state
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.tensor_parallel import ColumnParallelLinear, copy_to_tensor_model_parallel_region

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    tp = parallel_state.get_tensor_model_parallel_group()
    vocab = 32  # Megatron's vocabulary: padded to a multiple of the tensor-parallel size (true ids below 30)
    torch.manual_seed(0)  # the same full weight on every rank, each keeping its partition (use_cpu_initialization)
    cfg = ModelParallelConfig(tensor_model_parallel_size=world, use_cpu_initialization=True)
    head = ColumnParallelLinear(D, vocab, config=cfg, init_method=torch.nn.init.normal_, bias=False,
                                gather_output=False, skip_bias_add=True)
    full_w = torch.empty(vocab, D)
    dist.all_gather_into_tensor(full_w, head.weight.detach().contiguous(), group=tp)
    gen = torch.Generator().manual_seed(1)
    T, B = 6, 2
    hidden = torch.randn(T, B, D, generator=gen)  # Megatron's [s, b, h]
    labels = torch.randint(0, 30, (T, B), generator=gen)
    labels[0] = -100
    ref = -3.0 + torch.randn(T, B, generator=gen)
    adv = torch.randn(T, B, generator=gen)

    # logits level: the column-parallel layer's local logits
    x = _leaf(hidden)
    local, _ = head(x)
    assert local.shape == (T, B, vocab // world)
    lp = hk.token_logprobs(local, labels, process_group=tp)
    loss, metrics = hk.fused.grpo(local.transpose(0, 1), labels.T, ref.T, adv.T, process_group=tp)
    (lp.sum() + loss).backward()
    ux = _leaf(hidden)
    u_logits = ux @ full_w.T
    u_lp = hk.token_logprobs(u_logits, labels)
    u_loss, u_metrics = hk.fused.grpo(u_logits.transpose(0, 1), labels.T, ref.T, adv.T)
    (u_lp.sum() + u_loss).backward()
    close(lp, u_lp, "ColumnParallelLinear logits: log-probs")
    close(loss, u_loss, "ColumnParallelLinear logits: GRPO loss")
    for k in metrics:
        close(metrics[k], u_metrics[k], f"ColumnParallelLinear logits: {k}")
    # the layer's own backward all-reduces the input's gradient over the group: the whole dh on every rank
    close(x.grad, ux.grad, "ColumnParallelLinear logits: dh")

    # hidden level: the layer's weight slice, hidden behind Megatron's copy-to region (which sums dh's parts). The
    # region takes the tensor passed, after the transpose: its backward all-reduces grad.contiguous(), a copy (and
    # the sum lost) for the non-contiguous gradient of a transposed view
    x = _leaf(hidden)
    head.weight.grad = None
    loss, _ = hk.fused_linear.grpo(copy_to_tensor_model_parallel_region(x.transpose(0, 1)), head.weight, labels.T,
                                   ref.T, adv.T, process_group=tp)
    loss.backward()
    ux, uw = _leaf(hidden), _leaf(full_w)
    u_loss, _ = hk.fused_linear.grpo(ux.transpose(0, 1), uw, labels.T, ref.T, adv.T)
    u_loss.backward()
    close(loss, u_loss, "fused_linear on ColumnParallelLinear's weight: loss")
    close(x.grad, ux.grad, "fused_linear on ColumnParallelLinear's weight: dh")
    per = vocab // world
    close(head.weight.grad, uw.grad[rank * per:(rank + 1) * per], "fused_linear on ColumnParallelLinear's weight: dW")


def test_megatron_column_parallel_lm_head():
    run(_megatron_worker)
