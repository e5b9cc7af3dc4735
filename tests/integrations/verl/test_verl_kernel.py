"""verl's fused-kernel forward on ``hk.fused_linear.token_logprobs`` (verl environment; skipped without verl).

On a tiny random Llama, verl's ``forward_with_triton_backend`` with our kernel rebound gives the log-probs,
entropy and parameter gradients (of the log-probs and of verl's entropy bonus) of verl's
``forward_with_torch_backend`` (its reference implementation), in
verl's padded ``[B, T]`` layout and in its remove-padding layout (``[1, nnz]`` with ``shift_labels``), at a
temperature other than 1. On CPU the kernel runs under the Triton interpreter (conftest sets it).
"""
import pytest

pytest.importorskip("verl")

import torch  # noqa: E402
import verl.utils.kernel.linear_cross_entropy as verl_lce  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402
from verl.models.transformers.dense_common import forward_with_torch_backend, forward_with_triton_backend  # noqa: E402

from humanline_kernels.integrations.verl import _kernel  # noqa: E402


@pytest.fixture
def rebound(monkeypatch):
    monkeypatch.setattr(verl_lce, "linear_cross_entropy", verl_lce.linear_cross_entropy)  # restored afterwards
    _kernel.rebind()
    assert _kernel.is_rebound()


def tiny_llama(dtype):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, attn_implementation="eager")
    return LlamaForCausalLM(cfg).to(dtype)


def run(forward, model, kwargs, weights):
    """Log-probs, entropy and the parameters' gradients of ``sum(w0 log_probs) - 0.1 sum(w1 entropy)`` (verl's
    ``ppo_loss`` adds ``-entropy_coeff * entropy``: the bonus trains through the entropy)."""
    model.zero_grad(set_to_none=True)
    out = forward(model, return_dict=True, temperature=0.7, **kwargs)
    ((out.log_probs.float() * weights[0]).sum() - 0.1 * (out.entropy.float() * weights[1]).sum()).backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return out.log_probs.detach(), out.entropy.detach().float(), grads


@pytest.mark.parametrize("layout", ["padded", "rmpad"])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_rebound_kernel_matches_verls_torch_backend(rebound, layout, dtype, tol):
    model = tiny_llama(dtype)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 97, (3, 11), generator=g)
    if layout == "padded":
        kwargs = {"input_ids": ids}
        shape = ids.shape
    else:  # verl's remove-padding call: one packed row, the rolled labels passed in (transformer_impl.py)
        flat = ids.reshape(1, -1)
        kwargs = {"input_ids": flat, "position_ids": torch.arange(11).repeat(3)[None],
                  "shift_labels": torch.roll(flat, -1, dims=-1)}
        shape = flat.shape
    weights = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    want_lp, want_ent, want_g = run(forward_with_torch_backend, model, kwargs, weights)
    lp, ent, grads = run(forward_with_triton_backend, model, kwargs, weights)
    assert lp.shape == want_lp.shape == shape and lp.dtype == torch.float32
    torch.testing.assert_close(lp, want_lp.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(ent, want_ent, rtol=tol, atol=tol)
    for name, want in want_g.items():
        err = (grads[name].float() - want.float()).norm() / want.float().norm().clamp(min=1e-12)
        assert err < (1e-4 if dtype == torch.float32 else 2e-2), (name, err.item())


def test_refusals():
    h, w, y = torch.randn(4, 8), torch.randn(13, 8), torch.randint(0, 13, (4,))
    with pytest.raises(ValueError, match="only reduction='none'"):
        _kernel.linear_cross_entropy(h, w, y, 1.0, "mean")
    # a tensor-parallel group is taken (tests/integrations/verl/test_verl_tensor_parallel.py), but only one of
    # torch.distributed's
    with pytest.raises(ValueError, match="torch.distributed is not initialised"):
        _kernel.linear_cross_entropy(h, w, y, 1.0, "none", object())
