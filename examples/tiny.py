"""A tiny offline model and tokenizer for the examples and tests: no download, runs on CPU in seconds.

``tiny_tokenizer()`` is a character-level ``PreTrainedTokenizerFast`` (64 symbols), ``tiny_model()`` a
random-init Llama with that vocabulary. ``load(name)`` returns either these (``name == "tiny"``) or a real
model and tokenizer from the hub / a local path, with FlashAttention-2 when ``flash_attn`` is importable and the
model runs in bf16/fp16 on CUDA.
"""
from __future__ import annotations

import importlib.util
import string

import torch

SPECIALS = ["<pad>", "<eos>", "<unk>"]
CHARS = string.digits + string.ascii_lowercase + " +-*=?.,!:"


def tiny_tokenizer():
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + list(CHARS))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def tiny_model(vocab_size=64, hidden_size=32, num_layers=1, seed=0, dtype=torch.float32):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                      num_hidden_layers=num_layers, num_attention_heads=2, num_key_value_heads=2,
                      max_position_embeddings=256, pad_token_id=0, eos_token_id=1, bos_token_id=None,
                      tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).to(dtype)


def attn_implementation(dtype):
    """"flash_attention_2" when it can run: ``flash_attn`` importable, a CUDA device, and a half-precision model
    (FlashAttention-2 rejects fp32 at the first forward); else None (the transformers default, SDPA)."""
    if dtype not in (torch.float16, torch.bfloat16) or not torch.cuda.is_available():
        return None
    return "flash_attention_2" if importlib.util.find_spec("flash_attn") is not None else None


def load(name="tiny", dtype=None):
    """``(model, tokenizer)``: the tiny random-init pair, or a real model by hub id / path."""
    if name == "tiny":
        return tiny_model(dtype=dtype or torch.float32), tiny_tokenizer()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {"dtype": dtype or torch.bfloat16}
    attn = attn_implementation(kwargs["dtype"])
    if attn is not None:
        kwargs["attn_implementation"] = attn
    model = AutoModelForCausalLM.from_pretrained(name, **kwargs)
    tok = AutoTokenizer.from_pretrained(name)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return model, tok


def quiet_trl_deprecations() -> None:
    """Hide the transformers 5.2x FutureWarnings that TRL 1.16's own trainers raise (old checkpointing names)."""
    import warnings
    for name in ("gradient_checkpointing", "is_gradient_checkpointing", "gradient_checkpointing_enable",
                 "gradient_checkpointing_disable"):
        warnings.filterwarnings("ignore", message=f"`{name}` is deprecated", category=FutureWarning)


def checkpointing_kwargs(on: bool) -> dict:
    """Training-argument keyword for activation checkpointing under the installed transformers' name for it
    (``activation_checkpointing`` since transformers 5.2x; the old ``gradient_checkpointing`` warns there)."""
    import dataclasses

    from transformers import TrainingArguments
    names = {f.name for f in dataclasses.fields(TrainingArguments)}
    return {"activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing": on}


def output_dir(given: str | None, name: str) -> str:
    """``--output-dir`` when given, else a new temporary directory (nothing is written into the current one)."""
    import tempfile
    if given:
        return given
    path = tempfile.mkdtemp(prefix=f"{name}-")
    print(f"writing trainer outputs to {path} (set --output-dir to choose)")
    return path
