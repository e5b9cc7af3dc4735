"""End-to-end humanline demo: offline vs humanline DPO / KTO / GRPO on a tiny random-init Llama.

``python -m humanline_kernels.demo [--objective dpo|kto|grpo] [--steps N] [--seed S] [--device auto|cpu|cuda]``

The synthetic task: a prompt is ``BOS p1 .. p4 SEP`` over ``K`` symbols; the desirable completion counts up from
the last prompt symbol: ``c1 = p4 + 1``, ``c_{i+1} = c_i + 1`` (mod ``K``), then ``EOS``.
Rule-following is checked exactly. Two different tiny Llamas are first fitted (a few SFT steps) to noisy versions
of the rule: the *behaviour* model (noisier, worse) produces the offline data, the other is the starting policy.
The offline data (preference pairs for DPO, labelled samples for KTO, scored groups for GRPO) are sampled from the
behaviour model once. Then, from the same starting policy, on the same data for the same steps:

* offline: the reference is the frozen starting policy and no clipping (the plain offline objective);
* humanline: the reference is synced from the policy before the optimizer step (``hk.ReferenceSyncer``; every
  step for DPO/KTO, every 12 for GRPO, ``--sync-every``) and
  each token's log-ratio is clamped to ``[log_eps_p, log_eps_r]``.

The final table reports what was measured: the rule-following rate of the policy's own samples (temperature 1),
the mean fraction of tokens outside the clip band, the final loss and the wall time of each run. On CUDA the losses
go through the fused Triton kernels (``hk.fused``); on CPU through the eager path.
"""
from __future__ import annotations

import argparse
import copy
import sys
import time

import torch

import humanline_kernels as hk

PAD, BOS, SEP, EOS = 0, 1, 2, 3
K = 12                      # symbols 4 .. 4+K-1
PROMPT, COMPL = 4, 5        # prompt symbols, completion symbols (+ EOS)
VOCAB = 4 + K


def _make_model(seed, device):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                      bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).to(device)


def sample_prompts(n, gen, device):
    sym = torch.randint(0, K, (n, PROMPT), generator=gen) + 4
    bos, sep = torch.full((n, 1), BOS), torch.full((n, 1), SEP)
    return torch.cat([bos, sym, sep], 1).to(device)


def rule_completion(prompts):
    last = prompts[:, PROMPT:PROMPT + 1].cpu() - 4
    return (last + torch.arange(1, COMPL + 1).unsqueeze(0)) % K + 4


def token_scores(prompts, completions):
    """Per completion token: 1 where it follows the rule (EOS at the end counts too)."""
    want = torch.cat([rule_completion(prompts), torch.full((prompts.shape[0], 1), EOS)], 1)
    return (completions.cpu() == want).float()


def noisy_sequences(prompts, p_rule, gen):
    n = prompts.shape[0]
    target = rule_completion(prompts)
    noise = torch.randint(0, K, target.shape, generator=gen) + 4
    keep = torch.rand(target.shape, generator=gen) < p_rule
    comp = torch.where(keep, target, noise)
    return torch.cat([prompts.cpu(), comp, torch.full((n, 1), EOS)], 1).to(prompts.device)


def labels_for(seqs):
    """Next-token labels aligned with ``logits[:, :-1]``: only completion tokens count."""
    labels = seqs[:, 1:].clone()
    labels[:, :PROMPT + 1] = -100
    return labels


def fit_sft(model, p_rule, steps, gen, device, lr=3e-3):
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    for _ in range(steps):
        seqs = noisy_sequences(sample_prompts(64, gen, device), p_rule, gen)
        logits = model(seqs).logits[:, :-1]
        loss = -hk.token_logprobs(logits, labels_for(seqs)).sum() / (COMPL + 1) / seqs.shape[0]
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model


@torch.no_grad()
def generate(model, prompts, gen):
    """Sample completions at temperature 1 (plain loop: the models are tiny)."""
    seqs = prompts
    for _ in range(COMPL + 1):
        logits = model(seqs).logits[:, -1].float()
        probs = torch.softmax(logits, -1).cpu()
        nxt = torch.multinomial(probs, 1, generator=gen).to(seqs.device)
        seqs = torch.cat([seqs, nxt], 1)
    return seqs


def rule_rate(model, gen, device, n=512):
    prompts = sample_prompts(n, gen, device)
    seqs = generate(model, prompts, gen)
    return token_scores(prompts, seqs[:, PROMPT + 2:]).min(1).values.mean().item()


# ---------------------------------------------------------------------------------------------------------------
# offline data from the behaviour model


def offline_data(behaviour, objective, n_prompts, gen, device, group=4):
    prompts = sample_prompts(n_prompts, gen, device)
    reps = prompts.repeat_interleave(group, 0)
    seqs = generate(behaviour, reps, gen)
    score = token_scores(reps, seqs[:, PROMPT + 2:]).mean(1).view(n_prompts, group)
    seqs = seqs.view(n_prompts, group, -1)
    if objective == "grpo":
        adv = (score - score.mean(1, keepdim=True)) / (score.std(1, keepdim=True) + 1e-2)
        keep = score.std(1) > 0
        return {"seqs": seqs[keep].flatten(0, 1), "adv": adv[keep].flatten().to(device), "group": group}
    best, worst = score.argmax(1), score.argmin(1)
    keep = score.max(1).values > score.min(1).values
    idx = torch.arange(n_prompts)
    chosen, rejected = seqs[idx, best][keep], seqs[idx, worst][keep]
    if objective == "dpo":
        return {"chosen": chosen, "rejected": rejected}
    # KTO: the better sample of each prompt is desirable, the worse one undesirable (unpaired in the loss)
    return {"seqs": torch.cat([chosen, rejected]),
            "desirable": torch.cat([torch.ones(len(chosen)), torch.zeros(len(rejected))]).bool().to(device)}


def batches(data, objective, batch, gen):
    if objective == "dpo":
        n = data["chosen"].shape[0]
        idx = torch.randperm(n, generator=gen)[:batch]
        return {"seqs": torch.cat([data["chosen"][idx], data["rejected"][idx]])}
    if objective == "kto":
        n = data["seqs"].shape[0]
        idx = torch.randperm(n, generator=gen)[:batch]
        seqs = data["seqs"][idx]
        # KL rows: mismatched prompt/completion pairs (completions shifted by one row)
        kl = torch.cat([seqs[:, :PROMPT + 2], seqs.roll(1, 0)[:, PROMPT + 2:]], 1)
        return {"seqs": seqs, "desirable": data["desirable"][idx], "kl_seqs": kl}
    g = data["group"]
    n = data["seqs"].shape[0] // g
    groups = torch.randperm(n, generator=gen)[:max(1, batch // g)]
    idx = (groups.unsqueeze(1) * g + torch.arange(g)).flatten()
    return {"seqs": data["seqs"][idx], "adv": data["adv"][idx.to(data["adv"].device)]}


def _logps(model, seqs, grad):
    with torch.set_grad_enabled(grad):
        logits = model(seqs).logits[:, :-1]
        return logits, labels_for(seqs)


def train(policy, reference, data, objective, *, humanline, steps, batch, lr, seed, clip, progress, sync_every=1):
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(policy.parameters(), lr=lr)
    syncer = hk.ReferenceSyncer(policy, reference, every=sync_every) if humanline else None
    use_clip = clip if humanline else None
    clipped, losses = [], []
    for _ in progress(range(steps)):
        b = batches(data, objective, batch, gen)
        with torch.no_grad():
            ref_logits, labels = _logps(reference, b["seqs"], False)
            ref_logps = hk.token_logprobs(ref_logits, labels)
            if objective == "kto":
                kl_labels = labels_for(b["kl_seqs"])
                kl_ref = hk.token_logprobs(reference(b["kl_seqs"]).logits[:, :-1], kl_labels)
                kl_pol = hk.token_logprobs(policy(b["kl_seqs"]).logits[:, :-1], kl_labels)
        if syncer is not None:
            syncer.start()  # after the last reference forward of this step
        logits, labels = _logps(policy, b["seqs"], True)
        if objective == "dpo":
            loss, m = hk.fused.dpo(logits, labels, ref_logps, clip=use_clip, beta=0.1)
        elif objective == "kto":
            loss, m = hk.fused.kto(logits, labels, ref_logps, b["desirable"], kl_pol, kl_ref, kl_labels != -100,
                                   clip=use_clip, beta=0.1)
        else:
            loss, m = hk.fused.grpo(logits, labels, ref_logps, b["adv"], clip=use_clip, beta=0.0)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if syncer is not None:
            syncer.wait()  # the reference now holds the policy from before this update
        opt.step()
        losses.append(loss.detach())
        clipped.append(1.0 - m["unclipped_frac"])
    return torch.stack(losses).cpu(), torch.stack(clipped).cpu()


def run(objective="dpo", steps=200, seed=0, device="auto", batch=32, lr=2e-4, sft_steps=150, eval_n=512,
        clip=None, sync_every=None, quiet=False, out=sys.stdout):
    """Run offline and humanline training of one objective; print the table and return the measured rows."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    clip = clip or hk.HumanlineClip()
    # the paper's defaults: sync every step for instruction following, every 12-24 steps for GRPO
    sync_every = sync_every or (12 if objective == "grpo" else 1)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover
        def tqdm(it, **_):
            return it
    gen = torch.Generator().manual_seed(seed)
    t0 = time.perf_counter()
    behaviour = fit_sft(_make_model(seed + 1, device), 0.35, sft_steps, gen, device)
    start = fit_sft(_make_model(seed + 2, device), 0.5, sft_steps, gen, device)
    data = offline_data(behaviour, objective, 256, gen, device)
    base = {"behaviour": rule_rate(behaviour, gen, device, eval_n), "start": rule_rate(start, gen, device, eval_n)}
    prep = time.perf_counter() - t0
    rows = []
    for name, humanline in (("offline", False), ("humanline", True)):
        policy, reference = copy.deepcopy(start), copy.deepcopy(start)
        reference.requires_grad_(False)
        t1 = time.perf_counter()
        bar = (lambda it: it) if quiet else (lambda it: tqdm(it, desc=f"{name} {objective}", leave=False))
        losses, clipped = train(policy, reference, data, objective, humanline=humanline, steps=steps, batch=batch,
                                lr=lr, seed=seed + 3, clip=clip, progress=bar,
                                sync_every=sync_every)
        wall = time.perf_counter() - t1
        rate = rule_rate(policy, torch.Generator().manual_seed(seed + 4), device, eval_n)
        rows.append({"run": f"{name} {objective}", "rule_rate": rate,
                     "clip_frac": clipped.mean().item() if humanline else None,
                     "final_loss": losses[-10:].mean().item(), "wall_s": wall})
    _print_table(rows, base, prep, objective, steps, device, clip, sync_every, out)
    return {"rows": rows, "baseline": base}


def _print_table(rows, base, prep, objective, steps, device, clip, sync_every, out):
    print(f"\nhumanline demo: {objective}, {steps} steps, device={device}, "
          f"humanline: clip=[{clip.log_eps_p}, {clip.log_eps_r}], sync every {sync_every} step(s); setup {prep:.1f}s",
          file=out)
    print(f"rule-following rate of samples: behaviour model (offline data) {base['behaviour']:.3f}, "
          f"starting policy {base['start']:.3f}", file=out)
    head = f"{'run':<18} {'rule_rate':>9} {'clip_frac':>9} {'final_loss':>10} {'wall_s':>7}"
    print(head, file=out)
    print("-" * len(head), file=out)
    for r in rows:
        cf = "off" if r["clip_frac"] is None else f"{r['clip_frac']:.3f}"
        print(f"{r['run']:<18} {r['rule_rate']:>9.3f} {cf:>9} {r['final_loss']:>10.4f} {r['wall_s']:>7.1f}",
              file=out)
    print("rule_rate: fraction of the policy's own samples (temperature 1) that follow the rule exactly; "
          "clip_frac: mean fraction of tokens outside the clip band; final_loss: mean of the last 10 steps.",
          file=out)


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


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m humanline_kernels.demo", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--objective", choices=["dpo", "kto", "grpo"], default="dpo", help="the loss to train")
    p.add_argument("--steps", type=_int_at_least(1), default=200, help="optimizer steps per run")
    p.add_argument("--seed", type=int, default=0, help="random seed")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="auto: cuda when available, else cpu")
    p.add_argument("--batch", type=_int_at_least(2), default=32, help="sequences per step (DPO: pairs x 2)")
    p.add_argument("--lr", type=_positive_float, default=2e-4, help="learning rate")
    p.add_argument("--sync-every", type=_int_at_least(1), default=None,
                   help="humanline sync interval (default: 1 for dpo/kto, 12 for grpo)")
    p.add_argument("--sft-steps", type=_int_at_least(0), default=150, help="steps that train the behaviour model")
    p.add_argument("--log-eps-p", type=float, default=-1.5, help="lower end of the clip band")
    p.add_argument("--log-eps-r", type=float, default=1.5, help="upper end of the clip band")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    a = p.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: this machine has no CUDA device (use --device cpu or auto)")
    if not (a.log_eps_p <= a.log_eps_r) or any(v != v or abs(v) == float("inf") for v in (a.log_eps_p, a.log_eps_r)):
        p.error(f"the clip band must be finite with --log-eps-p <= --log-eps-r, got [{a.log_eps_p}, {a.log_eps_r}]")
    if a.objective == "dpo" and a.batch % 2:
        p.error(f"--batch must be even for dpo (chosen and rejected rows), got {a.batch}")
    run(a.objective, a.steps, a.seed, a.device, a.batch, a.lr, a.sft_steps,
        clip=hk.HumanlineClip(a.log_eps_p, a.log_eps_r), sync_every=a.sync_every, quiet=a.quiet)
    return 0


if __name__ == "__main__":
    sys.exit(main())
