"""The ``verl.plugins`` entry point and the config path (verl environment; skipped without verl).

* a fresh interpreter that only imports verl finds ``loss_mode='humanline'`` registered (verl loads the entry
  point group on ``import verl``);
* ``actor.policy_loss`` with our ``_target_`` goes through verl's own ``omega_conf_to_dataclass`` (hydra
  instantiate) into a :class:`HumanlinePolicyLossConfig`, and a refused setting fails there, with its reason.
"""
import subprocess
import sys

import pytest

pytest.importorskip("verl")

from omegaconf import OmegaConf  # noqa: E402
from verl.utils.config import omega_conf_to_dataclass  # noqa: E402

from humanline_kernels.integrations.verl import HumanlinePolicyLossConfig  # noqa: E402

TARGET = "humanline_kernels.integrations.verl.HumanlinePolicyLossConfig"


def test_entry_point_registers_the_mode_in_a_fresh_process():
    code = ("import verl\n"
            "from verl.trainer.ppo.core_algos import get_policy_loss_fn\n"
            "from humanline_kernels.integrations.verl import humanline_policy_loss\n"
            "assert get_policy_loss_fn('humanline') is humanline_policy_loss\n"
            "from importlib.metadata import entry_points\n"
            "print(sorted(ep.value for ep in entry_points(group='verl.plugins')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "humanline_kernels.integrations.verl.plugin" in out.stdout


def actor_yaml(**policy_loss):
    return OmegaConf.create({
        "_target_": "verl.workers.config.FSDPActorConfig", "strategy": "fsdp", "rollout_n": 4,
        "ppo_micro_batch_size_per_gpu": 2, "use_kl_loss": True, "kl_loss_coef": 0.0,
        "policy_loss": {"_target_": TARGET, "loss_mode": "humanline", **policy_loss},
    })


def test_config_loads_through_verls_omega_conf_to_dataclass():
    actor = omega_conf_to_dataclass(actor_yaml(base_loss_mode="gspo", log_eps_p=-1.0, log_eps_r=1.5,
                                               sync_every=12, reference="sync", fused_logprobs=True))
    pl = actor.policy_loss
    assert isinstance(pl, HumanlinePolicyLossConfig)
    assert (pl.base_loss_mode, pl.log_eps_p, pl.log_eps_r, pl.sync_every, pl.fused_logprobs) == \
        ("gspo", -1.0, 1.5, 12, True)
    assert pl.clip == __import__("humanline_kernels").HumanlineClip(-1.0, 1.5)
    # verl's own fields keep their defaults (the subclass only adds)
    assert pl.clip_cov_ratio == 0.0002 and pl.rollout_correction is not None
    off = omega_conf_to_dataclass(actor_yaml(log_eps_p=None, log_eps_r=None)).policy_loss
    assert off.clip is None  # the clamp off: verl's own loss, its own numerical clamps included


def test_a_refused_setting_fails_while_verl_builds_the_config():
    with pytest.raises(Exception, match="base_loss_mode='dppo_tv' has no humanline variant: its trust region"):
        omega_conf_to_dataclass(actor_yaml(base_loss_mode="dppo_tv"))
