"""ReferenceSyncer(slices=n): the copy cut into parts (CopyPlan.split) and issued through the policy's forward and
backward (sync/_pace.py). On CPU the parts run on the current stream at their points, so what each point issued
is visible; the side-stream version is tests/sync/test_sync_gpu.py's, the wrapped models' tests/sync/test_sync_dist.py's
and tests/sync/test_sync_zero.py's."""
import copy
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import humanline_kernels as hk
from humanline_kernels.sync._copy import _CUT, CopyPlan, _nbytes


def _pairs(plan):
    return [(d, s) for ds, ss in plan.groups.values() for d, s in zip(ds, ss)]


def _bytes(plan):
    return sum(_nbytes(d, s) for d, s in _pairs(plan))


# ---- CopyPlan.split --------------------------------------------------------------------------------------------
@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.integers(1, 5000), min_size=1, max_size=8), n=st.integers(1, 9),
       cast=st.booleans(), transposed=st.booleans())
def test_split_covers_the_plan_once_in_balanced_parts(sizes, n, cast, transposed):
    srcs = [torch.randn(k) for k in sizes]
    if transposed:  # a non-contiguous pair goes whole
        srcs.append(torch.randn(9, 33).t())
    dsts = [torch.zeros_like(s, dtype=torch.bfloat16 if cast else s.dtype) for s in srcs]
    plan = CopyPlan(dsts, srcs)
    parts = plan.split(n)
    assert len(parts) == n
    assert sum(_bytes(p) for p in parts) == _bytes(plan)
    for p in parts:
        for d, s in _pairs(p):
            assert d.shape == s.shape
            base = next(x for x in dsts if x.untyped_storage().data_ptr() == d.untyped_storage().data_ptr())
            if d.numel() != base.numel():  # a cut view of a contiguous pair, starting at a multiple of _CUT
                assert base.is_contiguous() and d.storage_offset() % _CUT == 0
            d.add_(s.to(d.dtype))  # into zeros: an element in two parts would come out doubled
    assert all(torch.equal(d, s.to(d.dtype)) for d, s in zip(dsts, srcs))
    # no part is more than one cut (per pair) above its share
    per = max(d.element_size() + s.element_size() for d, s in zip(dsts, srcs))
    biggest_whole = max((_nbytes(d, s) for d, s in zip(dsts, srcs) if not d.is_contiguous()), default=0)
    for p in parts:
        assert _bytes(p) <= _bytes(plan) / n + 2 * _CUT * per * len(srcs) + biggest_whole


def test_split_of_a_large_tensor_is_even():
    src = torch.randn(1_000_003)
    parts = CopyPlan([torch.empty_like(src)], [src]).split(7)
    sizes = [_bytes(p) for p in parts]
    assert max(sizes) - min(sizes) <= 2 * _CUT * 8, sizes


def test_split_of_an_empty_plan():
    assert [_bytes(p) for p in CopyPlan([], []).split(3)] == [0, 0, 0]


# ---- the paced syncer ------------------------------------------------------------------------------------------
def _model(seed, layers=4):
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.LayerNorm(32)) for _ in range(layers)],
                         nn.Linear(32, 5))


class Spy:
    """Counts the parts each phase of a step issued (wraps ``syncer._issue``)."""

    def __init__(self, syncer):
        self.log = []
        inner = syncer._issue

        def issue(plan, side):
            self.log.append(_bytes(plan))
            inner(plan, side)
        syncer._issue = issue


@pytest.mark.parametrize("micro", [1, 3])
def test_paced_sync_trains_as_the_unpaced_one(micro):
    """slices=4 and slices=1 give the same reference (bit for bit, θ_t after step t's sync) and the same training;
    the parts go out at start(), during the forward and during the backward, none left for wait() once the step's
    points are learned (with gradient accumulation: over all micro-batches)."""
    runs = {}
    for slices in (1, 4):
        pol = _model(0)
        ref = copy.deepcopy(pol).requires_grad_(False)
        with torch.no_grad():
            for p in ref.parameters():
                p.zero_()
        syncer = hk.ReferenceSyncer(pol, ref, every=1, slices=slices)
        spy = Spy(syncer)
        opt = torch.optim.AdamW(pol.parameters(), lr=1e-2)
        g = torch.Generator().manual_seed(3)
        losses, phases = [], []
        for t in range(4):
            xs = [torch.randn(8, 32, generator=g) for _ in range(micro)]
            with torch.no_grad():
                refs = [ref(x) for x in xs]
            spy.log.clear()
            syncer.start()
            at = [len(spy.log)]
            for x, r in zip(xs, refs):
                out = pol(x)
                at.append(len(spy.log))
                loss = (out - r).square().mean() / micro
                loss.backward()
                at.append(len(spy.log))
                losses.append(loss.detach())
            theta = [p.detach().clone() for p in pol.parameters()]
            syncer.wait()
            at.append(len(spy.log))
            phases.append(at)
            assert all(torch.equal(r, p) for r, p in zip(ref.parameters(), theta)), (slices, t)
            opt.step()
            opt.zero_grad()
        runs[slices] = losses, [p.detach() for p in pol.parameters()]
        if slices == 4:
            leaves = 4 * 3 + 1
            assert syncer._pace.leaves == leaves
            assert syncer._pace.expect == 2 * leaves * micro  # one forward call and one gradient a leaf
            assert syncer._pace.issued["start"] == 1 and syncer._pace.issued["wait"] == 0
            assert syncer._pace.issued["points"] == 3
            for t, at in enumerate(phases):
                assert at[0] == 1, (t, at)  # part 0 at start()
                assert at[-1] == 4, (t, at)  # all four issued
                if t > 0 or micro == 1:  # learned (step 0 assumed one micro-batch)
                    assert at[-2] == 4, (t, at)  # none left for wait()
                    assert len(set(at[:-1])) >= 3, (t, at)  # parts in two phases at least after start()
                    if micro == 1:
                        assert at[1:3] == [3, 4], (t, at)  # 26 points, parts at 6, 13 (forward) and 19
    assert all(torch.equal(a, b) for a, b in zip(runs[1][0], runs[4][0]))
    assert all(torch.equal(a, b) for a, b in zip(runs[1][1], runs[4][1]))


def test_non_sync_steps_issue_nothing_and_count_nothing():
    pol, ref = _model(0), _model(1).requires_grad_(False)
    syncer = hk.ReferenceSyncer(pol, ref, every=2, slices=3)
    spy = Spy(syncer)
    x = torch.randn(4, 32)
    for t in range(4):
        before = [p.clone() for p in ref.parameters()]
        assert syncer.start() == (t % 2 == 0)
        pol(x).sum().backward()
        if t % 2:
            assert spy.log == [] and not syncer._pace.active
            assert all(torch.equal(a, b) for a, b in zip(before, ref.parameters()))
        syncer.wait()
        spy.log.clear()
    assert syncer._pace.expect == 2 * 13


def test_sync_without_points_warns_once_and_copies_everything():
    """sync() (start() + wait() with no forward between) cannot spread the parts: a warning, the whole copy, and
    from then on the parts go out together at start()."""
    pol, ref = _model(0), _model(1).requires_grad_(False)
    syncer = hk.ReferenceSyncer(pol, ref, slices=4)
    spy = Spy(syncer)
    with pytest.warns(RuntimeWarning, match="slices=4.*0 hook points"):
        syncer.sync()
    assert all(torch.equal(r, p) for r, p in zip(ref.parameters(), pol.parameters()))
    assert len(spy.log) == 4
    spy.log.clear()
    with torch.no_grad():
        for p in pol.parameters():
            p.add_(1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        syncer.start()
        assert len(spy.log) == 4  # learned: no point comes, so nothing waits for one
        syncer.wait()
    assert all(torch.equal(r, p) for r, p in zip(ref.parameters(), pol.parameters()))


def test_abort_mid_forward_completes_the_copy():
    pol, ref = _model(0), _model(1).requires_grad_(False)
    syncer = hk.ReferenceSyncer(pol, ref, slices=6)

    def boom(module, args, output):
        raise RuntimeError("boom")
    h = pol[2].register_forward_hook(boom)
    syncer.start()
    with pytest.raises(RuntimeError, match="boom"):
        pol(torch.randn(3, 32))
    h.remove()
    assert syncer._pace.pending  # part of the copy was still to go
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert syncer.abort() is True
    assert all(torch.equal(r, p) for r, p in zip(ref.parameters(), pol.parameters()))
    with pytest.raises(RuntimeError, match="restore the last checkpoint"):
        syncer.start()


def test_hooks_are_removed_with_the_syncer_and_by_refresh():
    pol, ref = _model(0), _model(1).requires_grad_(False)

    def hooked():
        return sum(len(m._forward_hooks) for m in pol.modules())
    syncer = hk.ReferenceSyncer(pol, ref, slices=2)
    assert hooked() == 0  # hooked at the first sync, not before
    syncer.start()
    pol(torch.randn(2, 32)).sum().backward()
    syncer.wait()
    assert hooked() == 13
    syncer.refresh()
    assert hooked() == 0
    syncer.start()
    pol(torch.randn(2, 32)).sum().backward()
    syncer.wait()
    assert hooked() == 13
    del syncer  # no cycle holds it: the hooks go at once, without a garbage collection
    assert hooked() == 0
    hk.ReferenceSyncer(pol, ref).sync()  # slices=1 hooks nothing
    assert hooked() == 0


@pytest.mark.parametrize("bad", [0, -2, True, 2.0, "4", None])
def test_bad_slices(bad):
    with pytest.raises(ValueError, match="slices must be a positive int"):
        hk.ReferenceSyncer(_model(0), _model(1), slices=bad)


def test_a_failing_part_is_never_lost():
    """A part whose copy raises stays to do: start() arms nothing (a later step issues no stale part), a point's
    failure leaves the part pending, and abort() completes the whole copy."""
    pol, ref = _model(0), _model(1).requires_grad_(False)
    syncer = hk.ReferenceSyncer(pol, ref, every=2, slices=4)
    inner, fail = syncer._issue, {"on": True}

    def issue(plan, side):
        if fail["on"]:
            raise RuntimeError("copy failed")
        inner(plan, side)
    syncer._issue = issue
    before = [p.clone() for p in ref.parameters()]
    with pytest.raises(RuntimeError, match="copy failed"):
        syncer.start()
    assert not syncer._pace.active and not syncer._pace.pending
    pol(torch.randn(2, 32)).sum().backward()  # points while nothing is armed: no copy
    assert all(torch.equal(a, b) for a, b in zip(before, ref.parameters()))
    fail["on"] = False
    syncer.start()  # the same step again (the counter did not move)
    fail["on"] = True
    with pytest.raises(RuntimeError, match="copy failed"):
        pol(torch.randn(2, 32)).sum().backward()  # the first point that issues a part fails
    left = len(syncer._pace.pending)
    assert left == 3
    fail["on"] = False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert syncer.abort() is True
    assert all(torch.equal(r, p) for r, p in zip(ref.parameters(), pol.parameters()))


def test_a_compiled_policy_counts_no_points_and_still_copies_everything():
    """Traced by torch.compile, the hooks count nothing (no copy baked into a graph): the step warns, the whole copy
    goes at wait(), and from then on at start()."""
    pol, ref = _model(0), _model(1).requires_grad_(False)
    compiled = torch.compile(pol, backend="eager")
    syncer = hk.ReferenceSyncer(pol, ref, slices=3)
    for t in range(2):
        syncer.start()
        compiled(torch.randn(2, 32)).sum().backward()
        theta = [p.detach().clone() for p in pol.parameters()]
        if t == 0:
            with pytest.warns(RuntimeWarning, match="0 hook points"):
                syncer.wait()
        else:
            syncer.wait()
            assert syncer._pace.issued == {"start": 3, "points": 0, "wait": 0}
        assert all(torch.equal(r, p) for r, p in zip(ref.parameters(), theta))
        with torch.no_grad():
            for p in pol.parameters():
                p.add_(0.1)
