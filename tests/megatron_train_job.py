"""A megatron-core pretraining loop as its users write one (Megatron-LM's pretrain_gpt.py, cut down): a GPTModel in
megatron-core's DistributedDataParallel, `get_megatron_optimizer`'s AdamW with gradient clipping, and each step's
micro-batches through `get_forward_backward_func()` with the masked token-mean loss of `partial(loss_func,
loss_mask)`. Run through tests/megatron_cpu.py under torchrun: `megatron_train_job.py --tp 2 --steps 4 …`; the
ranks beyond TP × PP form the data-parallel groups. Nothing of the harness is imported: verify_trainer.py records
it unchanged (docs/megatron.md). `--seed_bug` plants one of the classic faults the tests seed."""

import argparse
import os
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F

VOCAB = 512


def arguments():
    p = argparse.ArgumentParser()
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--vpp", type=int, default=1, help="virtual pipeline stages (model chunks) a pipeline rank holds")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--tied", action="store_true", help="the output layer tied to the embedding")
    p.add_argument("--spec", choices=("local", "te"), default="local",
                   help="te: TransformerEngine's layer spec (GPUs, where TransformerEngine is installed)")
    p.add_argument("--grouped_gemm", action="store_true", help="MoE: the experts as one grouped GEMM (TE's)")
    p.add_argument("--fp8", action="store_true", help="TE's fp8 compute (hybrid): refused by the recorder")
    p.add_argument("--distributed_optimizer", action="store_true", help="megatron-core's ZeRO-1-like optimizer")
    p.add_argument("--dp_wrapper", choices=("ddp", "megatron_fsdp", "torch_fsdp2"), default="ddp",
                   help="megatron-core's DistributedDataParallel, Megatron-FSDP (optim_grads_params) or its torch "
                        "FSDP2 wrapper")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--micro_batches", type=int, default=2)
    p.add_argument("--micro_batch_size", type=int, default=2)
    p.add_argument("--seq_length", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--clip_grad", type=float, default=1.0)
    p.add_argument("--family", choices=("llama", "qwen2", "mixtral", "qwen3_moe", "qwen2_moe"), default="llama",
                   help="mixtral, qwen3_moe (Q/K norms), qwen2_moe (Q/K/V biases, a gated shared expert, top-k of the "
                        "softmax unnormalised): MoE layers of 4 experts, top-2")
    p.add_argument("--ep", type=int, default=1, help="expert parallelism (MoE)")
    p.add_argument("--etp", type=int, default=None, help="expert tensor parallelism (MoE; default: --tp)")
    p.add_argument("--aux_loss_coeff", type=float, default=1e-2, help="MoE: the router's load-balancing loss")
    p.add_argument("--z_loss_coeff", type=float, default=None, help="MoE: the router's z loss")
    p.add_argument("--normalization", choices=("RMSNorm", "LayerNorm"), default="RMSNorm")
    p.add_argument("--sequence_parallel", action="store_true", help="megatron-core's SP (with --tp 2 or more)")
    p.add_argument("--bf16", action="store_true", help="bf16 parameters (Float16Module), the optimizer's fp32 masters")
    p.add_argument("--fp16", action="store_true", help="fp16 parameters (Float16Module), the optimizer's fp32 masters "
                                                        "and its dynamic loss scaler (DynamicGradScaler)")
    p.add_argument("--initial_loss_scale", type=float, default=2.0 ** 32, help="fp16: the scale the scaler starts at")
    p.add_argument("--loss_scale_window", type=int, default=1000, help="fp16: good steps before the scale doubles")
    p.add_argument("--hysteresis", type=int, default=2, help="fp16: overflows before the scale halves")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: NCCL and one GPU per rank, as Megatron-LM runs (no tests/megatron_cpu.py)")
    p.add_argument("--seed_bug", choices=("none", "adam_step_twice", "grad_over_dp_twice", "micro_batch_dropped",
                                          "sp_norm_untagged", "expert_grads_not_averaged", "aux_loss_twice",
                                          "aux_over_dp", "micro_batch_scaled", "tied_grads_not_reduced", "not_unscaled",
                                          "step_on_overflow", "scale_grown_late", "scale_not_backed_off"),
                   default="none")
    p.add_argument("--seed", type=int, default=0, help="the weights' seed and the data's")
    return p.parse_args()


MOE = ("mixtral", "qwen3_moe", "qwen2_moe")


def dtype(args) -> torch.dtype:
    return torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32


def moe_settings(args) -> dict:
    """A MoE family's TransformerConfig fields: 4 experts of FFN 64, top-2, the alltoall dispatcher (EP over gloo)."""
    if args.family not in MOE:
        return {}
    shared = dict(moe_shared_expert_intermediate_size=96, moe_shared_expert_gate=True) \
        if args.family == "qwen2_moe" else {}
    return dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=64, moe_aux_loss_coeff=args.aux_loss_coeff,
                moe_z_loss_coeff=args.z_loss_coeff, moe_router_load_balancing_type="aux_loss",
                moe_router_pre_softmax=args.family == "qwen2_moe", moe_token_dispatcher_type="alltoall",
                expert_model_parallel_size=args.ep, expert_tensor_parallel_size=args.etp or args.tp,
                qk_layernorm=args.family == "qwen3_moe", moe_router_dtype="fp32", moe_grouped_gemm=args.grouped_gemm,
                **shared)


def model_provider(args, vp_stage=None):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=args.layers, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128,
        gated_linear_unit=True, activation_func=F.silu, normalization=args.normalization, layernorm_epsilon=1e-6,
        add_bias_linear=False, add_qkv_bias=args.family in ("qwen2", "qwen2_moe"), use_cpu_initialization=True,
        params_dtype=dtype(args), bf16=args.bf16, fp16=args.fp16, hidden_dropout=0.0,
        attention_dropout=0.0, gradient_accumulation_fusion=False,
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
        apply_rope_fusion=False, sequence_parallel=args.sequence_parallel, tensor_model_parallel_size=args.tp,
        pipeline_model_parallel_size=args.pp, virtual_pipeline_model_parallel_size=args.vpp if args.vpp > 1 else None,
        pipeline_dtype=dtype(args),
        **({"fp8": "hybrid"} if args.fp8 else {}), **moe_settings(args))
    from megatron.core import parallel_state

    if args.spec == "te":
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        spec = get_gpt_layer_with_transformer_engine_spec(num_experts=config.num_moe_experts,
                                                          moe_grouped_gemm=args.grouped_gemm,
                                                          qk_layernorm=config.qk_layernorm)
    else:
        spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, qk_layernorm=config.qk_layernorm)
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB,
                    max_sequence_length=args.seq_length, position_embedding_type="rope", rotary_base=10000,
                    share_embeddings_and_output_weights=args.tied,
                    pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
                    post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
                    vp_stage=vp_stage), config


def batches(args, dp_rank: int):
    """This DP rank's micro-batches, step after step: tokens, labels (the next tokens), a loss mask that leaves each
    row's last position out, positions."""
    step = 0
    while True:
        for micro in range(args.micro_batches):
            g = torch.Generator().manual_seed(1000 * step + 10 * micro + dp_rank + 7919 * args.seed)
            ids = torch.randint(0, VOCAB, (args.micro_batch_size, args.seq_length + 1), generator=g)
            mask = torch.ones(args.micro_batch_size, args.seq_length)
            mask[:, -1] = 0
            positions = torch.arange(args.seq_length)[None].expand(args.micro_batch_size, -1)
            yield {"tokens": ids[:, :-1], "labels": ids[:, 1:], "loss_mask": mask, "position_ids": positions}
        step += 1


def loss_func(loss_mask, output_tensor):
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask) / mask.sum()
    return loss, {"lm loss": loss.detach().clone()}


def forward_step(data_iterator, model, scale=1.0):
    device = next(model.parameters()).device
    batch = {key: value.to(device) for key, value in next(data_iterator).items()}
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    if scale != 1.0:  # the micro-batch's loss taken, its gradient scaled (0: dropped from what the step trains on)
        output = output.detach() + scale * (output - output.detach())
    return output, partial(loss_func, batch["loss_mask"])


def dropping_the_second(forward, scale=0.0):
    """The last stage's forward step with its second micro-batch of each step dropped from the gradient (`scale` 0),
    or its gradient scaled by `scale`; the loss it reports unchanged."""
    calls = [0]

    def forward_step(data_iterator, model):
        if not getattr(model, "module", model).post_process:  # a virtual stage before the last
            return forward(data_iterator, model)
        calls[0] += 1
        return forward(data_iterator, model, scale=scale if calls[0] % 2 == 0 else 1.0)

    return forward_step


def wrapped(args, model, config, ddp_config):
    """A model chunk as Megatron-LM wraps it: moved, in Float16Module for bf16, in its data-parallel wrapper."""
    from megatron.core.distributed import DistributedDataParallel

    if args.seed_bug == "sp_norm_untagged":  # a norm whose weights miss the tag: its gradient not all-reduced over TP
        for name, p in model.named_parameters():
            if "layernorm" in name:
                p.sequence_parallel = False
    if args.device == "cuda":  # built on the CPU (use_cpu_initialization), moved as Megatron-LM moves it
        model.cuda(torch.cuda.current_device())
    if args.bf16 or args.fp16:  # as Megatron-LM wraps it: bf16 (fp16) in, fp32 out
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(config, model)
    if args.dp_wrapper == "megatron_fsdp":
        from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel

        return FullyShardedDataParallel(config=config, ddp_config=ddp_config, module=model)
    if args.dp_wrapper == "torch_fsdp2":
        from megatron.core.distributed.torch_fully_sharded_data_parallel import TorchFullyShardedDataParallel

        return TorchFullyShardedDataParallel(config=config, ddp_config=ddp_config, module=model)
    return DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)


def seed_scaler_bug(args, optimizer) -> None:
    """fp16's seeded faults: the gradients not unscaled before the clip and the step (not_unscaled); a step taken
    where they overflowed (step_on_overflow: the overflow found, the scale updated, the step applied); the scale grown
    one good step late (scale_grown_late: after loss_scale_window + 1 good steps); the scale kept where the hysteresis
    is spent (scale_not_backed_off: never halved)."""
    inner = getattr(optimizer, "chained_optimizers", [optimizer])[0]  # get_megatron_optimizer's, in its chain
    if args.seed_bug == "not_unscaled":  # the overflow looked for as megatron-core does, by 1 instead of 1 / scale

        def check_only():
            inner.found_inf.fill_(0.0)
            torch._amp_foreach_non_finite_check_and_unscale_(inner._collect_main_grad_data_for_unscaling(),
                                                             inner.found_inf, torch.ones_like(inner.found_inf))
            dist.all_reduce(inner.found_inf, op=dist.ReduceOp.MAX, group=inner.get_grad_stats_parallel_group())
            return inner.found_inf.item() > 0

        inner._unscale_main_grads_and_check_for_nan = check_only
    if args.seed_bug == "step_on_overflow":
        prepare = optimizer.prepare_grads
        optimizer.prepare_grads = lambda: prepare() and False
    if args.seed_bug == "scale_grown_late":
        inner.grad_scaler.growth_interval = args.loss_scale_window + 1
    if args.seed_bug == "scale_not_backed_off":  # the hysteresis spent, the scale kept
        inner.grad_scaler.backoff_factor = 1.0


def main() -> None:
    args = arguments()
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp,
                                             virtual_pipeline_model_parallel_size=args.vpp if args.vpp > 1 else None,
                                             expert_model_parallel_size=args.ep,
                                             expert_tensor_parallel_size=args.etp or args.tp)
    torch.manual_seed(args.seed)
    model_parallel_cuda_manual_seed(args.seed)
    built = [model_provider(args, vp) for vp in (range(args.vpp) if args.vpp > 1 else [None])]
    config = built[0][1]
    sharded = args.dp_wrapper != "ddp"
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=args.distributed_optimizer or
        sharded, use_megatron_fsdp=args.dp_wrapper == "megatron_fsdp",
        data_parallel_sharding_strategy="optim_grads_params" if args.dp_wrapper == "megatron_fsdp" else "no_shard")
    models = [wrapped(args, chunk, config, ddp_config) for chunk, _ in built]  # one model chunk a virtual stage
    model = models[0]
    config.finalize_model_grads_func = finalize_model_grads
    if args.seed_bug == "tied_grads_not_reduced":  # the two stages' copies of a tied embedding each on its own gradient
        import importlib

        finalizing = importlib.import_module("megatron.core.distributed.finalize_model_grads")  # the module's
        finalizing._allreduce_word_embedding_grads = lambda *a, **k: None
    optimizer = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=args.lr, weight_decay=0.01, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8,
        clip_grad=args.clip_grad, bf16=args.bf16, fp16=args.fp16, initial_loss_scale=args.initial_loss_scale,
        loss_scale_window=args.loss_scale_window, hysteresis=args.hysteresis,
        use_distributed_optimizer=args.distributed_optimizer or sharded), models)
    if args.fp16:  # as Megatron-LM's train(): the schedules multiply each micro-batch's loss by the optimizer's scale
        config.grad_scale_func = optimizer.scale_loss
        seed_scaler_bug(args, optimizer)
    if args.seed_bug == "adam_step_twice":  # the step counter advanced twice: bias correction of a later step
        inner = optimizer.optimizer
        original = inner.step

        def step_twice(*a, **k):
            for state in inner.state.values():
                if "step" in state:
                    state["step"] += 1
            return original(*a, **k)

        inner.step = step_twice
    if args.seed_bug == "grad_over_dp_twice":  # the gradients averaged over DP once more than they should be
        dp = parallel_state.get_data_parallel_world_size()
        for group in model.bucket_groups:
            for bucket in group.buckets:
                bucket.gradient_scaling_factor /= dp
    if args.seed_bug == "expert_grads_not_averaged":  # the EP ranks' contributions to an expert summed, not averaged
        for group in model.expert_parallel_bucket_groups:
            for bucket in group.buckets:
                bucket.gradient_scaling_factor = 1.0
    if args.seed_bug == "aux_loss_twice":  # each router's load-balancing loss attached to its probabilities twice
        for layer in model.module.decoder.layers:
            router = layer.mlp.router
            once = router._apply_aux_loss
            router._apply_aux_loss = lambda probs, *a, once=once, **k: once(once(probs, *a, **k), *a, **k)
    if args.seed_bug == "aux_over_dp":  # the load-balancing statistics reduced over DP as well as TP: another group
        for layer in model.module.decoder.layers:
            layer.mlp.router.tp_cp_group = layer.mlp.router.tp_dp_cp_group
    step_function = forward_step
    if args.seed_bug in ("micro_batch_dropped", "micro_batch_scaled") and parallel_state.is_pipeline_last_stage():
        # scaled: by 1 / (micro-batches − 1) where the schedule scales by 1 / micro-batches
        scale = 0.0 if args.seed_bug == "micro_batch_dropped" else args.micro_batches / (args.micro_batches - 1)
        step_function = dropping_the_second(forward_step, scale)
    data = [batches(args, parallel_state.get_data_parallel_rank()) for _ in models]  # one iterator a model chunk
    forward_backward = get_forward_backward_func()
    for step in range(args.steps):
        for chunk in models:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        losses = forward_backward(forward_step_func=step_function, data_iterator=data if args.vpp > 1 else data[0],
                                  model=models,
                                  num_microbatches=args.micro_batches, seq_length=args.seq_length,
                                  micro_batch_size=args.micro_batch_size, forward_only=False)
        applied, grad_norm, _ = optimizer.step()
        if losses and parallel_state.get_tensor_model_parallel_rank() == parallel_state.get_data_parallel_rank() == 0:
            loss = sum(float(x["lm loss"]) for x in losses) / len(losses)  # the last stage's
            said = f"grad_norm {float(grad_norm):.6f}" if applied else "skipped (fp16 overflow)"
            print(f"step {step}: loss {loss:.6f} {said}" + (f" loss scale {float(optimizer.get_loss_scale()):g}"
                                                           if args.fp16 else ""), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
