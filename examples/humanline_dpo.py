"""Humanline DPO with TRL on an offline preference file (jsonl: prompt / chosen / rejected).

CPU smoke run (tiny random-init model, the shipped toy dataset):
    python examples/humanline_dpo.py --max-steps 5
A real model on a GPU:
    python examples/humanline_dpo.py --model Qwen/Qwen2.5-0.5B-Instruct --data my_prefs.jsonl --bf16 --max-steps 500
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tiny  # noqa: E402

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "toy_preferences.jsonl")


def write_toy_preferences(path=DATA, n=48):
    """A toy arithmetic preference set: the chosen answer is right, the rejected one is off by one."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        for i in range(n):
            a, b = i % 7, (3 * i) % 5
            f.write(json.dumps({"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(a + b + 1)}) + "\n")
    return path


def make_parser(description=__doc__):
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", help="'tiny' (random-init, CPU) or a hub id / local path")
    p.add_argument("--data", default=None, help="jsonl with prompt/chosen/rejected (default: the toy file)")
    p.add_argument("--output-dir", default=None, help="default: a new temporary directory")
    p.add_argument("--max-steps", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--beta", type=float, default=0.1)
    p.add_argument("--sync-every", type=int, default=1)
    p.add_argument("--log-eps-p", type=float, default=-1.5)
    p.add_argument("--log-eps-r", type=float, default=1.5)
    p.add_argument("--fused", default="linear", choices=["linear", "logits", "off"])
    p.add_argument("--no-humanline", action="store_true", help="plain DPO through the same code path")
    p.add_argument("--bf16", action="store_true")
    return p


def main(argv=None):
    return train(make_parser().parse_args(argv))


def train(a, peft_config=None):
    """Train with the parsed flags ``a``; with ``peft_config`` the policy is a PEFT model (no reference model: the
    trainer keeps a synced reference adapter)."""
    import torch
    from datasets import load_dataset

    from humanline_kernels.integrations.trl import HumanlineDPOConfig, HumanlineDPOTrainer

    data = a.data or (DATA if os.path.exists(DATA) else write_toy_preferences())
    ds = load_dataset("json", data_files=data, split="train")
    tiny.quiet_trl_deprecations()
    model, tok = tiny.load(a.model, dtype=torch.bfloat16 if a.bf16 else torch.float32)
    # The tiny model has no hub id, so bring the reference ourselves (a real model's is loaded by TRL).
    ref = tiny.load(a.model, dtype=model.dtype)[0] if a.model == "tiny" and peft_config is None else None
    if ref is not None:
        ref.load_state_dict(model.state_dict())
    args = HumanlineDPOConfig(
        output_dir=tiny.output_dir(a.output_dir, "humanline-dpo"), max_steps=a.max_steps,
        per_device_train_batch_size=a.batch_size,
        learning_rate=a.lr, beta=a.beta, logging_steps=1, save_strategy="no", report_to=[], bf16=a.bf16,
        use_cpu=not torch.cuda.is_available(), **tiny.checkpointing_kwargs(a.model != "tiny"),
        # the three humanline fields (plus the fused log-prob path)
        humanline=not a.no_humanline, sync_every=a.sync_every, log_eps_p=a.log_eps_p, log_eps_r=a.log_eps_r,
        fused=a.fused,
    )
    trainer = HumanlineDPOTrainer(model, ref_model=ref, args=args, train_dataset=ds, processing_class=tok,
                                  peft_config=peft_config)
    trainer.train()
    last = [h for h in trainer.state.log_history if "loss" in h][-1]
    print(json.dumps({k: last[k] for k in ("loss", "rewards/margins", "humanline/unclipped_frac") if k in last}))
    return trainer


if __name__ == "__main__":
    main()
