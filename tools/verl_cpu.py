"""verl 0.9.1's FSDP engines in tests: tiny workers and batches, and a CPU platform to run FSDP2 on the CPU.

verl 0.9.1 has no CPU platform (``verl/plugin/platform``: it falls back to CUDA) and registers its FSDP engine for
``cuda``/``npu`` only. The platform below answers ``cpu`` with no-op memory and stream calls, the FSDP2 engine is
registered for it unchanged, and ``Tensor.pin_memory`` is the identity (the reference's ``CPUOffloadPolicy``
pins its shards, which needs an accelerator). FSDP1 cannot run here: verl wraps it with ``sync_module_states=True``,
which FSDP allows on an accelerator only.
"""
import contextlib
import os
import types

import torch

VOCAB, PROMPT, RESPONSE = 61, 5, 6


def install_cpu_platform():
    from verl.plugin.platform import platform_manager
    from verl.plugin.platform.platform_base import PlatformBase
    from verl.workers.engine.base import EngineRegistry
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    zero = lambda *a, **k: 0  # noqa: E731
    nothing = lambda *a, **k: None  # noqa: E731
    module = types.SimpleNamespace(synchronize=nothing, empty_cache=nothing, max_memory_allocated=zero,
                                   max_memory_reserved=zero, memory_allocated=zero, memory_reserved=zero,
                                   current_device=lambda: torch.device("cpu"), device_count=lambda: 1,
                                   is_available=lambda: True, manual_seed=torch.manual_seed,
                                   manual_seed_all=torch.manual_seed, set_device=nothing,
                                   mem_get_info=lambda *a: (1 << 34, 1 << 34), reset_peak_memory_stats=nothing,
                                   get_device_name=lambda *a: "cpu",
                                   # verl's checkpoint manager restores "the device's" RNG under the device name,
                                   # which on this platform is the CPU's
                                   get_rng_state=torch.get_rng_state, set_rng_state=torch.set_rng_state)

    class PlatformCPU(PlatformBase):
        device_name = property(lambda self: "cpu")
        vendor_name = property(lambda self: "cpu")
        device_module = property(lambda self: module)

        def is_available(self): return True
        def current_device(self): return torch.device("cpu")
        def device_count(self): return 1
        def set_device(self, i): pass
        def synchronize(self, i=None): pass
        def manual_seed(self, s): torch.manual_seed(s)
        def manual_seed_all(self, s): torch.manual_seed(s)
        def set_allocator_settings(self, s): pass
        def empty_cache(self): pass
        def get_device_capability(self, i=0): return (None, None)
        def communication_backend_name(self): return "gloo"
        def visible_devices_envvar(self): return "CUDA_VISIBLE_DEVICES"
        def profiler_start(self): pass
        def profiler_stop(self): pass
        def ray_resource_name(self): return "CPU"
        def ray_noset_envvars(self): return []
        def is_ipc_supported(self): return False
        def cudart(self): return None

        @contextlib.contextmanager
        def nvtx_range(self, msg):
            yield

    platform_manager.set_platform(PlatformCPU())
    EngineRegistry.register(model_type="language_model", backend=["fsdp", "fsdp2"], device="cpu")(
        FSDPEngineWithLMHead)
    torch.Tensor.pin_memory = lambda self, *a, **k: self


def save_tiny_llama(path):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, bos_token_id=1,
                      eos_token_id=2, pad_token_id=0, architectures=["LlamaForCausalLM"])
    LlamaForCausalLM(cfg).save_pretrained(path)


def training_worker(path, forward_only, cls=None, micro=2, strategy="fsdp2"):
    """A verl ``TrainingWorker`` (the actor, or with ``forward_only`` the CPU-offloaded reference)."""
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
    from verl.workers.config.engine import TrainingWorkerConfig
    from verl.workers.engine_workers import TrainingWorker

    model = HFModelConfig(path=path, load_tokenizer=False, use_remove_padding=False,
                          override_config={"attn_implementation": "eager"}, enable_gradient_checkpointing=False)
    engine = FSDPEngineConfig(strategy=strategy, forward_only=forward_only, use_dynamic_bsz=False,
                              micro_batch_size_per_gpu=micro, infer_micro_batch_size_per_gpu=micro,
                              use_torch_compile=False, wrap_policy={"min_num_params": 0})
    optim = FSDPOptimizerConfig(lr=0.05, total_training_steps=100, weight_decay=0.0)
    config = TrainingWorkerConfig(model_type="language_model", model_config=model, engine_config=engine,
                                  optimizer_config=optim, checkpoint_config=CheckpointConfig())
    worker = (cls or TrainingWorker)(config)
    worker.reset()
    return worker


def rollout_batch(seed, batch_size, layout="legacy"):
    """A verl batch as its trainers hand it to the workers: ``"legacy"``, ``left_right_2_no_padding`` of the padded
    batch (``trainer.use_v1=False``); ``"v1"``, every per-sample field jagged, as the v1 agent loop stores it."""
    from tensordict import TensorDict
    from verl.workers.utils.padding import left_right_2_no_padding

    g = torch.Generator().manual_seed(seed)
    prompt_len = torch.randint(2, PROMPT + 1, (batch_size,), generator=g).tolist()
    resp_len = torch.randint(2, RESPONSE + 1, (batch_size,), generator=g).tolist()
    prompts = [torch.randint(3, VOCAB, (n,), generator=g) for n in prompt_len]
    responses = [torch.randint(3, VOCAB, (n,), generator=g) for n in resp_len]
    if layout == "v1":
        jagged = lambda xs: torch.nested.as_nested_tensor(xs, layout=torch.jagged)  # noqa: E731
        ids = [torch.cat([p, r]) for p, r in zip(prompts, responses)]
        mask = jagged([torch.ones(n, dtype=torch.long) for n in resp_len])
        return TensorDict({"prompts": jagged(prompts), "responses": jagged(responses), "input_ids": jagged(ids),
                           "position_ids": jagged([torch.arange(len(x)) for x in ids]), "response_mask": mask,
                           "loss_mask": mask}, batch_size=[batch_size])
    padded_prompts = torch.zeros(batch_size, PROMPT, dtype=torch.long)
    padded_responses = torch.zeros(batch_size, RESPONSE, dtype=torch.long)
    attn = torch.zeros(batch_size, PROMPT + RESPONSE, dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        padded_prompts[i, PROMPT - len(p):] = p
        padded_responses[i, :len(r)] = r
        attn[i, PROMPT - len(p):PROMPT + len(r)] = 1
    td = TensorDict({"prompts": padded_prompts, "responses": padded_responses,
                     "input_ids": torch.cat([padded_prompts, padded_responses], -1), "attention_mask": attn,
                     "response_mask": attn[:, PROMPT:].clone(), "position_ids": (attn.cumsum(-1) - 1).clamp(min=0)},
                    batch_size=[batch_size])
    return left_right_2_no_padding(td)


def log_probs(worker, td):
    """What verl's trainers put into the batch as ``old_log_probs`` / ``ref_log_prob``, in the batch's layout."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import no_padding_2_padding, response_from_nested

    work = td.copy()
    tu.assign_non_tensor(work, calculate_entropy=False, compute_loss=False, temperature=1.0)
    out = tu.get(worker.infer_batch(work), "log_probs")
    if td["response_mask"].is_nested:
        return response_from_nested(out, td["response_mask"]).float()
    return no_padding_2_padding(out, td).float()


def like(td, values):
    """``values`` (one per response token, as a ``[B, R]`` tensor) in the layout of ``td['response_mask']``."""
    from verl.workers.utils.padding import response_to_nested
    return response_to_nested(values, td["response_mask"]) if td["response_mask"].is_nested else values


def env_rank():
    return int(os.environ.get("RANK", 0))
