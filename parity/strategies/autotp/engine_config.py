"""The DeepSpeed engine config of a run: the harness's DDP-equivalent values (micro-batch and accumulation, clipping,
ZeRO stage and offload, AutoTP and AutoEP sizes, the precision policy in DeepSpeed's own keys), with the user's
--deepspeed_config merged over them section by section (user_config.py checked that it agrees with the run's flags).
Apart from the strategy because it is data the worker hands to deepspeed.initialize, and what docs/deepspeed.md's [2]
describes key by key: nothing in it may make the training differ from DDP's.
"""

from __future__ import annotations

from parity.precision import policy_of
from parity.strategies.autotp.partition import autotp_partition_config
from parity.strategies.autotp.user_config import given_config


def _merged(base: dict, user: dict) -> dict:
    """`base` with `user`'s values over it, section by section."""
    out = dict(base)
    for key, value in user.items():
        out[key] = _merged(base[key], value) if isinstance(value, dict) and isinstance(base.get(key), dict) else value
    return out


def engine_config(cfg) -> dict:
    """The DeepSpeed config: nothing in it may make the training differ from DDP's (docs/deepspeed.md) — but what
    the user's own --deepspeed_config sets, over the harness's DDP-equivalent values (the keys the run's flags
    decide agree with them: read_user_config).

    No train_batch_size: DeepSpeed counts TP ranks as DP ranks in that product (micro × accumulation ×
    world size) and rejects the true global batch; the gradient averaging itself uses the real DP group.
    """
    return _merged(_harness_config(cfg), given_config(cfg.options))


def _harness_config(cfg) -> dict:
    zero = {"stage": cfg.options["zero_stage"], "reduce_bucket_size": cfg.options["reduce_bucket_size"]}
    if zero["stage"] == 3:
        # Every parameter partitioned, as the paper's stage 3: DeepSpeed by default keeps parameters under 1e5
        # elements whole on every rank (for qwen2-tiny, all but the embedding). Numerics are the same either way.
        zero["stage3_param_persistence_threshold"] = 0
    for part in ("optimizer", "param"):
        if cfg.options[f"offload_{part}"] != "none":
            zero[f"offload_{part}"] = {"device": cfg.options[f"offload_{part}"], "pin_memory": cfg.use_cuda}
    config = {
        "train_micro_batch_size_per_gpu": cfg.batch_size // cfg.grad_accum_steps,
        "gradient_accumulation_steps": cfg.grad_accum_steps,
        "gradient_clipping": cfg.max_grad_norm,  # 0 = off, as --max_grad_norm; same formula as torch's
        "zero_optimization": zero,
        "wall_clock_breakdown": False,
    }
    if cfg.options["offload_optimizer"] != "none":
        # Keep the client torch AdamW (the shared optimizer): by default DeepSpeed refuses a client optimizer
        # with ZeRO-Offload and wants DeepSpeedCPUAdam, a JIT-built op (2 minutes of g++ per host) whose
        # arithmetic differs from torch's AdamW (5e-6 of a parameter after a few steps at lr 1e-3).
        config["zero_force_ds_cpu_optimizer"] = False
    if cfg.ep_size > 1:  # [8]
        config["expert_parallel"] = {"enabled": True, "autoep_size": cfg.ep_size}
    if cfg.tp_size > 1:
        config["tensor_parallel"] = {"autotp_size": cfg.tp_size}
        from parity.models.model import model_config_from_dict

        partition = autotp_partition_config(model_config_from_dict(cfg.model_config), given_config(cfg.options))
        if partition is not None:
            config["tensor_parallel"]["partition_config"] = partition
    return {**config, **policy_config(cfg)}


def policy_config(cfg) -> dict:
    """The run's precision policy in DeepSpeed's keys (what a user's config that asks for it holds: config_policy).

    bf16: DDP's recipe — bf16 compute under torch.autocast, fp32 parameters, gradients, master weights and Adam state.
    The section is needed although the shared train step already enters autocast: without it the engine switches an
    outer autocast off inside its forward. The empty list keeps every gradient reduction in fp32 (by default DeepSpeed
    would reduce the gradients of nn.Linear layers in bf16). bf16_params: DeepSpeed's bf16 mode (bf16 parameters and
    gradients, fp32 master partitions and Adam state), bf16_pure the same with bf16 masters and states, fp16 its fp16
    mode with the run's loss scaler. A reduce or accumulation dtype other than the parameters' is
    communication_data_type / data_types.grad_accum_dtype."""
    policy = policy_of(cfg)
    if policy.name == "fp32":
        return {}
    if policy.name == "bf16":
        return {"torch_autocast": {"enabled": True, "dtype": "bfloat16", "lower_precision_safe_modules": []}}
    if policy.name == "fp16":
        config = {"fp16": {"enabled": True, **cfg.loss_scaling}}
    else:
        pure = policy.name == "bf16_pure"
        config = {"bf16": {"enabled": True, **({"bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}
                                               if pure else {})}}
    if cfg.reduce_dtype != policy.params:
        config["communication_data_type"] = cfg.reduce_dtype
    if cfg.grad_accum_dtype != policy.params:
        config["data_types"] = {"grad_accum_dtype": cfg.grad_accum_dtype}
    return config
