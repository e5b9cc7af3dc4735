"""Every bad input of docs/design.md raises a ValueError naming the argument, before any work is done."""
import pytest
import torch

import humanline_kernels as hk


def _lp(B=2, T=3):
    return torch.randn(B, T), torch.randn(B, T), torch.ones(B, T, dtype=torch.bool)


def test_clip_band_reversed():
    with pytest.raises(ValueError, match="log_eps_p"):
        hk.HumanlineClip(log_eps_p=1.0, log_eps_r=-1.0)


def test_clip_nan():
    with pytest.raises(ValueError, match="log_eps_r"):
        hk.HumanlineClip(log_eps_r=float("nan"))


def test_clip_wrong_type():
    lp, ref, m = _lp()
    with pytest.raises(ValueError, match="clip"):
        hk.losses.dpo(lp, ref, m, clip=(-1.0, 1.0))


@pytest.mark.parametrize("level", [hk.reference, hk.losses])
def test_odd_dpo_rows(level):
    lp, ref, m = _lp(B=3)
    with pytest.raises(ValueError, match="even"):
        level.dpo(lp, ref, m)


@pytest.mark.parametrize("level", [hk.reference, hk.losses])
def test_ref_logps_wrong_shape(level):
    lp, ref, m = _lp()
    with pytest.raises(ValueError, match="ref_logps"):
        level.dpo(lp, ref[:, :2], m)


@pytest.mark.parametrize("level", [hk.reference, hk.losses])
def test_logps_not_2d(level):
    lp, ref, m = _lp()
    with pytest.raises(ValueError, match="logps"):
        level.grpo(lp[0], ref[0], torch.ones(2), m[0])


@pytest.mark.parametrize("level", [hk.reference, hk.losses])
def test_mask_not_bool(level):
    lp, ref, m = _lp()
    with pytest.raises(ValueError, match="mask"):
        level.dpo(lp, ref, m.float())


@pytest.mark.parametrize("level", [hk.reference, hk.losses])
def test_logps_dtype_mismatch(level):
    lp, ref, m = _lp()
    with pytest.raises(ValueError, match="ref_logps"):
        level.dpo(lp, ref.double(), m)


@pytest.mark.parametrize("level", [hk.reference, hk.losses])
def test_logps_half_dtype(level):
    lp, ref, m = _lp()
    with pytest.raises(ValueError, match="logps"):
        level.dpo(lp.half(), ref.half(), m)


@pytest.mark.parametrize("level", [hk.reference, hk.losses])
def test_device_mismatch(level):
    lp, ref, m = _lp()
    with pytest.raises(ValueError, match="device"):
        level.dpo(lp, ref.to("meta"), m)


@pytest.mark.parametrize("level", [hk.reference, hk.losses])
def test_advantages_wrong_shape(level):
    lp, ref, m = _lp()
    with pytest.raises(ValueError, match="advantages"):
        level.grpo(lp, ref, torch.ones(3), m)


@pytest.mark.parametrize("level", [hk.reference, hk.losses])
def test_unknown_loss_type(level):
    lp, ref, m = _lp()
    with pytest.raises(ValueError, match="loss_type"):
        level.grpo(lp, ref, torch.ones(2), m, loss_type="sum")


@pytest.mark.parametrize("level", [hk.reference, hk.losses])
def test_kto_desirable_not_bool(level):
    lp, ref, m = _lp()
    with pytest.raises(ValueError, match="desirable"):
        level.kto(lp, ref, m, torch.ones(2))


@pytest.mark.parametrize("level", [hk.reference, hk.losses])
def test_kto_partial_kl_inputs(level):
    lp, ref, m = _lp()
    with pytest.raises(ValueError, match="kl_logps"):
        level.kto(lp, ref, m, torch.ones(2, dtype=torch.bool), lp, None, None)


@pytest.mark.parametrize("level", [hk.reference, hk.losses])
def test_negative_beta(level):
    lp, ref, m = _lp()
    with pytest.raises(ValueError, match="beta"):
        level.dpo(lp, ref, m, beta=-0.1)


def test_label_smoothing_out_of_range():
    lp, ref, m = _lp()
    with pytest.raises(ValueError, match="label_smoothing"):
        hk.losses.dpo(lp, ref, m, label_smoothing=0.7)


def test_epsilon_out_of_range():
    lp, ref, m = _lp()
    with pytest.raises(ValueError, match="epsilon_low"):
        hk.losses.grpo(lp, ref, torch.ones(2), m, epsilon_low=1.5)


def test_max_completion_length_invalid():
    lp, ref, m = _lp()
    with pytest.raises(ValueError, match="max_completion_length"):
        hk.losses.grpo(lp, ref, torch.ones(2), m, loss_type="dr_grpo", max_completion_length=0)


# --- logits level -----------------------------------------------------------------------------------------------

LOGITS_FNS = {
    "token_logprobs": lambda lg, lab, **kw: hk.token_logprobs(lg, lab, **kw),
    "reference": lambda lg, lab, **kw: hk.reference.token_logprobs(lg, lab, **kw),
    "fused.dpo": lambda lg, lab, **kw: hk.fused.dpo(lg, lab, torch.zeros(lab.shape), **kw),
    "fused.grpo": lambda lg, lab, **kw: hk.fused.grpo(lg, lab, torch.zeros(lab.shape), torch.ones(lab.shape[0]), **kw),
}


@pytest.fixture(params=list(LOGITS_FNS), ids=list(LOGITS_FNS))
def fn(request):
    return LOGITS_FNS[request.param]


def test_labels_out_of_range(fn):
    lg, lab = torch.randn(2, 3, 5), torch.zeros(2, 3, dtype=torch.long)
    lab[1, 2] = 5
    with pytest.raises(ValueError, match="labels"):
        fn(lg, lab)


def test_labels_negative_not_ignore_index(fn):
    lg, lab = torch.randn(2, 3, 5), torch.zeros(2, 3, dtype=torch.long)
    lab[0, 0] = -1
    with pytest.raises(ValueError, match="labels"):
        fn(lg, lab)


def test_labels_wrong_dtype(fn):
    with pytest.raises(ValueError, match="labels"):
        fn(torch.randn(2, 3, 5), torch.zeros(2, 3, dtype=torch.int32))


def test_labels_wrong_shape(fn):
    with pytest.raises(ValueError, match="labels"):
        fn(torch.randn(2, 3, 5), torch.zeros(2, 4, dtype=torch.long))


def test_logits_noncontiguous_last_dim(fn):
    lg = torch.randn(2, 5, 3).transpose(1, 2)  # [2, 3, 5] with last stride 3
    with pytest.raises(ValueError, match="contiguous last dimension"):
        fn(lg, torch.zeros(2, 3, dtype=torch.long))


def test_logits_integer_dtype(fn):
    with pytest.raises(ValueError, match="logits"):
        fn(torch.zeros(2, 3, 5, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long))


def test_logits_labels_device_mismatch(fn):
    with pytest.raises(ValueError, match="device"):
        fn(torch.randn(2, 3, 5), torch.zeros(2, 3, dtype=torch.long, device="meta"))


def test_temperature_nonpositive(fn):
    with pytest.raises(ValueError, match="temperature"):
        fn(torch.randn(2, 3, 5), torch.zeros(2, 3, dtype=torch.long), temperature=0.0)


def test_validate_false_skips_only_the_range_check():
    # validate=False must not sync: an out-of-range label is then the caller's promise, shape checks still run
    lg, lab = torch.randn(2, 3, 5), torch.zeros(2, 3, dtype=torch.long)
    hk.token_logprobs(lg, lab, validate=False)
    with pytest.raises(ValueError, match="labels"):
        hk.token_logprobs(lg, lab[:, :2], validate=False)


def test_fused_ref_logps_wrong_shape():
    with pytest.raises(ValueError, match="ref_logps"):
        hk.fused.dpo(torch.randn(2, 3, 5), torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 2))


def test_fused_odd_dpo_rows():
    with pytest.raises(ValueError, match="even"):
        hk.fused.dpo(torch.randn(3, 3, 5), torch.zeros(3, 3, dtype=torch.long), torch.zeros(3, 3))


def test_nan_logits_propagate_as_nan():
    lg = torch.randn(2, 3, 5)
    lg[0, 1, 2] = float("nan")
    lab = torch.zeros(2, 3, dtype=torch.long)
    loss, _ = hk.fused.dpo(lg, lab, torch.zeros(2, 3))
    assert torch.isnan(loss)
