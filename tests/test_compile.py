"""``torch.compile`` through every entry point (docs/kernels.md, "torch.compile").

Each public function traced whole (``fullgraph=True``, no graph break counted) with the CPU backend
``aot_eager``, forward and backward, on the kernels' custom ops (``TRITON_INTERPRET=1``: the interpreted kernels) and
on the eager twins (``TRITON_INTERPRET=0``); its loss, metrics and gradients those of the same call not compiled. A
graph holds for other sequence lengths (dynamic, no recompile). The trainers' patched forward compiles without a
break and does not recompile as the batches' shapes change (slow). With CUDA, Inductor (the default backend) on the
compiled kernels: the same values and gradients.
"""
import importlib.util
import os

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

import humanline_kernels as hk

B, T, V, D = 4, 5, 33, 8
DES = torch.tensor([True, False, True, False])
PACKED = hk.Packed([0, 5, 10, 15, 20])
SUP = [[1, 4]] * B


def _inputs(device="cpu", t=T):
    g = torch.Generator().manual_seed(0)
    y = torch.randint(0, V, (B, t), generator=g)
    y[1, 3:] = -100
    return dict(
        x=torch.randn(B, t, V, generator=g).to(device).requires_grad_(),
        y=y.to(device),
        ref=(torch.randn(B, t, generator=g) - 3).to(device).requires_grad_(),
        adv=torch.randn(B, generator=g).to(device).requires_grad_(),
        h=torch.randn(B, t, D, generator=g).to(device).requires_grad_(),
        w=torch.randn(V, D, generator=g).to(device).requires_grad_(),
        lp=(torch.randn(B, t, generator=g) - 3).to(device).requires_grad_(),
        ent=(torch.rand(B, t, generator=g) * 2).to(device).requires_grad_(),
    )


def _sup(y):
    """Labels with nothing outside the ``SUP`` ranges."""
    y = y.clone()
    y[:, :1] = -100
    y[:, 4:] = -100
    return y


def _flat(t):
    return t.reshape(1, -1)


# every level, both layouts, the objectives, clip on and off; each takes the _inputs it names
CALLS = {
    "token_logprobs(entropy)": lambda x, y, **_: hk.token_logprobs(x, y, return_entropy=True, temperature=0.7),
    "fused.grpo": lambda x, y, ref, adv, **_: hk.fused.grpo(x, y, ref, adv, beta=0.04),
    "fused.grpo(clip=None, grad_in_forward)": lambda x, y, ref, adv, **_: hk.fused.grpo(
        x, y, ref.detach(), adv.detach(), clip=None, grad_in_forward=True),
    "fused.grpo(packed, dr_grpo)": lambda x, y, ref, adv, **_: hk.fused.grpo(
        x.reshape(B * T, V), y.reshape(-1), ref.reshape(-1), adv, loss_type="dr_grpo", packed=PACKED),
    "fused.dpo": lambda x, y, ref, **_: hk.fused.dpo(x, y, ref),
    "fused.kto": lambda x, y, ref, **_: hk.fused.kto(x, y, ref, DES.to(y.device), ref.detach(), ref.detach() - 0.2,
                                                     y != -100),
    "fused.dpo(hinge)": lambda x, y, ref, **_: hk.fused.dpo(x, y, ref, loss_type="hinge", clip=None),
    "fused.simpo": lambda x, y, **_: hk.fused.simpo(x, y),
    "fused_linear.token_logprobs(entropy)": lambda h, w, y, **_: hk.fused_linear.token_logprobs(
        h, w, y, return_entropy=True),
    "fused_linear.token_logprobs(supervised)": lambda h, w, y, **_: hk.fused_linear.token_logprobs(
        h, w, _sup(y), supervised=SUP),
    "fused_linear.grpo(2 chunks)": lambda h, w, y, ref, adv, **_: hk.fused_linear.grpo(
        h, w, y, ref, adv, beta=0.04, chunk_bytes=V * 4 * 12),
    "fused_linear.grpo(supervised, clip=None)": lambda h, w, y, ref, adv, **_: hk.fused_linear.grpo(
        h, w, _sup(y), ref, adv, clip=None, supervised=SUP),
    "fused_linear.dpo(packed)": lambda h, w, y, ref, **_: hk.fused_linear.dpo(
        h.reshape(1, B * T, D), w, _flat(y), _flat(ref), packed=PACKED),
    "fused_linear.kto": lambda h, w, y, ref, **_: hk.fused_linear.kto(
        h, w, y, ref, DES.to(y.device), ref.detach(), ref.detach() - 0.2, y != -100),
    "fused_linear.ipo": lambda h, w, y, ref, **_: hk.fused_linear.ipo(h, w, y, ref),
    "losses.grpo(entropy bonus, quantile)": lambda lp, ref, adv, y, ent, **_: hk.losses.grpo(
        lp, ref, adv, y != -100, entropies=ent, top_entropy_quantile=0.5, entropy_coef=0.01),
    "losses.dpo(mixture)": lambda lp, ref, y, **_: hk.losses.dpo(
        lp, ref, y != -100, loss_type=["sigmoid", "hinge"], loss_weights=[1.0, 0.5]),
    "losses.kto": lambda lp, ref, y, **_: hk.losses.kto(lp, ref, y != -100, DES, ref.detach(), ref.detach(),
                                                         y != -100),
}
# grad_in_forward is a kernel-path option; the eager twins' token-map path is traced in fused_linear.dpo(packed) (the
# supervised cases would double the file's time for nothing more)
KERNEL_ONLY = ("fused.grpo(clip=None, grad_in_forward)", "fused_linear.token_logprobs(supervised)",
               "fused_linear.grpo(supervised, clip=None)")
LOSSES_LEVEL = tuple(name for name in CALLS if name.startswith("losses."))  # no kernels: one path


def _cases():
    for name in CALLS:
        for interp in ("1", "0"):
            if (interp == "0" and name in KERNEL_ONLY) or (interp == "1" and name in LOSSES_LEVEL):
                continue
            yield pytest.param(name, interp, id=f"{name}-{'kernels' if interp == '1' else 'eager'}")


def _outputs(res):
    """The tensors of a result: the loss (or log-probs), the rest of a tuple, a metrics dict's values."""
    out = []
    for r in res if isinstance(res, tuple) else (res,):
        if isinstance(r, dict):
            out += [r[k] for k in sorted(r)]
        elif isinstance(r, torch.Tensor):
            out.append(r)
    return out


def _objective(res):
    """A scalar through every differentiable output (the entropy's gradient too)."""
    return sum(t.float().sum() for t in _outputs(res) if t.requires_grad)


def _run(fn, inp):
    res = fn(**inp)
    _objective(res).backward()
    return [t.detach() for t in _outputs(res)], {k: v.grad for k, v in inp.items() if v.grad is not None}


@pytest.fixture
def dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield counters
    torch._dynamo.reset()


@pytest.mark.parametrize("name, interp", list(_cases()))
def test_fullgraph_equals_eager(name, interp, monkeypatch, dynamo):
    monkeypatch.setenv("TRITON_INTERPRET", interp)
    fn = CALLS[name]
    want, want_grads = _run(fn, _inputs())
    got, got_grads = _run(torch.compile(fn, fullgraph=True, backend="aot_eager"), _inputs())
    assert not dynamo["graph_break"], dict(dynamo["graph_break"])
    assert dynamo["stats"]["unique_graphs"] == 1
    assert len(got) == len(want)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, equal_nan=True)
    assert got_grads.keys() == want_grads.keys() and want_grads
    for k in want_grads:
        torch.testing.assert_close(got_grads[k], want_grads[k], rtol=1e-5, atol=1e-6, msg=k)


# the dense layouts at the default chunk size: one chunk whatever the sequence length
DYNAMIC = {
    "token_logprobs": lambda x, y, **_: hk.token_logprobs(x, y, return_entropy=True),
    "fused.dpo": lambda x, y, ref, **_: hk.fused.dpo(x, y, ref),
    "fused_linear.token_logprobs": lambda h, w, y, **_: hk.fused_linear.token_logprobs(h, w, y, return_entropy=True),
    "fused_linear.grpo": lambda h, w, y, ref, adv, **_: hk.fused_linear.grpo(h, w, y, ref, adv),
    "fused_linear.kto": lambda h, w, y, ref, **_: hk.fused_linear.kto(h, w, y, ref, DES.to(y.device)),
}


@pytest.mark.parametrize("name, interp", [(n, "1") for n in DYNAMIC] + [("fused_linear.grpo", "0")])
def test_a_graph_serves_every_sequence_length(name, interp, monkeypatch, dynamo):
    """Sequence lengths marked dynamic (``torch._dynamo.mark_dynamic``, as the trainers do): one graph for T = 5
    and 8, no recompile; a specialisation on the length would raise (a marked dimension made static)."""
    monkeypatch.setenv("TRITON_INTERPRET", interp)
    fn = torch.compile(DYNAMIC[name], fullgraph=True, backend="aot_eager")
    for t in (5, 8):
        inp = _inputs(t=t)
        for k in ("x", "y", "ref", "h"):
            torch._dynamo.mark_dynamic(inp[k], 1)
        want, _ = _run(DYNAMIC[name], _inputs(t=t))
        got, _ = _run(fn, inp)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, equal_nan=True)
    assert not dynamo["graph_break"]
    assert dynamo["stats"]["unique_graphs"] == 1, dict(dynamo["stats"])


@pytest.mark.parametrize("kind", ["random", "none masked", "nan"])
def test_high_entropy_mask_is_the_quantile_of_the_masked(kind):
    """``losses.grpo_high_entropy_mask`` (NaN for the unmasked, ``nanquantile``: no data-dependent size under
    ``torch.compile``) is ``hk.reference``'s quantile of ``entropies[mask]``: no token when none is masked or a
    masked entropy is NaN."""
    from humanline_kernels import reference

    g = torch.Generator().manual_seed(3)
    ent = torch.rand(6, 9, generator=g)
    mask = torch.rand(6, 9, generator=g) > 0.3
    if kind == "none masked":
        mask[:] = False
    if kind == "nan":
        ent[mask.nonzero()[0].tolist()] = float("nan")
    ent[~mask] = 100.0  # unmasked entropies must not move the quantile
    got = hk.losses.grpo_high_entropy_mask(ent, mask, 0.3)
    want = reference._high_entropy_mask(ent, mask, 0.7) if kind != "nan" else torch.zeros_like(mask)
    assert torch.equal(got, want)
    if kind == "random":
        assert 0 < got.sum() < mask.sum()


# ------------------------------------------------------------------------------------------------ the trainers
def _tiny():
    spec = importlib.util.spec_from_file_location(
        "hk_tiny", os.path.join(os.path.dirname(__file__), "..", "examples", "tiny.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _pref_data():
    """Pairs whose prompts and completions differ in length, so that batches differ in shape."""
    from datasets import Dataset
    return Dataset.from_list([{"prompt": f"{a}" * (1 + (a * 7 + b) % 5) + "=", "chosen": str(a * b) * (1 + b),
                               "rejected": f"{a + b + 1}!" * (1 + a % 2)} for a in range(4) for b in range(3)])


def _train_dpo(path, tiny, fused, compiled):
    from humanline_kernels.integrations.trl import HumanlineDPOConfig, HumanlineDPOTrainer

    kw = dict(report_to=[], use_cpu=True, bf16=False, save_strategy="no", logging_strategy="no", disable_tqdm=True,
              seed=0, output_dir=os.path.join(path, "o"), per_device_train_batch_size=5, max_steps=3,
              learning_rate=1e-3, sync_every=1, fused=fused)
    if compiled:
        kw.update(torch_compile=True, torch_compile_backend="aot_eager")
    tr = HumanlineDPOTrainer(path, args=HumanlineDPOConfig(**kw), train_dataset=_pref_data(),
                             processing_class=tiny.tiny_tokenizer())
    shapes = []
    step = tr.compute_loss

    def compute_loss(model, inputs, *a, **k):
        shapes.append(tuple(inputs["input_ids"].shape))
        return step(model, inputs, *a, **k)
    tr.compute_loss = compute_loss
    tr.train()
    return {n: p.detach().clone() for n, p in tr.model.named_parameters()}, shapes


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")
@pytest.mark.parametrize("fused", ["linear", "logits"])
def test_trainer_forward_compiles_whole_and_never_recompiles_for_a_shape(fused, tmp_path, monkeypatch, dynamo):
    """``HumanlineDPOTrainer(torch_compile=True)``: the patched forward (backbone and our head, the policy's and
    the reference's) is one graph each, no break; over batches of other lengths and a short last batch it
    recompiles never (the policy's ``[B, L]`` tensors are marked dynamic); the weights are those of the run not
    compiled. Two graphs: the reference's forward under ``no_grad`` and the policy's (one function, so Dynamo
    counts the second as a recompile, for the grad mode)."""
    pytest.importorskip("trl")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    tiny = _tiny()
    path = str(tmp_path)
    tiny.tiny_model().save_pretrained(path)
    tiny.tiny_tokenizer().save_pretrained(path)
    eager, _ = _train_dpo(path, tiny, fused, compiled=False)
    torch._dynamo.reset()
    counters.clear()
    compiled, shapes = _train_dpo(path, tiny, fused, compiled=True)
    assert len(set(shapes)) == 3 and len({s[0] for s in shapes}) == 2, shapes  # (two lengths, a short batch)
    assert not dynamo["graph_break"], dict(dynamo["graph_break"])
    assert dynamo["stats"]["unique_graphs"] == 2, dict(dynamo["stats"])
    for n in eager:
        torch.testing.assert_close(compiled[n], eager[n], rtol=1e-4, atol=1e-6, msg=n)


# --------------------------------------------------------------------------------------------------------- GPU
GPU_CALLS = ("token_logprobs(entropy)", "fused.grpo", "fused.grpo(clip=None, grad_in_forward)", "fused.dpo",
             "fused.kto", "fused_linear.grpo(2 chunks)", "fused_linear.dpo(packed)",
             "fused_linear.token_logprobs(entropy)")


@pytest.mark.gpu
@pytest.mark.parametrize("name", GPU_CALLS)
def test_gpu_inductor_equals_eager(name, compiled_kernels):
    """Inductor, the default backend, around the compiled kernels (opaque custom ops in its graph): the same values
    and gradients as the same call not compiled."""
    fn = CALLS[name]
    torch._dynamo.reset()
    want, want_grads = _run(fn, _inputs("cuda"))
    got, got_grads = _run(torch.compile(fn, fullgraph=True), _inputs("cuda"))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, equal_nan=True)
    for k in want_grads:
        torch.testing.assert_close(got_grads[k], want_grads[k], rtol=1e-4, atol=1e-5, msg=k)
