"""The three arms and one training run of an arm.

From the same starting policy, the same prompts and the same number of examples per step:

* ``offline``: the behaviour model's scored samples (DPO, KTO) or, for GRPO, the policy's own samples drawn every
  ``resample_every`` steps (stale in between); reference = the frozen starting policy, no clamp (GRPO: the ratio
  against the policy that sampled);
* ``offline+humanline``: the same data; reference synced from the policy before each ``sync_every``-th update by
  ``hk.ReferenceSyncer``, every token's log-ratio clamped to ``[log_eps_p, log_eps_r]``;
* ``online``: completions sampled from the current policy every step and labelled by the same score (DPO/KTO
  reference = the frozen starting policy; GRPO on-policy, ratio 1).

Offline data and online samples are built by one function (:func:`label_groups`), so both are labelled alike: DPO
pairs the best of a prompt's ``GROUP`` samples with the worst, KTO labels the best desirable and the worst
undesirable (its KL rows are mismatched prompt/completion pairs), GRPO normalises the scores within the group.
"""
from __future__ import annotations

import copy
import time

import torch

import humanline_kernels as hk

from . import task

ARMS = ("offline", "offline+humanline", "online")
OBJECTIVES = ("dpo", "kto", "grpo")
GROUP = 4                   # samples per prompt, offline and online alike


# --------------------------------------------------------------------------------------------------- examples
def label_groups(prompts, seqs):
    """Score ``GROUP`` samples per prompt (rows grouped prompt-major) and build every objective's examples.

    DPO: best vs worst sample of each prompt; KTO: best desirable, worst undesirable; GRPO: group-normalised
    advantages. ``informative`` is False for prompts whose samples all score alike (no preference, zero advantage).
    """
    n = prompts.shape[0] // GROUP
    score = task.token_scores(prompts, seqs[:, task.PROMPT + 2:]).mean(1).view(n, GROUP)
    grouped = seqs.view(n, GROUP, -1)
    idx = torch.arange(n)
    best, worst = grouped[idx, score.argmax(1)], grouped[idx, score.argmin(1)]
    adv = (score - score.mean(1, keepdim=True)) / (score.std(1, keepdim=True) + 1e-2)
    return {"chosen": best, "rejected": worst, "adv": adv.flatten().to(seqs.device), "seqs": seqs,
            "informative": score.max(1).values > score.min(1).values}


def offline_pool(behaviour, n_prompts, gen, device):
    """The offline data set: the behaviour model's ``GROUP`` samples of ``n_prompts`` training prompts, as pairs."""
    prompts = task.sample_prompts(n_prompts, gen, device).repeat_interleave(GROUP, 0)
    ex = label_groups(prompts, task.generate(behaviour, prompts, gen))
    keep = ex["informative"]  # the offline data set keeps only pairs with a preference, as a dataset would
    return {"chosen": ex["chosen"][keep], "rejected": ex["rejected"][keep]}


def dpo_batch(chosen, rejected, use=None):
    """Chosen rows then rejected rows; pairs with ``use`` False are fully masked (they contribute nothing)."""
    seqs = torch.cat([chosen, rejected])
    labels = task.labels_for(seqs)
    if use is not None:
        labels[~torch.cat([use, use]).to(labels.device)] = -100
    return {"seqs": seqs, "labels": labels}


def kto_batch(chosen, rejected, use=None):
    """Half desirable (best), half undesirable (worst); KL rows: completions shifted by one row."""
    b = dpo_batch(chosen, rejected, use)
    seqs = b["seqs"]
    kl = torch.cat([seqs[:, :task.PROMPT + 2], seqs.roll(1, 0)[:, task.PROMPT + 2:]], 1)
    n = chosen.shape[0]
    desirable = torch.cat([torch.ones(n), torch.zeros(n)]).bool().to(seqs.device)
    return {**b, "desirable": desirable, "kl_seqs": kl, "kl_labels": task.labels_for(kl)}


def _token_logps(model, seqs, labels):
    return hk.token_logprobs(model(seqs, use_cache=False).logits[:, :-1], labels)


class Source:
    """Where an arm's examples come from: the fixed offline pool, the current policy, or (GRPO) stale samples."""

    def __init__(self, arm, objective, pool, batch, gen, device, resample_every):
        self.arm, self.objective, self.pool, self.batch = arm, objective, pool, batch
        self.gen, self.device, self.resample_every = gen, device, resample_every
        self.buffer, self.sample_s = [], 0.0

    def _sample(self, policy, prompts_n):
        t = time.perf_counter()
        prompts = task.sample_prompts(prompts_n, self.gen, self.device).repeat_interleave(GROUP, 0)
        ex = label_groups(prompts, task.generate(policy, prompts, self.gen))
        if self.objective == "grpo":  # the sampling policy's log-probs: the ratio's denominator off-policy
            ex["labels"] = task.labels_for(ex["seqs"])
            with torch.no_grad():
                ex["old_logps"] = _token_logps(policy, ex["seqs"], ex["labels"])
        self.sample_s += time.perf_counter() - t
        return ex

    def next(self, step, policy):
        if self.objective == "grpo":
            groups = max(1, self.batch // GROUP)
            if self.arm == "online":
                return self._sample(policy, groups)
            if step % self.resample_every == 0:  # one draw of resample_every steps' examples, used in order
                self.buffer = [self._sample(policy, groups * self.resample_every)]
            ex, rows = self.buffer[0], groups * GROUP
            i = (step % self.resample_every) * rows
            return {k: ex[k][i:i + rows] for k in ("seqs", "adv", "labels", "old_logps")}
        pairs = self.batch // 2  # dpo: chosen + rejected rows; kto: as many desirable as undesirable rows
        build = dpo_batch if self.objective == "dpo" else kto_batch
        if self.arm == "online":
            ex = self._sample(policy, pairs)
            return build(ex["chosen"], ex["rejected"], ex["informative"])
        idx = torch.randint(0, self.pool["chosen"].shape[0], (pairs,), generator=self.gen)
        return build(self.pool["chosen"][idx], self.pool["rejected"][idx])


# ------------------------------------------------------------------------------------------------ one run
def train_arm(arm, objective, start, pool, *, lr, seed, steps, batch, clip, sync_every, resample_every, device,
              eval_every, eval_n, curve_n, max_grad_norm=1.0):
    """Train one arm from ``start``; returns its curve, held-out and reported rule rates and costs."""
    humanline = arm == "offline+humanline"
    gen = torch.Generator().manual_seed(seed)
    policy = copy.deepcopy(start)
    reference = copy.deepcopy(start).requires_grad_(False)
    opt = torch.optim.AdamW(policy.parameters(), lr=lr)
    syncer = hk.ReferenceSyncer(policy, reference, every=sync_every) if humanline else None
    source = Source(arm, objective, pool, batch, gen, device, resample_every)
    use_clip = clip if humanline else None
    eval_seed = 10_000 + seed  # the same evaluation samples for every arm and learning rate of a seed
    curve, clipped, losses, syncs = [], [], [], 0
    train_s = 0.0
    for step in range(steps):
        if step % eval_every == 0:
            curve.append((step, task.rule_rate(policy, torch.Generator().manual_seed(eval_seed + step), device,
                                               curve_n)))
        t = time.perf_counter()
        b = source.next(step, policy)
        with torch.no_grad():
            if objective != "grpo" or humanline:
                ref_logps = _token_logps(reference, b["seqs"], b["labels"])
            if objective == "kto":
                kl_ref = _token_logps(reference, b["kl_seqs"], b["kl_labels"])
                kl_pol = _token_logps(policy, b["kl_seqs"], b["kl_labels"])
        if syncer is not None:
            syncer.start()  # after the last reference forward of this step
        logits = policy(b["seqs"], use_cache=False).logits[:, :-1]
        if objective == "dpo":
            loss, m = hk.fused.dpo(logits, b["labels"], ref_logps, clip=use_clip, beta=0.1)
        elif objective == "kto":
            loss, m = hk.fused.kto(logits, b["labels"], ref_logps, b["desirable"], kl_pol, kl_ref,
                                   b["kl_labels"] != -100, clip=use_clip, beta=0.1)
        else:
            if not humanline:  # off-policy: the sampler's log-probs; online they equal the policy's (ratio 1)
                ref_logps = (b["old_logps"] if arm == "offline" else
                             hk.token_logprobs(logits.detach(), b["labels"]))
            loss, m = hk.fused.grpo(logits, b["labels"], ref_logps, b["adv"], clip=use_clip, beta=0.0)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), max_grad_norm)
        if syncer is not None:
            syncs += syncer.wait()  # on a sync step the reference now holds the policy from before this update
        opt.step()
        train_s += time.perf_counter() - t
        losses.append(loss.detach())
        if humanline:
            clipped.append(1.0 - m["unclipped_frac"])
    curve.append((steps, task.rule_rate(policy, torch.Generator().manual_seed(eval_seed + steps), device, curve_n)))
    return {"arm": arm, "lr": lr, "seed": seed, "curve": curve,
            "heldout": task.rule_rate(policy, torch.Generator().manual_seed(eval_seed + 1), device, eval_n,
                                      "heldout"),
            "report": task.rule_rate(policy, torch.Generator().manual_seed(eval_seed + 2), device, eval_n, "report"),
            "clip_frac": torch.stack(clipped).float().mean().item() if clipped else None,
            "syncs": syncs, "wall_s": train_s, "sample_s": source.sample_s,
            "losses": torch.stack(losses).float().tolist()}  # one host sync, after training
