"""The toy task and its models: prompts, the rule, scores, two tiny random-init Llamas fitted by SFT, sampling and
the rule rate.

A prompt is ``BOS p1 .. p4 SEP`` over ``K`` symbols; a completion follows the rule when it counts up from the last
prompt symbol (``c1 = p4 + 1``, ``c_{i+1} = c_i + 1`` mod ``K``) and then ends (``EOS``). The score of a completion
is its fraction of rule-following tokens; the *rule rate* is the fraction of a model's own samples (temperature 1)
that follow the rule exactly. The prompts' first symbol splits them into train, held-out and reported prompts.
"""
from __future__ import annotations

import torch

import humanline_kernels as hk

PAD, BOS, SEP, EOS = 0, 1, 2, 3
K = 12                      # symbols 4 .. 4+K-1
PROMPT, COMPL = 4, 5        # prompt symbols, completion symbols (+ EOS)
VOCAB = 4 + K
SPLITS = {"train": (0, 1), "heldout": (2,), "report": (3,)}  # by first prompt symbol mod 4


def make_model(seed, device):
    """A tiny random-init Llama (2 layers, hidden 64) over the task's vocabulary."""
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
    """Fit ``model`` to a noisy version of the rule (``noisy_sequences``) by ``steps`` SFT steps."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    for _ in range(steps):
        seqs = noisy_sequences(sample_prompts(64, gen, device), p_rule, gen, p_whole)
        logits = model(seqs, use_cache=False).logits[:, :-1]
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
        logits = model(seqs, use_cache=False).logits[:, -1].float()
        probs = torch.softmax(logits, -1).cpu()
        nxt = torch.multinomial(probs, 1, generator=gen).to(seqs.device)
        seqs = torch.cat([seqs, nxt], 1)
    model.train(was_training)
    return seqs


def rule_rate(model, gen, device, n=512, split="report"):
    """The fraction of ``n`` samples of ``model`` on prompts of ``split`` that follow the rule exactly."""
    prompts = sample_prompts(n, gen, device, split)
    seqs = generate(model, prompts, gen)
    return token_scores(prompts, seqs[:, PROMPT + 2:]).min(1).values.mean().item()
