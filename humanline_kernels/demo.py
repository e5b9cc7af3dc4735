"""Humanline in miniature: offline vs offline+humanline vs online DPO / KTO / GRPO on a tiny Llama, tuned fairly.

``python -m humanline_kernels.demo [--objective dpo|kto|grpo] [--steps N] [--seeds S] [--lrs a,b,c] ...``

The paper's experiment (arXiv 2509.24207, Sec. 5, App. D) in miniature, measured rather than asserted:

* the task: a prompt is ``BOS p1 .. p4 SEP`` over ``K`` symbols; a completion follows the rule when it counts up
  from the last prompt symbol (``c1 = p4 + 1``, ``c_{i+1} = c_i + 1`` mod ``K``) and then ends (``EOS``). The
  score of a completion is its fraction of rule-following tokens; the reported *rule rate* is the fraction of
  the policy's own samples (temperature 1) that follow the rule exactly.
* the models: two tiny random-init Llamas, each first fitted by a few SFT steps to a different noisy version of
  the rule: the *behaviour* model (whole completions right about half the time) produces the offline data; the
  other one (token-level noise, rarely right end to end) is the starting policy of every arm.
* offline data, for DPO and KTO: the behaviour model's samples of the training prompts, ``G`` per prompt, scored;
  DPO pairs the best with the worst, KTO labels the best desirable and the worst undesirable (its KL rows are
  mismatched prompt/completion pairs). For GRPO, as in the paper's less-frequent-sampling experiment, offline
  data are the policy's own samples drawn every ``--resample-every`` steps (stale in between).
* the arms, from the same starting policy, the same prompts and the same number of examples per step:
  ``offline`` (reference = the frozen starting policy, no clamp; GRPO: the ratio against the policy that sampled),
  ``offline+humanline`` (the same data; reference synced from the policy before each ``--sync-every``-th update
  by ``hk.ReferenceSyncer``, every token's log-ratio clamped to ``[log_eps_p, log_eps_r]``) and ``online``
  (completions sampled from the current policy every step and labelled by the same score; DPO/KTO reference =
  the frozen starting policy; GRPO on-policy, ratio 1).
* fair tuning: every arm trains at every learning rate of the same grid (``--lrs``) for every seed; each arm is
  reported at the learning rate with the best mean rule rate on a held-out set of prompts, and the reported rule
  rate comes from a disjoint set (the prompts' first symbol splits train / held-out / reported). Seeds vary the
  training order, the online samples and the evaluation samples; the behaviour model, the starting policy and
  the offline data are fixed by ``--seed``.

It prints the table (rule rate mean +- standard error over seeds, held-out rate, mean fraction of clamped tokens,
reference syncs, wall time per run with sampling included, best learning rate), a ``verdict:`` line computed from
those numbers, and writes a plot of the rule rate over training (``--plot``; ``--no-plot``). Whatever it
measures is what it reports. On CUDA the losses run through the fused Triton kernels (``hk.fused``), on CPU
through the eager path.

Runs are seeded: the same settings, torch version and CPU rounding give the same numbers. The rounding is the
CPU's vector instruction set as ATen and MKL use it (printed beside ``device=cpu``): 60 steps of AdamW amplify a
last-bit difference into different samples, so another instruction set gives other numbers, further apart than
the seeds' standard errors suggest. ``--objective all`` runs the three objectives in turn, ``--markdown`` prints
README's table rows for the run, ``--save PATH`` merges it into the JSON record that README's demo table is
written from (``python -m bench report --readme``), with a canary: a tiny run of every objective under pinned
rounding whose losses CI repeats (tests/test_readme.py: the bits on a CPU model the record has them for, within
round-off on another; ``--add-canary PATH`` keeps this CPU's), so that the record cannot silently stop describing
the code.
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import os
import platform
import subprocess
import sys
import time

import torch

import humanline_kernels as hk

PAD, BOS, SEP, EOS = 0, 1, 2, 3
K = 12                      # symbols 4 .. 4+K-1
PROMPT, COMPL = 4, 5        # prompt symbols, completion symbols (+ EOS)
VOCAB = 4 + K
GROUP = 4                   # samples per prompt, offline and online alike
SPLITS = {"train": (0, 1), "heldout": (2,), "report": (3,)}  # by first prompt symbol mod 4
ARMS = ("offline", "offline+humanline", "online")
DEFAULT_LRS = (3e-4, 1e-3, 3e-3)


def _make_model(seed, device):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                      bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).to(device)


def sample_prompts(n, gen, device, split="train"):
    """``n`` prompts of one split: train, held-out and reported prompts never share a first symbol class."""
    classes = torch.tensor(SPLITS[split])
    first = classes[torch.randint(0, len(classes), (n, 1), generator=gen)] + 4 * torch.randint(0, K // 4, (n, 1),
                                                                                                generator=gen)
    rest = torch.randint(0, K, (n, PROMPT - 1), generator=gen)
    bos, sep = torch.full((n, 1), BOS), torch.full((n, 1), SEP)
    return torch.cat([bos, first + 4, rest + 4, sep], 1).to(device)


def rule_completion(prompts):
    last = prompts[:, PROMPT:PROMPT + 1].cpu() - 4
    return (last + torch.arange(1, COMPL + 1).unsqueeze(0)) % K + 4


def token_scores(prompts, completions):
    """Per completion token: 1 where it follows the rule (EOS at the end counts too)."""
    want = torch.cat([rule_completion(prompts), torch.full((prompts.shape[0], 1), EOS)], 1)
    return (completions.cpu() == want).float()


def noisy_sequences(prompts, p_rule, gen, p_whole=0.0):
    """Rule completions with noise: each token kept with ``p_rule``; a row is kept whole with ``p_whole``."""
    n = prompts.shape[0]
    target = rule_completion(prompts)
    noise = torch.randint(0, K, target.shape, generator=gen) + 4
    keep = (torch.rand(target.shape, generator=gen) < p_rule) | (torch.rand((n, 1), generator=gen) < p_whole)
    comp = torch.where(keep, target, noise)
    return torch.cat([prompts.cpu(), comp, torch.full((n, 1), EOS)], 1).to(prompts.device)


def labels_for(seqs):
    """Next-token labels aligned with ``logits[:, :-1]``: only completion tokens count."""
    labels = seqs[:, 1:].clone()
    labels[:, :PROMPT + 1] = -100
    return labels


def fit_sft(model, steps, gen, device, p_rule, p_whole=0.0, lr=3e-3):
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    for _ in range(steps):
        seqs = noisy_sequences(sample_prompts(64, gen, device), p_rule, gen, p_whole)
        logits = model(seqs).logits[:, :-1]
        loss = -hk.token_logprobs(logits, labels_for(seqs)).sum() / (COMPL + 1) / seqs.shape[0]
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model


@torch.no_grad()
def generate(model, prompts, gen):
    """Sample completions at temperature 1 (plain loop: the models are tiny)."""
    was_training = model.training
    model.eval()
    seqs = prompts
    for _ in range(COMPL + 1):
        logits = model(seqs).logits[:, -1].float()
        probs = torch.softmax(logits, -1).cpu()
        nxt = torch.multinomial(probs, 1, generator=gen).to(seqs.device)
        seqs = torch.cat([seqs, nxt], 1)
    model.train(was_training)
    return seqs


def rule_rate(model, gen, device, n=512, split="report"):
    prompts = sample_prompts(n, gen, device, split)
    seqs = generate(model, prompts, gen)
    return token_scores(prompts, seqs[:, PROMPT + 2:]).min(1).values.mean().item()


# ---------------------------------------------------------------------------------------------------------------
# examples: one construction for the offline data and the online samples, so both are labelled the same way


def label_groups(prompts, seqs):
    """Score ``GROUP`` samples per prompt (rows grouped prompt-major) and build every objective's examples.

    DPO: best vs worst sample of each prompt; KTO: best desirable, worst undesirable; GRPO: group-normalised
    advantages. ``informative`` is False for prompts whose samples all score alike (no preference, zero advantage).
    """
    n = prompts.shape[0] // GROUP
    score = token_scores(prompts, seqs[:, PROMPT + 2:]).mean(1).view(n, GROUP)
    grouped = seqs.view(n, GROUP, -1)
    idx = torch.arange(n)
    best, worst = grouped[idx, score.argmax(1)], grouped[idx, score.argmin(1)]
    adv = (score - score.mean(1, keepdim=True)) / (score.std(1, keepdim=True) + 1e-2)
    return {"chosen": best, "rejected": worst, "adv": adv.flatten().to(seqs.device), "seqs": seqs,
            "informative": score.max(1).values > score.min(1).values}


def offline_pool(behaviour, n_prompts, gen, device):
    prompts = sample_prompts(n_prompts, gen, device).repeat_interleave(GROUP, 0)
    ex = label_groups(prompts, generate(behaviour, prompts, gen))
    keep = ex["informative"]  # the offline data set keeps only pairs with a preference, as a dataset would
    return {"chosen": ex["chosen"][keep], "rejected": ex["rejected"][keep]}


def dpo_batch(chosen, rejected, use=None):
    """Chosen rows then rejected rows; pairs with ``use`` False are fully masked (they contribute nothing)."""
    seqs = torch.cat([chosen, rejected])
    labels = labels_for(seqs)
    if use is not None:
        labels[~torch.cat([use, use]).to(labels.device)] = -100
    return {"seqs": seqs, "labels": labels}


def kto_batch(chosen, rejected, use=None):
    """Half desirable (best), half undesirable (worst); KL rows: completions shifted by one row."""
    b = dpo_batch(chosen, rejected, use)
    seqs = b["seqs"]
    kl = torch.cat([seqs[:, :PROMPT + 2], seqs.roll(1, 0)[:, PROMPT + 2:]], 1)
    n = chosen.shape[0]
    desirable = torch.cat([torch.ones(n), torch.zeros(n)]).bool().to(seqs.device)
    return {**b, "desirable": desirable, "kl_seqs": kl, "kl_labels": labels_for(kl)}


# ---------------------------------------------------------------------------------------------------------------
# one training run


def _token_logps(model, seqs, labels, grad):
    with torch.set_grad_enabled(grad):
        return hk.token_logprobs(model(seqs).logits[:, :-1], labels)


class _Source:
    """Where an arm's examples come from: the fixed offline pool, the current policy, or (GRPO) stale samples."""

    def __init__(self, arm, objective, pool, batch, gen, device, resample_every):
        self.arm, self.objective, self.pool, self.batch = arm, objective, pool, batch
        self.gen, self.device, self.resample_every = gen, device, resample_every
        self.buffer, self.sample_s = [], 0.0

    def _sample(self, policy, prompts_n):
        t = time.perf_counter()
        prompts = sample_prompts(prompts_n, self.gen, self.device).repeat_interleave(GROUP, 0)
        ex = label_groups(prompts, generate(policy, prompts, self.gen))
        if self.objective == "grpo":  # the sampling policy's log-probs: the ratio's denominator off-policy
            ex["labels"] = labels_for(ex["seqs"])
            with torch.no_grad():
                ex["old_logps"] = _token_logps(policy, ex["seqs"], ex["labels"], False)
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


def train_arm(arm, objective, start, pool, *, lr, seed, steps, batch, clip, sync_every, resample_every, device,
              eval_every, eval_n, curve_n, max_grad_norm=1.0):
    """Train one arm from ``start``; returns its curve, held-out and reported rule rates and costs."""
    humanline = arm == "offline+humanline"
    gen = torch.Generator().manual_seed(seed)
    policy = copy.deepcopy(start)
    reference = copy.deepcopy(start).requires_grad_(False)
    opt = torch.optim.AdamW(policy.parameters(), lr=lr)
    syncer = hk.ReferenceSyncer(policy, reference, every=sync_every) if humanline else None
    source = _Source(arm, objective, pool, batch, gen, device, resample_every)
    use_clip = clip if humanline else None
    eval_seed = 10_000 + seed  # the same evaluation samples for every arm and learning rate of a seed
    curve, clipped, losses, syncs = [], [], [], 0
    train_s = 0.0
    for step in range(steps):
        if step % eval_every == 0:
            curve.append((step, rule_rate(policy, torch.Generator().manual_seed(eval_seed + step), device, curve_n)))
        t = time.perf_counter()
        b = source.next(step, policy)
        with torch.no_grad():
            if objective != "grpo" or humanline:
                ref_logps = _token_logps(reference, b["seqs"], b["labels"], False)
            if objective == "kto":
                kl_ref = _token_logps(reference, b["kl_seqs"], b["kl_labels"], False)
                kl_pol = _token_logps(policy, b["kl_seqs"], b["kl_labels"], False)
        if syncer is not None:
            syncer.start()  # after the last reference forward of this step
        logits = policy(b["seqs"]).logits[:, :-1]
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
    curve.append((steps, rule_rate(policy, torch.Generator().manual_seed(eval_seed + steps), device, curve_n)))
    return {"arm": arm, "lr": lr, "seed": seed, "curve": curve,
            "heldout": rule_rate(policy, torch.Generator().manual_seed(eval_seed + 1), device, eval_n, "heldout"),
            "report": rule_rate(policy, torch.Generator().manual_seed(eval_seed + 2), device, eval_n, "report"),
            "clip_frac": torch.stack(clipped).float().mean().item() if clipped else None,
            "syncs": syncs, "wall_s": train_s, "sample_s": source.sample_s,
            "losses": torch.stack(losses).float().tolist()}  # one host sync, after training


# ---------------------------------------------------------------------------------------------------------------
# tuning, table, verdict, plot


def _mean_se(xs):
    xs = [float(x) for x in xs]
    m = sum(xs) / len(xs)
    if len(xs) < 2:
        return m, float("nan")
    var = sum((x - m) ** 2 for x in xs) / (len(xs) - 1)
    return m, math.sqrt(var / len(xs))


def select_best(runs):
    """Per arm, the learning rate with the best mean held-out rule rate (ties: the smaller learning rate).

    Only ``heldout`` decides; the returned rows summarise that learning rate's runs on the reported set."""
    best = {}
    for arm in dict.fromkeys(r["arm"] for r in runs):
        mine = [r for r in runs if r["arm"] == arm]
        lrs = sorted({r["lr"] for r in mine})
        score = {lr: _mean_se([r["heldout"] for r in mine if r["lr"] == lr])[0] for lr in lrs}
        lr = max(lrs, key=lambda x: (score[x], -x))
        chosen = [r for r in mine if r["lr"] == lr]
        rate, se = _mean_se([r["report"] for r in chosen])
        clip = [r["clip_frac"] for r in chosen if r["clip_frac"] is not None]
        best[arm] = {"arm": arm, "lr": lr, "rule_rate": rate, "se": se, "heldout": score[lr],
                     "clip_frac": sum(clip) / len(clip) if clip else None,
                     "syncs": chosen[0]["syncs"], "wall_s": _mean_se([r["wall_s"] for r in chosen])[0],
                     "sample_s": _mean_se([r["sample_s"] for r in chosen])[0], "runs": chosen}
    return best


def verdict(best, objective):
    """One plain sentence from the numbers: offline+humanline against online (rate and time) and offline."""
    hl, on, off = best["offline+humanline"], best["online"], best["offline"]

    def compare(a, b, name):
        diff, se = a["rule_rate"] - b["rule_rate"], math.hypot(a["se"], b["se"])
        if not se > 0:
            return f"{'equal to' if diff == 0 else ('above' if diff > 0 else 'below')} {name} ({b['rule_rate']:.3f})"
        if abs(diff) <= se:
            return f"within 1 s.e. of {name} ({b['rule_rate']:.3f} +- {b['se']:.3f})"
        return (f"{'above' if diff > 0 else 'below'} {name} ({b['rule_rate']:.3f} +- {b['se']:.3f}) by "
                f"{abs(diff):.3f} = {abs(diff) / se:.1f} s.e.")
    speed = on["wall_s"] / hl["wall_s"] if hl["wall_s"] > 0 else float("inf")
    pace = f"{speed:.1f}x faster than online" if speed >= 1 else f"{1 / speed:.1f}x slower than online"
    line = (f"verdict: offline+humanline {objective.upper()} reaches a rule rate of {hl['rule_rate']:.3f} +- "
            f"{hl['se']:.3f}, {compare(hl, on, 'online')} and {pace}; {compare(hl, off, 'plain offline')}")
    return line.rstrip(".") + "."


def print_table(best, info, out):
    print(f"\nhumanline demo: {info['objective']}, {info['steps']} steps x {info['batch']} sequences, "
          f"{info['seeds']} seeds, learning rates {', '.join(f'{x:g}' for x in info['lrs'])}, device={info['device']}"
          + (f" ({info['cpu']})" if info.get("cpu") else "") + "; "
          f"clip [{info['clip'].log_eps_p}, {info['clip'].log_eps_r}], sync every {info['sync_every']}"
          + (f", offline samples redrawn every {info['resample_every']} steps" if info["objective"] == "grpo" else "")
          + f"; setup {info['setup_s']:.1f}s, total {info['total_s']:.1f}s with {info['workers']} process(es)",
          file=out)
    print(f"rule rate of the behaviour model (offline data) {info['behaviour']:.3f}, "
          f"of the starting policy {info['start']:.3f}", file=out)
    head = (f"{'arm':<18} {'rule_rate':>15} {'heldout':>8} {'clip_frac':>9} {'syncs':>5} {'wall_s':>7} "
            f"{'sample_s':>8} {'best_lr':>8}")
    print(head, file=out)
    print("-" * len(head), file=out)
    for arm in ARMS:
        r = best[arm]
        cf = "off" if r["clip_frac"] is None else f"{r['clip_frac']:.3f}"
        rate = f"{r['rule_rate']:.3f} +- {r['se']:.3f}"
        print(f"{arm:<18} {rate:>15} {r['heldout']:>8.3f} {cf:>9} {r['syncs']:>5} {r['wall_s']:>7.2f} "
              f"{r['sample_s']:>8.2f} {r['lr']:>8.0e}", file=out)
    print("rule_rate: reported prompts, mean +- s.e. over seeds at the arm's best learning rate (chosen on the "
          "held-out prompts: heldout); clip_frac: mean fraction of tokens clamped; wall_s: seconds per run of "
          "training, sampling included (sample_s).", file=out)


def plot(best, path, info):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "plot skipped: matplotlib is not installed (pip install matplotlib)"
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for arm in ARMS:
        runs = best[arm]["runs"]
        steps = [s for s, _ in runs[0]["curve"]]
        stats = [_mean_se([r["curve"][i][1] for r in runs]) for i in range(len(steps))]
        mean = [m for m, _ in stats]
        se = [0.0 if s != s else s for _, s in stats]
        line, = ax.plot(steps, mean, marker="o", ms=3, label=f"{arm} (lr {best[arm]['lr']:g})")
        ax.fill_between(steps, [m - s for m, s in zip(mean, se)], [m + s for m, s in zip(mean, se)],
                        color=line.get_color(), alpha=0.2)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("rule rate of own samples")
    ax.set_title(f"{info['objective'].upper()}: {info['seeds']} seeds, mean +- s.e., best lr per arm")
    ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"plot: {path}"


def _workers(asked, device, jobs):
    """CPU: one process per core (up to 4), one thread each: the models are so small that intra-op threads
    only add overhead, while the runs of the grid are independent. CUDA: one process."""
    if asked is not None:
        return max(1, min(asked, jobs))
    if device != "cpu":
        return 1
    return max(1, min(_cores(), 4, jobs))


def _cores():
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _worker_init(threads):
    torch.set_num_threads(threads)


def _worker_run(job):
    arm, lr, s, state, pool, common = job
    start = _make_model(0, common["device"])
    start.load_state_dict(state)
    return train_arm(arm, start=start, pool=pool, lr=lr, seed=s, **common)


def _run_pool(grid, start, pool, common, workers, bar):
    import concurrent.futures as cf
    import multiprocessing as mp

    state = {k: v.detach().cpu() for k, v in start.state_dict().items()}
    # spawn, not fork: a forked child of a process that already ran torch's thread pools can deadlock
    ctx = mp.get_context("spawn")
    with cf.ProcessPoolExecutor(workers, mp_context=ctx, initializer=_worker_init, initargs=(1,)) as ex:
        futures = {ex.submit(_worker_run, (arm, lr, s, state, pool, common)): i
                   for i, (arm, lr, s) in enumerate(grid)}
        runs = [None] * len(grid)
        for f in bar(cf.as_completed(futures), len(futures)):
            runs[futures[f]] = f.result()
    return runs


def run(objective="dpo", steps=60, seeds=3, lrs=DEFAULT_LRS, seed=0, device="auto", batch=16, sft_steps=100,
        eval_n=256, clip=None, sync_every=None, resample_every=10, plot_path=None, workers=None, quiet=False,
        out=sys.stdout, pool_prompts=512):
    """Run the three arms over the learning-rate grid and seeds; print the table and verdict; return the numbers."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    clip = clip or hk.HumanlineClip()
    # the paper's defaults: sync every step for instruction following, every 12-24 steps for GRPO
    sync_every = sync_every or (12 if objective == "grpo" else 1)
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover
        def tqdm(it, **_):
            return it
    threads = torch.get_num_threads()
    if device == "cpu":
        torch.set_num_threads(1)  # tiny models: one thread per process is faster (see _workers)
    try:
        return _run(objective, steps, seeds, lrs, seed, device, batch, sft_steps, eval_n, clip, sync_every,
                    resample_every, plot_path, workers, quiet, out, tqdm, pool_prompts)
    finally:
        torch.set_num_threads(threads)


def _run(objective, steps, seeds, lrs, seed, device, batch, sft_steps, eval_n, clip, sync_every, resample_every,
         plot_path, workers, quiet, out, tqdm, pool_prompts):
    t0 = time.perf_counter()
    gen = torch.Generator().manual_seed(seed)
    behaviour = fit_sft(_make_model(seed + 1, device), sft_steps, gen, device, p_rule=0.3, p_whole=0.5)
    start = fit_sft(_make_model(seed + 2, device), sft_steps, gen, device, p_rule=0.6)
    pool = offline_pool(behaviour, pool_prompts, gen, device) if objective != "grpo" else None
    info = {"objective": objective, "steps": steps, "batch": batch, "seeds": seeds, "lrs": list(lrs), "seed": seed,
            "sft_steps": sft_steps, "eval_n": eval_n, "device": device,
            "cpu": cpu_capability() if device == "cpu" else None, "clip": clip, "sync_every": sync_every,
            "resample_every": resample_every,
            "behaviour": rule_rate(behaviour, torch.Generator().manual_seed(seed), device, eval_n),
            "start": rule_rate(start, torch.Generator().manual_seed(seed), device, eval_n)}
    info["setup_s"] = time.perf_counter() - t0
    grid = [(arm, lr, seed * 1000 + s) for s in range(seeds) for lr in lrs for arm in ARMS]
    common = dict(objective=objective, steps=steps, batch=batch, clip=clip, sync_every=sync_every,
                  resample_every=resample_every, device=device, eval_every=max(1, steps // 6), eval_n=eval_n,
                  curve_n=min(eval_n, 128))
    bar = (lambda it, total: it) if quiet else (
        lambda it, total: tqdm(it, total=total, desc=f"{objective}: arms x lrs x seeds", leave=False))
    workers = _workers(workers, device, len(grid))
    if workers == 1:
        runs = [train_arm(arm, start=start, pool=pool, lr=lr, seed=s, **common) for arm, lr, s in bar(grid, len(grid))]
    else:
        runs = _run_pool(grid, start, pool, common, workers, bar)
    info["workers"] = workers
    best = select_best(runs)
    info["total_s"] = time.perf_counter() - t0
    print_table(best, info, out)
    line = verdict(best, objective)
    print(line, file=out)
    shown = plot(best, plot_path, info) if plot_path else None
    if shown:
        print(shown, file=out)
    return {"best": best, "runs": runs, "info": info, "verdict": line}


# ---------------------------------------------------------------------------------------------------------------
# the record that README's table is written from (--save), its markdown (--markdown), and the canary

OBJECTIVES = ("dpo", "kto", "grpo")
# settings whose values change what a run measures (flags such as --workers, --plot or --quiet do not)
SETTINGS = ("steps", "seeds", "lrs", "seed", "batch", "sync_every", "resample_every", "sft_steps", "eval_n",
            "log_eps_p", "log_eps_r")
# environment variables that change the rounding of a CPU run, and so its numbers: the 60-step runs amplify
# round-off (README's table records a run with ATEN_CPU_CAPABILITY=avx2 on an AVX512 CPU beside the native one)
NUMERIC_ENV = ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "MKL_ENABLE_INSTRUCTIONS", "TRITON_INTERPRET")
# the canary: a tiny run of every objective whose per-step losses fingerprint the numerics behind the table, run
# with the CPU's rounding pinned (ATen's scalar kernels, MKL's reproducible mode, one thread); seconds, where the
# table's runs take minutes. The pinning does not make every x86 CPU give the same bits: the record's canary and
# the same code's on an Intel family 6 model 106 differ by up to 9e-7 relative in 11 of 18 runs' losses, although
# MKL's CNR SGEMM is the demo's only MKL call and neither libm's FMA paths nor oneDNN change a bit here. So the
# record keeps the bits of each CPU a canary was measured on (exact there), and on another CPU the losses must be
# within CANARY_RTOL: 5x the round-off of MKL's other code paths (MKL_CBWR=AVX2: 1.8e-6) and 6x below what a 1e-5
# relative change of the learning rate moves them (6.6e-5), measured here on 2026-11-28
CANARY = dict(steps=3, seeds=2, lrs=(3e-3,), sft_steps=3, eval_n=16, batch=8, sync_every=1, resample_every=2,
              pool_prompts=32)
CANARY_ENV = {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE", "TRITON_INTERPRET": "0",
              "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
CANARY_RTOL = 1e-5
ROW_HEADER = ("objective", "offline", "offline+humanline", "online", "humanline vs online (wall time)",
              "humanline vs offline")


def cpu_capability():
    """The vector instruction set ATen dispatches to on this CPU (AVX512, AVX2, DEFAULT ...)."""
    return torch.backends.cpu.get_cpu_capability()


def canary():
    """A tiny run of each objective (``CANARY``), in this process: every arm's per-step losses, held-out and reported
    rule rates and clamped fraction, per learning rate and seed. It goes through everything the table's numbers
    come from (data, training, the package's losses and syncer, evaluation), so a change to any of it shows."""
    import io
    out = {}
    for objective in OBJECTIVES:
        res = run(objective, **CANARY, device="cpu", workers=1, quiet=True, out=io.StringIO())
        out[objective] = {f"{r['arm']} lr {r['lr']:g} seed {r['seed']}": {k: r[k] for k in ("losses", "heldout",
                                                                                           "report", "clip_frac")}
                          for r in res["runs"]}
    return out


def canary_subprocess():
    """:func:`canary` in a fresh interpreter under ``CANARY_ENV`` (the pinned rounding must be set before torch
    starts), from this copy of the package."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, **CANARY_ENV,
           "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    p = subprocess.run([sys.executable, "-c", "import json; from humanline_kernels import demo; "
                        "print(json.dumps(demo.canary()))"], capture_output=True, text=True, env=env, cwd=root,
                       timeout=600)
    if p.returncode:
        raise RuntimeError(f"the demo's canary run failed:\n{p.stderr[-2000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def cpu_key():
    """The CPU a canary ran on, as the record keys it: vendor, family and model from /proc/cpuinfo (Linux), else
    what :mod:`platform` says."""
    fields = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if not line.strip():
                    break  # the first processor's block is enough
                k, _, v = line.partition(":")
                fields.setdefault(k.strip(), v.strip())
    except OSError:
        pass
    if all(k in fields for k in ("vendor_id", "cpu family", "model")):
        return f"{fields['vendor_id']} family {fields['cpu family']} model {fields['model']}"
    return f"{platform.machine()} {platform.processor() or 'unknown'}"


def canary_differences(want, got, rtol=0.0):
    """The runs (``"objective arm lr L seed S"``) whose values differ between two canaries: in any bit (``rtol``
    0), or, with ``rtol``, floats beyond that relative difference (everything else must still be equal)."""
    def same(a, b):
        if isinstance(a, float) and isinstance(b, float):
            # losses near 0 (GRPO's first steps give ~1e-8) are held to rtol on the 1e-8 scale, not their own
            return a == b or math.isclose(a, b, rel_tol=rtol, abs_tol=rtol * 1e-8)
        if isinstance(a, list) and isinstance(b, list):
            return len(a) == len(b) and all(map(same, a, b))
        if isinstance(a, dict) and isinstance(b, dict):
            return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
        return a == b
    runs = {(o, k) for c in (want, got) for o in c for k in c[o]}
    return [f"{o} {k}" for o, k in sorted(runs) if not same(want.get(o, {}).get(k), got.get(o, {}).get(k))]


def check_canary(record, now, cpu):
    """Whether the canary ``now``, measured on ``cpu`` (:func:`cpu_key`), says that the code still computes what
    ``record`` measured: ``("same", msg)`` for the bits of a canary in the record, ``("close", msg)`` on a CPU the
    record has no canary for when every loss is within ``CANARY_RTOL`` of the record's, else ``("differ", msg)``
    (on a CPU the record has a canary for, any bit)."""
    exact = {record.get("canary_cpu"): record["canary"], **record.get("canary_other_cpus", {})}
    for key, bits in exact.items():
        if now == bits:
            return "same", f"the canary's bits are those recorded for {key or 'the record CPU'}"
    if cpu in exact:
        diff = canary_differences(exact[cpu], now)
        return "differ", (f"{len(diff)} canary runs differ from the bits recorded for this CPU ({cpu}), e.g. "
                          f"{diff[:3]}")
    diff = canary_differences(record["canary"], now, CANARY_RTOL)
    if diff:
        return "differ", (f"{len(diff)} canary runs differ from the record's by more than round-off (relative "
                          f"{CANARY_RTOL:g}; this CPU, {cpu}, has no canary in the record), e.g. {diff[:3]}")
    return "close", (f"this CPU ({cpu}) has no canary in the record; its canary is within {CANARY_RTOL:g} "
                     f"relative of the record's")


def _git_commit():
    """(commit, dirty) of the checkout this module runs from, or (None, None) outside a git checkout."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True, cwd=root,
                              timeout=30)
        if head.returncode:
            return None, None
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                text=True, cwd=root, timeout=30)
        return head.stdout.strip(), bool(status.stdout.strip())
    except (OSError, subprocess.SubprocessError):
        return None, None


def entry(result, flags):
    """One run of one objective as the record keeps it: what was run (the flags that change numbers, the
    environment that changes rounding), where, and what it measured per arm."""
    import transformers

    info = result["info"]
    commit, dirty = _git_commit()
    arms = {arm: {k: b[k] for k in ("rule_rate", "se", "heldout", "clip_frac", "syncs", "wall_s", "sample_s", "lr")}
            for arm, b in result["best"].items()}
    return {"objective": info["objective"], "flags": list(flags),
            "env": {k: os.environ[k] for k in NUMERIC_ENV if k in os.environ},
            "settings": {**{k: info[k] for k in ("steps", "seeds", "lrs", "seed", "batch", "sync_every",
                                                  "resample_every", "sft_steps", "eval_n")},
                         "clip": [info["clip"].log_eps_p, info["clip"].log_eps_r]},
            "machine": {"device": info["device"], "cpu": cpu_key() if info["device"] == "cpu" else None,
                        "cpu_capability": info["cpu"], "processes": info["workers"],
                        "cores": _cores(), "torch": torch.__version__, "transformers": transformers.__version__,
                        "python": platform.python_version()},
            "commit": commit, "dirty": dirty, "behaviour": info["behaviour"], "start": info["start"],
            "setup_s": info["setup_s"], "total_s": info["total_s"], "arms": arms, "verdict": result["verdict"]}


def _key(e):
    return e["objective"], tuple(e["flags"]), tuple(sorted(e["env"].items()))


def save(path, entries):
    """Merge ``entries`` into the JSON record at ``path`` (an entry of the same objective, flags and environment
    is replaced), with a fresh canary (:func:`canary_subprocess`); returns the record."""
    record = {"runs": []}
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            record = json.load(f)
    new = {_key(e) for e in entries}
    runs = [e for e in record["runs"] if _key(e) not in new] + list(entries)
    order = {o: i for i, o in enumerate(OBJECTIVES)}
    # the default runs first, then the other runs of each objective, those with flags before those with an
    # environment of their own
    runs.sort(key=lambda e: (bool(e["flags"] or e["env"]), order[e["objective"]], bool(e["env"]), e["flags"],
                             sorted(e["env"].items())))
    record = {"what": "python -m humanline_kernels.demo --save: README's demo table is written from this file "
                      "(python -m bench report --readme)",
              "canary_env": CANARY_ENV, "canary_settings": {**CANARY, "lrs": list(
                  CANARY["lrs"])}, "canary_cpu": cpu_key(), "canary": canary_subprocess(), "runs": runs}
    _write(path, record)
    return record


def _write(path, record):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(record, f, indent=1)
        f.write("\n")


def add_canary(path):
    """Keep this CPU's canary bits in the record at ``path`` beside the record's own, after checking that they are
    within round-off of it (:func:`check_canary`): the same code, rounded by another CPU. Returns ``(verdict,
    message)``; the record is written only on ``"close"``."""
    with open(path, encoding="utf-8") as f:
        record = json.load(f)
    cpu, now = cpu_key(), canary_subprocess()
    verdict, msg = check_canary(record, now, cpu)
    if verdict == "close":
        if canary_subprocess() != now:  # bits kept for exact checks must be ones this CPU repeats
            return "differ", f"this CPU ({cpu}) does not repeat its own canary's bits; nothing kept"
        record["canary_other_cpus"] = {**record.get("canary_other_cpus", {}), cpu: now}
        _write(path, record)
        msg += f"; kept its bits in {path}"
    return verdict, msg


def _versus(a, b):
    """``a``'s rule rate against ``b``'s in standard errors of the difference, as the verdict words it."""
    diff, se = a["rule_rate"] - b["rule_rate"], math.hypot(a["se"], b["se"])
    if not se > 0:
        return "equal" if diff == 0 else ("above" if diff > 0 else "below")
    if abs(diff) <= se:
        return "within 1 s.e."
    return f"{abs(diff) / se:.1f} s.e. {'above' if diff > 0 else 'below'}"


def _label(e):
    name = e["objective"].upper()
    if e["objective"] == "grpo":
        name += f" (offline: resampled every {e['settings']['resample_every']} steps)"
    return name


def _run_label(e):
    parts = [f"`{' '.join(e['flags'])}`"] if e["flags"] else []
    parts += [f"`{k}={v}`" for k, v in sorted(e["env"].items())]
    return ", ".join(parts) + (f" ({e['machine']['cpu_capability']})" if e["machine"]["cpu_capability"] else "")


def markdown_table(entries):
    """README's markdown table of these runs: a row per run, the rule rates (mean +- s.e.) of the three arms and
    humanline against online (and its wall-time ratio) and against plain offline; a ``run`` column when any run
    has flags or an environment of its own."""
    with_run = any(e["flags"] or e["env"] for e in entries)
    head = list(ROW_HEADER)
    if with_run:
        head.insert(1, "run")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for e in entries:
        a = e["arms"]
        hl, on = a["offline+humanline"], a["online"]
        speed = on["wall_s"] / hl["wall_s"] if hl["wall_s"] > 0 else float("inf")
        pace = f"{speed:.1f}x faster" if speed >= 1 else f"{1 / speed:.1f}x slower"
        cells = [_label(e)] + ([_run_label(e)] if with_run else [])
        cells += [f"{a[arm]['rule_rate']:.3f} +- {a[arm]['se']:.3f}" for arm in ARMS]
        cells += [f"{_versus(hl, on)}, {pace}", _versus(hl, a["offline"])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def readme_block(record, record_path, root):
    """README's demo section between its markers: the run's settings and machine, the table of the default runs,
    the table of the other runs, the DPO plot when it is beside the record (``record_path`` as README names it,
    relative to the project's ``root``)."""
    import textwrap
    main = [e for e in record["runs"] if not e["flags"] and not e["env"]]
    other = [e for e in record["runs"] if e["flags"] or e["env"]]
    out = []
    if main:
        first = main[0]
        s, m = first["settings"], first["machine"]
        where = (f"{m['device'].upper()}" + (f" {m['cpu_capability']}" if m["cpu_capability"] else "")
                 + (f" ({m['cpu']})" if m.get("cpu") else "")
                 + f", {m['cores']} cores, {m['processes']} processes, torch {m['torch']}, transformers "
                 f"{m['transformers']}")
        commit = f"at commit {first['commit']}" + (" with local changes" if first["dirty"] else "") \
            if first["commit"] else "outside a git checkout"
        same = all(e["machine"] == m and e["commit"] == first["commit"] for e in main)
        lrs = ", ".join(f"{x:g}" for x in s["lrs"])
        took = ", ".join(f"{e['objective'].upper()} {e['total_s']:.0f} s" for e in main)
        out.append(
            f"What the default run measured (`python -m humanline_kernels.demo --objective all --save "
            f"{record_path}`; {where}; {commit}{'' if same else ' (some rows elsewhere: see the record)'}; "
            f"{s['steps']} steps x {s['batch']} sequences, learning rates {lrs}, {s['seeds']} seeds; rule rate of "
            f"the policy's own samples on the reported prompts, mean +- s.e.; the starting policy is at "
            f"{first['start']:.3f}, the behaviour model that wrote the offline data at {first['behaviour']:.3f}; "
            f"wall time of each run, setup included: {took}):")
        out[-1] = textwrap.fill(out[-1], 116, break_long_words=False, break_on_hyphens=False)
        out += ["", markdown_table(main)]
    if other:
        out += ["", "Other runs in the same record (the flags or environment shown, everything else the default):",
                "", markdown_table(other)]
    png = os.path.join(os.path.dirname(record_path), "demo-dpo.png")
    if os.path.exists(os.path.join(root, png)):
        out += ["", f"![DPO: rule rate over training, each arm at its best learning rate]({png})"]
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------------------------
# command line


def _int_at_least(low):
    def parse(text):
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if v < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {v}")
        return v
    return parse


def _positive_float(text):
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not v > 0 or v != v or v == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive finite number, got {text}")
    return v


def _lr_grid(text):
    values = [_positive_float(x) for x in text.split(",") if x.strip()]
    if not values:
        raise argparse.ArgumentTypeError("expected a comma-separated list of learning rates, e.g. 3e-4,1e-3")
    return tuple(sorted(set(values)))


class _Parser(argparse.ArgumentParser):
    """A bad flag is one line on stderr (exit 2), as in the bench programs (bench/cli.py), not argparse's usage block
    above the error."""

    def error(self, message):
        print(f"{self.prog}: error: {message} ({self.prog} --help)", file=sys.stderr)
        sys.exit(2)


def _parser():
    p = _Parser(prog="python -m humanline_kernels.demo", description=__doc__.split("\n\n")[0],
                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--objective", choices=[*OBJECTIVES, "all"], default="dpo",
                   help="the loss to train; all: each in turn")
    p.add_argument("--steps", type=_int_at_least(1), default=60, help="optimizer steps per run")
    p.add_argument("--seeds", type=_int_at_least(2), default=3, help="seeds per arm and learning rate")
    p.add_argument("--lrs", type=_lr_grid, default=DEFAULT_LRS, help="learning-rate grid, comma-separated, "
                   "the same for every arm")
    p.add_argument("--seed", type=_int_at_least(0), default=0,
                   help="base seed (behaviour model, starting policy, offline data)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="auto: cuda when available, else cpu")
    p.add_argument("--batch", type=_int_at_least(GROUP), default=16,
                   help="sequences per step (dpo/kto: pairs x 2; grpo: groups of 4)")
    p.add_argument("--sync-every", type=_int_at_least(1), default=None,
                   help="humanline sync interval (default: 1 for dpo/kto, 12 for grpo)")
    p.add_argument("--resample-every", type=_int_at_least(1), default=10,
                   help="grpo: the offline arms draw the policy's samples this many times less often than online")
    p.add_argument("--sft-steps", type=_int_at_least(0), default=100,
                   help="SFT steps that fit the behaviour model and the starting policy")
    p.add_argument("--eval-n", type=_int_at_least(16), default=256, help="samples per rule-rate evaluation")
    p.add_argument("--log-eps-p", type=float, default=-1.5, help="lower end of the clip band")
    p.add_argument("--log-eps-r", type=float, default=1.5, help="upper end of the clip band")
    p.add_argument("--plot", default=None, metavar="PATH",
                   help="where the plot of rule rate over steps is written ({objective} is substituted; default: "
                   "humanline-demo-{objective}.png, with --save demo-{objective}.png beside the record)")
    p.add_argument("--no-plot", action="store_true", help="write no plot")
    p.add_argument("--workers", type=_int_at_least(1), default=None,
                   help="processes for the runs of the grid (default: one per core up to 4 on CPU, 1 on CUDA)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--markdown", action="store_true",
                   help="after the run, print its rows as README's markdown table")
    p.add_argument("--save", metavar="PATH", default=None,
                   help="merge this run into the JSON record at PATH (README's demo table is written from it by "
                   "python -m bench report --readme), with a canary run (seconds) that CI repeats")
    p.add_argument("--add-canary", metavar="PATH", default=None,
                   help="run only the canary and keep this CPU's bits in the record at PATH, if they are within "
                   "round-off of the record's (another CPU, the same code); CI then checks them exactly here")
    return p


def main(argv=None):
    p = _parser()
    a = p.parse_args(argv)
    if a.add_canary:
        given = [f for f in ("save", "markdown") if getattr(a, f)]
        if given:
            p.error(f"--add-canary runs only the canary; drop --{given[0]}")
        if not os.path.isfile(a.add_canary):
            p.error(f"--add-canary: no record at {a.add_canary!r} (write one with --save)")
        if not a.quiet:
            print("canary run, twice (a tiny run of every objective) ...", flush=True)
        verdict, msg = add_canary(a.add_canary)
        if verdict == "differ":
            p.error(f"--add-canary: {msg}")
        print(msg)
        return 0
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: this machine has no CUDA device (use --device cpu or auto)")
    if not (a.log_eps_p <= a.log_eps_r) or any(v != v or abs(v) == float("inf") for v in (a.log_eps_p, a.log_eps_r)):
        p.error(f"the clip band must be finite with --log-eps-p <= --log-eps-r, got [{a.log_eps_p}, {a.log_eps_r}]")
    objectives = OBJECTIVES if a.objective == "all" else (a.objective,)
    if a.batch % 2 and set(objectives) & {"dpo", "kto"}:
        p.error(f"--batch must be even for {'dpo and kto' if a.objective == 'all' else a.objective} "
                f"(chosen/desirable and rejected/undesirable rows), got {a.batch}")
    if "grpo" in objectives and a.batch % GROUP:
        p.error(f"--batch must be a multiple of the group size {GROUP} for grpo, got {a.batch}")
    plot = a.plot or (os.path.join(os.path.dirname(a.save), "demo-{objective}.png") if a.save
                      else "humanline-demo-{objective}.png")
    try:
        plot.format(objective="dpo")
    except (KeyError, IndexError, ValueError):
        p.error(f"--plot: only {{objective}} may be substituted in the path, got {a.plot!r}")
    if a.save and os.path.isdir(a.save):
        p.error(f"--save: {a.save!r} is a directory; give the record's file name (e.g. {a.save}/demo.json)")
    defaults = p.parse_args([])
    flags = []
    for k in SETTINGS:  # the flags that change what is measured, as the record and README's table show them
        v, d = getattr(a, k), getattr(defaults, k)
        if v != d:
            flags += ["--" + k.replace("_", "-"), ",".join(f"{x:g}" for x in v) if k == "lrs" else f"{v:g}"]
    entries = []
    for objective in objectives:
        res = run(objective, a.steps, a.seeds, a.lrs, a.seed, a.device, a.batch, a.sft_steps, a.eval_n,
                  clip=hk.HumanlineClip(a.log_eps_p, a.log_eps_r), sync_every=a.sync_every,
                  resample_every=a.resample_every, plot_path=None if a.no_plot else plot.format(objective=objective),
                  workers=a.workers, quiet=a.quiet)
        entries.append(entry(res, flags))
    if a.save:
        if not a.quiet:
            print("canary run for the record (a tiny run of every objective) ...", flush=True)
        save(a.save, entries)
        print(f"record: {a.save}")
    if a.markdown:
        print("\n" + markdown_table(entries))
    return 0


if __name__ == "__main__":
    sys.exit(main())
