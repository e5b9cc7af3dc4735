"""``hk.LookaheadReference`` gives, step by step, the reference log-probs, losses and gradients of a run with a
reference model synced by ``hk.ReferenceSyncer`` (the reference starting as a copy of the policy): every = 1 and
3, gradient accumulation, dropout in the model, a resume in the middle of a window, DDP and FSDP2 (gloo, world
size 2); and it holds no second copy of the parameters."""
import copy
import gc

import pytest
import torch
import torch.distributed as dist
from torch import nn

import humanline_kernels as hk
from tools.distributed import run

V, D, T = 37, 16, 7


class Net(nn.Module):
    """A tiny LM with dropout: the window forwards must run it in eval mode, as a reference model would be."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.drop = nn.Dropout(0.3)
        self.mid = nn.Linear(D, D)
        self.head = nn.Linear(D, V)

    def forward(self, ids):
        return self.head(torch.tanh(self.mid(self.drop(self.emb(ids)))))


def logps_fn(model, mb):
    return hk.reference.token_logprobs(model(mb["ids"]), mb["labels"])


def make_data(steps, accum, seed, pairs=2):
    """``steps`` optimizer steps of ``accum`` DPO micro-batches (2 * pairs rows each); a list when accum > 1."""
    g = torch.Generator().manual_seed(seed)
    data = []
    for _ in range(steps):
        mbs = []
        for _ in range(accum):
            ids = torch.randint(0, V, (2 * pairs, T), generator=g)
            labels = torch.randint(0, V, (2 * pairs, T), generator=g)
            labels[:, :2] = -100
            mbs.append({"ids": ids, "labels": labels})
        data.append(mbs if accum > 1 else mbs[0])
    return data


def _mbs(batch):
    return batch if isinstance(batch, list) else [batch]


def _step(policy, batch, refs, opt):
    mbs, rs = _mbs(batch), refs if isinstance(refs, list) else [refs]
    total = 0.0
    for mb, r in zip(mbs, rs):
        loss, _ = hk.losses.dpo(logps_fn(policy, mb), r, mb["labels"] != -100, beta=0.5)
        (loss / len(mbs)).backward()
        total += loss.detach() / len(mbs)
    grads = [(p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().clone()
             for p in policy.parameters()]  # FSDP2: the full gradient
    return total, grads


def run_synced(policy, reference, data, every, opt_fn, wrap_ref=None):
    reference.eval()
    syncer = hk.ReferenceSyncer(policy, reference, every=every, overlap=False)
    opt = opt_fn(policy)
    torch.manual_seed(1234)  # dropout
    out = []
    for batch in data:
        with torch.no_grad():
            refs = [logps_fn(reference, mb) for mb in _mbs(batch)]
        refs = refs if isinstance(batch, list) else refs[0]
        syncer.start()
        loss, grads = _step(policy, batch, refs, opt)
        syncer.wait()
        opt.step()
        opt.zero_grad()
        out.append((refs, loss, grads))
    return out


def run_lookahead(policy, data, every, opt_fn, *, stop_after=None, state=None, opt_state=None):
    la = hk.LookaheadReference(policy, data, logps_fn, every=every)
    if state is not None:
        la.load_state_dict(state)
    opt = opt_fn(policy)
    if opt_state is not None:
        opt.load_state_dict(opt_state)
    else:
        torch.manual_seed(1234)  # dropout, as in run_synced (a resumed run keeps the RNG it is given)
    out = []
    for batch, refs in la:
        loss, grads = _step(policy, batch, refs, opt)
        la.wait()
        opt.step()
        opt.zero_grad()
        out.append((refs, loss, grads))
        if stop_after is not None and la.step == stop_after:
            return out, la.state_dict(), opt.state_dict()
    return out, None, None


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.8)


def assert_same_runs(a, b):
    assert len(a) == len(b) and a
    for t, ((ra, la, ga), (rb, lb, gb)) in enumerate(zip(a, b)):
        for x, y in zip(ra if isinstance(ra, list) else [ra], rb if isinstance(rb, list) else [rb]):
            torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-6, msg=f"step {t}: reference log-probs")
        torch.testing.assert_close(la, lb, rtol=1e-6, atol=1e-6, msg=f"step {t}: loss")
        for x, y in zip(ga, gb):
            torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-6, msg=f"step {t}: gradient")


def _same_init():
    torch.manual_seed(0)
    return Net()


@pytest.mark.parametrize("every", [1, 3])
@pytest.mark.parametrize("accum", [1, 2])
def test_matches_a_synced_reference_model(every, accum):
    data = make_data(8, accum, seed=5)
    pol = _same_init()
    synced = run_synced(pol, copy.deepcopy(pol).requires_grad_(False), data, every, sgd)
    look, _, _ = run_lookahead(_same_init(), data, every, sgd)
    assert_same_runs(synced, look)
    # the reference really moved: steps after the first sync window use later policies
    assert not torch.equal(synced[0][0] if accum == 1 else synced[0][0][0],
                           synced[-1][0] if accum == 1 else synced[-1][0][0])


def test_the_reference_is_the_policy_before_the_last_sync_update():
    """every = 3: steps 0..3 use theta_0, steps 4..6 theta_3, step 7 theta_6 (k * floor((t - 1) / k))."""
    data = make_data(8, 1, seed=6)
    pol = _same_init()
    snaps, la = [], hk.LookaheadReference(pol, data, logps_fn, every=3)
    opt = sgd(pol)
    torch.manual_seed(1234)
    for t, (batch, ref) in enumerate(la):
        snaps.append(copy.deepcopy(pol).eval())
        _step(pol, batch, ref, opt)
        la.wait()
        opt.step()
        opt.zero_grad()
        src = 0 if t == 0 else 3 * ((t - 1) // 3)
        with torch.no_grad():
            torch.testing.assert_close(ref, logps_fn(snaps[src], batch), rtol=0, atol=0, msg=f"step {t}")
    assert la.step == 8


@pytest.mark.parametrize("stop", [4, 5, 6])
def test_resume_in_the_middle_of_a_window(stop):
    every, data = 3, make_data(9, 2, seed=7)
    full, _, _ = run_lookahead(_same_init(), data, every, sgd)
    pol = _same_init()
    first, state, opt_state = run_lookahead(pol, data, every, sgd, stop_after=stop)
    assert len(first) == stop and state["step"] == stop and state["window_refs"]
    rng = torch.get_rng_state()
    resumed_pol = _same_init()
    resumed_pol.load_state_dict(pol.state_dict())
    torch.set_rng_state(rng)
    rest, _, _ = run_lookahead(resumed_pol, data[stop:], every, sgd, state=state, opt_state=opt_state)
    assert_same_runs(full, first + rest)


def test_ends_cleanly_mid_window_and_protocol_errors():
    data = make_data(5, 1, seed=8)  # every = 3: the second window has 1 batch of 3
    la = hk.LookaheadReference(_same_init(), data, logps_fn, every=3)
    n = 0
    for _batch, _ref in la:
        n += 1
        la.wait()
    assert n == 5 and la.step == 5
    la = hk.LookaheadReference(_same_init(), data, logps_fn)
    next(la)
    with pytest.raises(RuntimeError, match="call wait"):
        next(la)
    la.wait()
    with pytest.raises(RuntimeError, match="no batch of this step"):
        la.wait()
    with pytest.raises(ValueError, match="every must be a positive int"):
        hk.LookaheadReference(_same_init(), data, logps_fn, every=0)
    with pytest.raises(ValueError, match="logps_fn must be callable"):
        hk.LookaheadReference(_same_init(), data, None)
    state = hk.LookaheadReference(_same_init(), data, logps_fn, every=2).state_dict()
    with pytest.raises(ValueError, match="every=2 was saved"):
        hk.LookaheadReference(_same_init(), data, logps_fn, every=3).load_state_dict(state)
    with pytest.raises(ValueError, match="policy must be a torch.nn.Module"):
        hk.LookaheadReference({"w": 1}, data, logps_fn)
    for bad in ({"step": 1}, [state]):
        with pytest.raises(ValueError, match="state must be a dict with step, every and window_refs"):
            hk.LookaheadReference(_same_init(), data, logps_fn, every=2).load_state_dict(bad)
    # checked whole before anything is set: a refused state leaves the object as it was
    good = dict(state, step=1, window_refs=[torch.zeros(2)])
    for key, value, match in (("step", -1, "step must be an int >= 0"), ("step", "1", "step must be an int"),
                              ("window_refs", [torch.zeros(2), "x"], "window_refs must be a list of tensors"),
                              ("window_refs", torch.zeros(2), "window_refs must be a list of tensors"),
                              ("exhausted", "no", "exhausted must be a bool")):
        la = hk.LookaheadReference(_same_init(), data, logps_fn, every=2)
        with pytest.raises(ValueError, match=match):
            la.load_state_dict(dict(good, **{key: value}))
        assert la.step == 0 and la._loaded_refs is None and not la._exhausted


@pytest.mark.parametrize("ret", [None, "list", "int"])
@pytest.mark.parametrize("accum", [1, 2])
def test_logps_fn_must_return_a_float_tensor(ret, accum):
    """A logps_fn returning something else than a tensor of log-probs (None: a forgotten return) is refused naming
    logps_fn, micro-batches too (an AttributeError on .detach() before); the train modes are restored all the same."""
    out = {None: lambda: None, "list": lambda: [torch.zeros(2, T)],
           "int": lambda: torch.zeros(2, T, dtype=torch.long)}[ret]
    pol = _same_init()
    la = hk.LookaheadReference(pol, make_data(2, accum, seed=3), lambda model, batch: out())
    with pytest.raises(ValueError, match=r"logps_fn\(model, batch\) must return a floating-point tensor"):
        next(la)
    assert pol.training and pol.drop.training
    with pytest.raises(ValueError, match="batches must be an iterable of per-step batches, got int"):
        hk.LookaheadReference(pol, 3, logps_fn)


def test_train_mode_of_every_submodule_is_restored():
    pol = _same_init()
    pol.mid.eval()  # a frozen-in-eval submodule stays in eval; the rest in train
    la = hk.LookaheadReference(pol, make_data(2, 1, seed=9), logps_fn)
    next(la)
    assert pol.training and pol.drop.training and not pol.mid.training


def _param_bytes():
    gc.collect()
    return sum(o.numel() * o.element_size() for o in gc.get_objects() if isinstance(o, nn.Parameter))


def test_no_second_copy_of_the_parameters():
    base = _param_bytes()
    data = make_data(3, 1, seed=10)
    pol = _same_init()
    one = _param_bytes() - base
    ref = copy.deepcopy(pol).requires_grad_(False)
    synced_bytes = _param_bytes() - base
    del ref
    la = hk.LookaheadReference(pol, data, logps_fn, every=1)
    for _batch, _r in la:
        la.wait()
    look_bytes = _param_bytes() - base
    assert one > 0 and synced_bytes == 2 * one and look_bytes == one
    print(f"parameter bytes: synced reference {synced_bytes}, lookahead {look_bytes} (saves {one})")


# ---- distributed (gloo, world size 2) -------------------------------------------------------------------------
def _dist_case(wrap, wrap_ref, every, accum):
    rank = dist.get_rank()
    data = make_data(7, accum, seed=100 + rank)  # each rank its own shard

    def opt_fn(m):
        return torch.optim.SGD(m.parameters(), lr=0.8)
    pol = wrap(_same_init())
    ref = wrap_ref(_same_init().requires_grad_(False))
    synced = run_synced(pol, ref, data, every, opt_fn)
    look, _, _ = run_lookahead(wrap(_same_init()), data, every, opt_fn)
    assert_same_runs(synced, look)


def ddp_worker(rank, world):
    from torch.nn.parallel import DistributedDataParallel as DDP
    _dist_case(DDP, lambda m: m, every=1, accum=1)
    _dist_case(DDP, lambda m: m, every=3, accum=2)


@pytest.mark.slow
def test_ddp():
    run(ddp_worker)


def fsdp2_wrap(model):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for m in (model.mid, model.head):
        fully_shard(m, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def fsdp2_worker(rank, world):
    _dist_case(fsdp2_wrap, fsdp2_wrap, every=1, accum=1)
    _dist_case(fsdp2_wrap, fsdp2_wrap, every=3, accum=2)


@pytest.mark.slow
def test_fsdp2():
    run(fsdp2_worker)

