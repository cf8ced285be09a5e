"""Every entry point's bad input, as a new user types it: exit 2, one `error: …` line that names the flag or
file and the fix, no traceback, nothing written or overwritten, and fast (no worker, no Ray).

Each case runs the command's own main in this process (what its script runs, argv and environment
included), so a traceback would fail the test; the scripts themselves, as processes, are run for one case
each, and for the unreachable cluster, which must fail in seconds rather than Ray's minutes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

import pytest

from conftest import CPU_HAS_FP16, REPO

SAVED_WEIGHTS = "w.pt"  # made by `workspace` for the cases that need a valid file


@pytest.fixture
def workspace(tmp_path, tiny_weights):
    """A user's folder: valid weights, an earlier run's record (must survive), a file where a folder is asked."""
    import shutil

    shutil.copy(tiny_weights, tmp_path / SAVED_WEIGHTS)
    (tmp_path / "loss").mkdir()
    (tmp_path / "loss" / "loss_ddp.json").write_text('{"earlier": "run"}')
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "no_config_dir").mkdir()
    (tmp_path / "text.pt").write_text("hello, not weights")
    (tmp_path / "truncated.pt").write_bytes((tmp_path / SAVED_WEIGHTS).read_bytes()[:100_000])
    (tmp_path / "tiny.txt").write_text("too short")
    (tmp_path / "ds_bf16.json").write_text('{"bf16": {"enabled": true}}')
    (tmp_path / "ds_both.json").write_text('{"bf16": {"enabled": true}, "fp16": {"enabled": true}}')
    for folder, config in MODEL_DIRS.items():
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "config.json").write_text(json.dumps(config))
    return tmp_path


# Local model folders of models the harness cannot train (as a user's checkpoint folder holds them): an
# encoder-decoder, a vision model, a mixture of experts DeepSpeed's AutoTP cannot shard, GPT-2, whose transformers
# class ships no pipeline plan (base_model_pp_plan: the pipeline refuses it; the others read its stack off its modules)
# and whose config names no KV heads, Mamba, whose layers hold no attention, Gemma 4, whose per-layer head_dim the TP
# seam cannot read and whose per-layer input embeddings no pipeline stage holds (DDP trains it), and a Llama config
# whose pad_token_id lies outside its vocabulary (its embedding refuses it).
MODEL_DIRS = {"t5": {"model_type": "t5", "d_model": 64, "num_layers": 2, "num_heads": 4, "vocab_size": 2048},
              "gpt2": {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 2048},
              "mamba": {"model_type": "mamba", "hidden_size": 64, "num_hidden_layers": 2, "state_size": 8,
                        "vocab_size": 2048},
              "gemma4": {"model_type": "gemma4_text", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 2048},
              "pad_outside": {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 2048,
                              "pad_token_id": 5000},
              "vit": {"model_type": "vit", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4},
              "moe": {"model_type": "qwen3_moe", "vocab_size": 2048, "hidden_size": 64, "intermediate_size": 128,
                      "moe_intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
                      "num_key_value_heads": 2, "num_experts": 4, "num_experts_per_tok": 2}}


def train_flags(**over) -> list[str]:
    base = {"model_name": "qwen2-tiny", "seq_length": 64, "init_weights_path": "{d}/w.pt",
            "loss_output_dir": "{d}/loss", "storage_path": "{d}/ray", "debug_steps": 2}
    argv = []
    for key, value in {**base, **over}.items():
        if value is None:
            continue
        argv += [f"--{key}"] if value is True else [f"--{key}", str(value)]
    return argv


def records(d) -> list[str]:
    """A folder with a DDP and an FSDP record, for plot_loss_curves cases (written by the harness's writer)."""
    from test_compare import DDP_LOSS, write_record

    write_record(d / "curves", "ddp", DDP_LOSS)
    write_record(d / "curves", "fsdp", DDP_LOSS)
    return ["--input_dir", f"{d}/curves", "--output", f"{d}/curves/c.png"]


def edit_record(d, edit) -> list[str]:
    argv = records(d)
    path = d / "curves" / "loss_fsdp.json"
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))
    return argv


def dumps(d, edit) -> list[str]:
    """A layer-check folder with two dumps, the second damaged by `edit(meta_path, tensor_path)`."""
    folder = d / "verify"
    folder.mkdir()
    for strategy in ("ddp", "fsdp"):
        valid_dump_meta(folder / f"dump_{strategy}.json", folder / f"dump_{strategy}.safetensors", strategy=strategy)
    edit(folder / "dump_fsdp.json", folder / "dump_fsdp.safetensors")
    return ["--input_dir", str(folder)]


def valid_dump_meta(meta_path, tensor_path, meta=None, strategy="fsdp"):
    import torch
    from safetensors.torch import save_file

    from parity.comparing.layers import META_KEYS

    meta_path.write_text(json.dumps(meta if meta is not None else {**{k: 1 for k in META_KEYS}, "strategy": strategy}))
    save_file({"output/x": torch.zeros(1)}, str(tensor_path))


# (id, command, argv (with {d} for the workspace), environment, the one line expected on stderr as a regex)
CASES = [
    # --- train_ddp.py -------------------------------------------------------------------------------------
    ("layout", "ddp", train_flags(num_workers=3, dp_size=2), {},
     r"--num_workers 3 ≠ --tp_size 1 × --dp_size 2: pass --num_workers 2 or change tp/dp"),
    ("ddp tp", "ddp", train_flags(tp_size=2), {}, r"DDP does not shard tensors: --tp_size must be 1 \(got 2\); use "),
    ("batch 0", "ddp", train_flags(batch_size=0), {}, r"--batch_size must be a positive integer \(got 0\)"),
    ("seq 1", "ddp", train_flags(seq_length=1), {}, r"--seq_length must be an integer >= 2 \(got 1\)"),
    ("seq long", "ddp", train_flags(seq_length=5000), {},
     r"--seq_length 5000 is above the model's max_position_embeddings \(4096\): use a shorter sequence"),
    ("steps 0", "ddp", train_flags(debug_steps=0), {}, r"--debug_steps must be a positive integer \(got 0\)"),
    ("seed", "ddp", train_flags(seed=-1), {}, r"--seed must be an integer >= 0 \(got -1\)"),
    ("lr nan", "ddp", train_flags(learning_rate="nan"), {}, r"--learning_rate must be a positive number \(got nan\)"),
    ("lr neg", "ddp", train_flags(learning_rate=-1), {}, r"--learning_rate must be a positive number \(got -1.0\)"),
    ("clip nan", "ddp", train_flags(max_grad_norm="nan"), {}, r"--max_grad_norm must be 0 \(off\) or positive \(got nan\)"),
    ("clip inf", "ddp", train_flags(max_grad_norm="inf"), {}, r"--max_grad_norm must be 0 \(off\) or positive \(got inf\)"),
    ("beta1", "ddp", train_flags(adam_beta1=1.5), {}, r"--adam_beta1 must be in \[0, 1\) \(got 1.5\)"),
    ("beta2", "ddp", train_flags(adam_beta2=1.0), {}, r"--adam_beta2 must be in \[0, 1\) \(got 1.0\)"),
    ("wd", "ddp", train_flags(weight_decay=-1), {}, r"--weight_decay must be 0 or positive \(got -1.0\)"),
    ("eps", "ddp", train_flags(adam_epsilon=0), {}, r"--adam_epsilon must be a positive number \(got 0.0\)"),
    ("warmup", "ddp", train_flags(warmup_steps=-1), {}, r"--warmup_steps must be an integer >= 0 \(got -1\)"),
    ("samples", "ddp", train_flags(num_samples=0), {}, r"--num_samples must be a positive integer \(got 0\)"),
    ("log", "ddp", train_flags(log_interval=0), {}, r"--log_interval must be a positive integer \(got 0\)"),
    ("replica check", "ddp", train_flags(replica_check_interval=0), {},
     r"--replica_check_interval must be a positive integer \(got 0\)"),
    ("not int", "ddp", train_flags(num_workers="abc"), {},
     r"argument --num_workers: invalid int value: 'abc' \(see --help\)"),
    ("precision", "ddp", train_flags(precision="fp8"), {},
     r"argument --precision: invalid choice: 'fp8' \(choose from 'auto', 'fp32', 'bf16', 'bf16_params', 'bf16_pure', "
     r"'fp16', 'fp16_autocast', 'bf16_base', "
     r"'bf16_base_autocast'\) \(see --help\)"),
    ("unknown flag", "ddp", train_flags(bogus=1), {}, r"unrecognized arguments: --bogus 1 \(see --help\)"),
    ("cuda", "ddp", train_flags(device="cuda"), {},
     r"--device cuda needs 2 GPUs \(one per worker\), the Ray cluster has 0: use --device cpu or fewer workers"),
    ("autocast fp32", "ddp", train_flags(autocast=True, precision="fp32"), {},
     r"--autocast asks for bf16 \(autocast over fp32 parameters\) but --precision fp32 was also given: pass only one of "
     r"them"),
    ("loss scale bf16", "ddp", train_flags(precision="bf16_params", loss_scale_window=2), {},
     r"--loss_scale_window sets fp16's loss scaler but the policy is bf16_params: pass --precision fp16, or drop it"),
    ("reduce fp16", "ddp", train_flags(precision="bf16_params", reduce_dtype="fp16"), {},
     r"--reduce_dtype fp16 is not a reduction of the bf16_params policy \(.*\): use bf16 or fp32"),
    ("accumulate pure", "ddp", train_flags(precision="bf16_pure", grad_accum_dtype="fp32"), {},
     r"--grad_accum_dtype fp32: the bf16_pure policy accumulates gradients in bf16"),
    ("bf16 base without LoRA", "ddp", train_flags(precision="bf16_base"), {},
     r"--precision bf16_base holds a frozen base in bf16 under the parameters that train: it needs frozen ones, LoRA's "
     r"base \(--lora_r R\); for a whole model in bf16 pass --precision bf16_pure"),
    ("bf16 base sharded", "fsdp", train_flags(precision="bf16_base", lora_r=8), {},
     r"fsdp does not run the bf16_base policy \(it runs fp32, bf16, bf16_params, bf16_pure, fp16, fp16_autocast\)"),
    ("hub model", "ddp", train_flags(model_name="nobody/no-such-model"), {},
     r"unknown model 'nobody/no-such-model': not a built-in model .* use a built-in model or a local directory"),
    ("encoder-decoder", "ddp", train_flags(model_name="{d}/t5"), {},
     r"--model_name .*/t5: a 't5' model is an encoder-decoder: the harness trains decoder-only causal language models"),
    ("not a causal LM", "ddp", train_flags(model_name="{d}/vit"), {},
     r"--model_name .*/vit: a 'vit' model has no causal-LM class in transformers \(AutoModelForCausalLM does not "
     r"take it\)"),
    ("no decoder stack found", "ddp", train_flags(model_name="{d}/mamba"), {},
     r"MambaForCausalLM has no pipeline plan naming its embedding and decoder stack \(base_model_pp_plan\), and its "
     r"modules do not show them \(one list of its 2 layers with attention heads, an input and an output embedding\): "
     r"the harness cannot find its decoder layers; it trains causal language models whose attention layers form one "
     r"stack"),
    ("the pipeline without a plan", "pipeline", train_flags(model_name="{d}/gpt2", num_workers=2,
                                                            init_weights_path="{d}/new.pt", save_init_weights=True), {},
     r"the pipeline cannot split a 'gpt2' model: transformers ships no pipeline plan for GPT2LMHeadModel "
     r"\(base_model_pp_plan\), which lays out the stages' inputs and outputs: use train_ddp.py or train_fsdp.py"),
    # --- the pipeline, SP, DeepSpeed's policies and AutoEP: what each declines (docs/refusals.md) ---------------
    ("pipeline accumulation", "pipeline", train_flags(num_workers=2, pp_size=2, grad_accum_steps=2), {},
     r"--grad_accum_steps 2: the pipeline accumulates over its micro-batches: use --microbatches \(and "
     r"--grad_accum_steps 1\)"),
    ("pipeline checkpointing", "pipeline", train_flags(num_workers=2, pp_size=2, activation_checkpointing=True), {},
     r"--activation_checkpointing is not supported by the pipeline strategy: drop it"),
    ("pipeline compile", "pipeline", train_flags(num_workers=2, pp_size=2, compile=True), {},
     r"--compile is not supported by the pipeline strategy: drop it"),
    ("pipeline MoE", "pipeline", train_flags(num_workers=2, pp_size=2, model_name="qwen3-moe-tiny",
                                             init_weights_path="{d}/new.pt", save_init_weights=True), {},
     r"the pipeline does not train a mixture of experts \('qwen3_moe'\): its load-balancing loss is one product of "
     r"statistics of every stage's routers over the global batch .*: use train_fsdp.py or train_ddp.py"),
    ("pipeline stages", "pipeline", train_flags(num_workers=3, pp_size=3), {},
     r"the model's 2 layers do not divide into the 3 stages of --pp_schedule 1f1b at --pp_size 3: use --num_layers 3 "
     r"\(a multiple of 3\) or fewer stages"),
    ("SP over experts", "fsdp", train_flags(num_workers=2, tp_size=2, tp_plan="sequence_parallel",
                                            model_name="qwen3-moe-tiny", init_weights_path="{d}/new.pt",
                                            save_init_weights=True), {},
     r"--tp_plan sequence_parallel does not shard a mixture of experts' sparse blocks over the sequence: use --tp_plan "
     r"default"),
    ("autocast bf16 reduction", "deepspeed", train_flags(precision="bf16", reduce_dtype="bf16"), {},
     r"--reduce_dtype bf16 in the bf16 \(autocast\) policy: DeepSpeed's torch_autocast reduces only its "
     r"lower_precision_safe_modules' gradients in bf16, not all of them: use --precision bf16_params"),
    ("bf16_pure offload", "deepspeed", train_flags(precision="bf16_pure", offload_optimizer="cpu"), {},
     r"the bf16_pure policy with --offload_optimizer cpu: DeepSpeed keeps bf16 master weights in host memory only with "
     r"its DeepSpeedCPUAdam, not the shared torch AdamW: drop one of the two"),
    ("AutoEP conversion", "deepspeed", train_flags(num_workers=2, ep_size=2, model_name="qwen3-moe-tiny",
                                                   precision="bf16", init_weights_path="{d}/new.pt",
                                                   save_init_weights=True), {},
     r"DeepSpeed [0-9.]+'s AutoEP cannot convert a 'qwen3_moe' model under transformers [0-9.]+: "),
    ("a family TP cannot describe", "fsdp", train_flags(model_name="{d}/gemma4", num_workers=2, tp_size=2,
                                                        init_weights_path="{d}/new.pt", save_init_weights=True), {},
     r"FSDP2 \+ TP cannot tensor-parallelise a 'gemma4_text' model \(its layers cannot be described "
     r"\(AmbiguousGlobalPerLayerAttributeError: .*\)\): use --tp_size 1, or train_ddp.py / train_pipeline.py"),
    ("the pipeline past per-layer inputs", "pipeline", train_flags(model_name="{d}/gemma4", num_workers=2,
                                                                  init_weights_path="{d}/new.pt",
                                                                  save_init_weights=True), {},
     r"the pipeline cannot split a 'gemma4_text' model: its model.embed_tokens_per_layer, "
     r"model.per_layer_model_projection, model.per_layer_projection_norm lie outside the embedding, the decoder stack "
     r"and the final modules its stages run: use train_ddp.py or train_fsdp.py"),
    ("config its class refuses", "ddp", train_flags(model_name="{d}/pad_outside"), {},
     r"transformers cannot build a 'llama' model from this config \(AssertionError: Padding_idx must be within "
     r"num_embeddings\): fix its config.json"),
    ("one KV head at TP 2", "fsdp", train_flags(model_name="google/gemma-3-1b-pt", num_layers=2, num_workers=2, tp_size=2),
     {}, r"--tp_size 2 does not divide the model's KV-head count \(1\): use a tp_size in \[1\]"),
    ("DeepSpeed refuses a family", "deepspeed", train_flags(model_name="{d}/moe", num_workers=2, tp_size=2), {},
     r"DeepSpeed AutoTP cannot shard a 'qwen3_moe' model: DeepSpeed 0.19.8 refuses its experts' plan \(moe_tp_experts\) "
     r"and shards no fused 3-D expert weight: use --tp_size 1 \(ZeRO\), or train_fsdp.py / train_transformers.py"),
    ("transformers compile", "transformers", train_flags(num_workers=2, tp_size=2, compile=True), {},
     r"--compile is not supported by the transformers strategy"),
    ("transformers LoRA FSDP2", "transformers", train_flags(num_workers=2, lora_r=4), {},
     r"LoRA under transformers' FSDP2 \(--dp_size 2\): from_pretrained shards the model before peft can add the "
     r"adapters, .*: use --dp_size 1 \(transformers' TP\), or train_fsdp.py"),
    ("transformers LoRA rowwise", "transformers", train_flags(num_workers=2, tp_size=2, lora_r=4,
                                                              lora_targets="q_proj,o_proj"), {},
     r"--lora_targets o_proj at --tp_size 2: transformers' TP plan shards it rowwise, and peft builds its lora_A with "
     r"the local in_features, .*: leave it out of --lora_targets \(colwise targets: gate_proj, k_proj, q_proj, "
     r"up_proj, v_proj\), or use train_fsdp.py"),
    ("AutoTP LoRA", "deepspeed", train_flags(num_workers=2, tp_size=2, lora_r=4), {},
     r"LoRA under DeepSpeed's AutoTP or AutoEP \(--tp_size 2, --ep_size 1\): AutoTP replaces each projection peft "
     r"wrapped by a sharded copy of its base, adapters dropped"),
    ("model dir", "ddp", train_flags(model_name="{d}/no_config_dir"), {},
     r"--model_name .*/no_config_dir is a directory without config.json: point it at a Hugging Face model directory"),
    ("layers", "ddp", train_flags(num_layers=3), {}, r"has 2 layers, run asks for 3: pass --num_layers 2"),
    ("weights missing", "ddp", train_flags(init_weights_path="{d}/nope.pt"), {},
     r"init weights file .*/nope.pt does not exist: run train_ddp.py with --save_init_weights first"),
    ("weights dir", "ddp", train_flags(init_weights_path="{d}"), {},
     r"init weights file .* is a directory: give the weights file's path \(e.g. .*/init_weights.pt\)"),
    ("weights text", "ddp", train_flags(init_weights_path="{d}/text.pt"), {},
     r"text.pt is not a PyTorch weights file \(torch.save writes a zip archive; this is not one\): recreate it"),
    ("weights truncated", "ddp", train_flags(init_weights_path="{d}/truncated.pt"), {},
     r"truncated.pt is truncated or corrupt \(its torch.save archive is incomplete\): recreate it with"),
    ("save into dir", "ddp", train_flags(init_weights_path="{d}/loss", save_init_weights=True), {},
     r"--init_weights_path .*/loss is a directory: give the file to write \(e.g. .*/loss/init_weights.pt\)"),
    ("loss dir", "ddp", train_flags(loss_output_dir="{d}/a_file/loss"), {},
     r"--loss_output_dir .*a_file/loss is not a writable directory \(.*a_file is a file\): choose a directory"),
    ("storage", "ddp", train_flags(storage_path="{d}/a_file"), {},
     r"--storage_path .*a_file is not a writable directory \(it is a file\): choose a directory you can write to"),
    ("final dir", "ddp", train_flags(final_checkpoint_dir="{d}/a_file/final"), {},
     r"--final_checkpoint_dir's parent .*a_file is not a writable directory \(it is a file\)"),
    ("text missing", "ddp", train_flags(dataset="text:{d}/none.txt"), {},
     r"--dataset text:.*none.txt: no such file .*none.txt: give the path of a UTF-8 text file"),
    ("dataset name", "ddp", train_flags(dataset="imagenet"), {},
     r"--dataset imagenet is not known: use synthetic, synthetic_padded, wikitext or text:PATH"),
    ("lora targets", "ddp", train_flags(lora_r=4, lora_targets="q_proj,nope"), {},
     r"--lora_targets nope names no linear layer of qwen2 \(its linear layers: down_proj, gate_proj, k_proj, o_proj, "
     r"q_proj, up_proj, v_proj\): name some of them"),
    ("lora dropout", "ddp", train_flags(lora_r=4, lora_dropout=0.1), {},
     r"--lora_dropout 0.1: each strategy draws dropout masks in its own order .*: use --lora_dropout 0"),
    ("lora alpha alone", "ddp", train_flags(lora_alpha=16), {}, r"which --lora_r turns on: pass --lora_r R"),
    ("lora saved module", "ddp", train_flags(lora_r=4, lora_modules_to_save="norm,nope"), {},
     r"--lora_modules_to_save nope names no module of qwen2 that holds parameters \(its modules: down_proj, "
     r"embed_tokens, gate_proj, input_layernorm, k_proj, lm_head, norm, o_proj, post_attention_layernorm, q_proj, "
     r"up_proj, v_proj\): name some of them"),
    ("lora saved target", "ddp", train_flags(lora_r=4, lora_targets="q_proj,v_proj", lora_modules_to_save="v_proj"),
     {}, r"--lora_modules_to_save v_proj is also a LoRA target: a module trains either whole or through adapters"),
    ("transformers saved sharded", "transformers", train_flags(num_workers=2, tp_size=2, lora_r=4, lora_targets="q_proj",
                                                               lora_modules_to_save="embed_tokens,norm"), {},
     r"--lora_modules_to_save embed_tokens at --tp_size 2: transformers' TP plan shards it, and peft saves a module by "
     r"deep-copying it, .*invalid python storage.*: save modules the plan leaves whole \(the norms\), or use "
     r"train_fsdp.py"),
    ("lora adapters missing", "ddp", train_flags(lora_r=4), {},
     r"the adapters' initial weights .*w\.pt\.lora\.safetensors do not exist: run train_ddp\.py with the same --lora_\* "
     r"flags and --save_init_weights first"),
    ("lora sequence parallel", "fsdp", train_flags(lora_r=4, tp_size=2, tp_plan="sequence_parallel"), {},
     r"LoRA with --tp_plan sequence_parallel: .*: use --tp_plan default"),
    ("packing padded", "ddp", train_flags(dataset="synthetic_padded", packing=True), {},
     r"--packing with --dataset synthetic_padded: its rows are padded samples, and packed rows hold no padding; use "
     r"--dataset synthetic \(--packing packs its documents of varying lengths\), or --padding_free to drop padding"),
    ("padding free recorded", "ddp", train_flags(dataset="recorded:{d}/batches", padding_free=True), {},
     r"--padding_free with a recorded run's batches: a replay feeds each row as the run fed it; drop --padding_free"),
    ("text small", "ddp", train_flags(dataset="text:{d}/tiny.txt", tokenizer="bytes"), {},
     r"holds fewer samples than one global batch \(4\): use more data, a shorter --seq_length or a smaller batch"),
    ("tokenizer", "ddp", train_flags(dataset="text:{d}/tiny.txt", tokenizer="nobody/tok"), {},
     r"tokenizer nobody/tok could not be loaded \(.*\): pass --tokenizer bytes or a local tokenizer directory"),
    # --- train_deepspeed.py / train_fsdp.py --------------------------------------------------------------
    ("config bf16 fp32", "deepspeed", train_flags(num_workers=4, tp_size=2, deepspeed_config="{d}/ds_bf16.json",
                                                  precision="fp32"), {},
     r"--deepspeed_config .*ds_bf16.json asks for the bf16_params policy \(bf16 parameters and gradients, fp32 master "
     r"weights and Adam state\) but --precision is fp32: pass --precision bf16_params \(or drop --precision\)"),
    ("config fp16 bf16", "deepspeed", train_flags(num_workers=4, tp_size=2, deepspeed_config="{d}/ds_both.json"), {},
     r"--deepspeed_config .*ds_both.json enables both bf16 and fp16: DeepSpeed runs one precision mode: keep one of the "
     r"sections enabled"),
    pytest.param("deepspeed fp16 cpu", "deepspeed", train_flags(num_workers=4, tp_size=2, precision="fp16"), {},
                 r"DeepSpeed's fp16 mode on CPU workers: DeepSpeed refuses it at initialize on a CPU without fp16 "
                 r"kernels", marks=pytest.mark.skipif(CPU_HAS_FP16, reason="this CPU has fp16 kernels: DeepSpeed runs "
                                                                           "fp16 here"), id="deepspeed fp16 cpu"),
    ("zero 0 accumulation", "deepspeed", train_flags(num_workers=2, zero_stage=0, precision="bf16_params",
                                                     grad_accum_dtype="fp32"), {},
     r"--zero_stage 0 with micro-batches accumulated in fp32: DeepSpeed accumulates in the parameters' bf16 without "
     r"ZeRO"),
    ("zero 4", "deepspeed", train_flags(num_workers=4, tp_size=2, zero_stage=4), {},
     r"argument --zero_stage: invalid choice: 4 \(choose from 0, 1, 2, 3\) \(see --help\)"),
    ("master fp32", "deepspeed", train_flags(num_workers=4, tp_size=2, bf16_master_weights=True, precision="fp32"), {},
     r"--bf16_master_weights asks for the bf16_pure policy \(.*\) but --precision is fp32: pass --precision bf16_pure"),
    ("kv heads", "deepspeed", train_flags(num_workers=3, tp_size=3), {},
     r"--tp_size 3 does not divide the model's KV-head count \(2\): use a tp_size in \[1, 2\]"),
    ("policy fp32", "fsdp", train_flags(num_workers=4, tp_size=2, mixed_precision="policy", precision="fp32"), {},
     r"--mixed_precision policy asks for the bf16_params policy \(.*\) but --precision is fp32: pass --precision "
     r"bf16_params"),
    ("fsdp accumulation", "fsdp", train_flags(num_workers=2, precision="bf16_params", batch_size=2, grad_accum_steps=2,
                                              grad_accum_dtype="fp32"), {},
     r"--grad_accum_dtype fp32 with --reduce_dtype bf16: FSDP2 accumulates micro-batch gradients in the dtype it reduces "
     r"them in: pass --grad_accum_dtype bf16"),
    ("own strategy policy", "ddp", train_flags(num_workers=2, precision="bf16_params",
                                               strategy_class="my_strategy:HandWrittenDP"), {},
     r"hand_written_dp does not run the bf16_params policy \(it runs fp32, bf16\): pass one of them with --precision"),
    ("not multiple", "fsdp", train_flags(num_workers=3, tp_size=2), {},
     r"--num_workers 3 is not a multiple of --tp_size 2: num_workers must equal tp_size × dp_size"),
    ("sp tp1", "fsdp", train_flags(num_workers=2, tp_plan="sequence_parallel"), {},
     r"--tp_plan sequence_parallel shards the sequence over the TP ranks but --tp_size is 1: use --tp_size 2 or more"),
    ("sp seq", "fsdp", train_flags(num_workers=2, tp_size=2, seq_length=63, tp_plan="sequence_parallel"), {},
     r"--tp_plan sequence_parallel splits the sequence into --tp_size 2 chunks: --seq_length 63 must be a multiple of "
     r"it"),
    ("ac compile", "fsdp", train_flags(num_workers=2, activation_checkpointing=True, compile=True), {},
     r"--activation_checkpointing with --compile: torch's composable checkpoint finds the compiled layers' recomputed "
     r"tensors changed \(torch.utils.checkpoint.CheckpointError, pytorch#166926\): use one of the two"),
    # --- plot_loss_curves.py --------------------------------------------------------------------------------
    ("no input dir", "plot", ["--input_dir", "{d}/none", "--output", "{d}/c.png"], {},
     r"--input_dir .*/none is not a directory"),
    ("no records", "plot", ["--input_dir", "{d}/a_dir_without", "--output", "{d}/c.png"], {},
     r"no loss_\*.json in .*: run the train_\*.py scripts with --loss_output_dir .* first"),
    ("tolerance neg", "plot", lambda d: records(d) + ["--tolerance", "-1"], {},
     r"argument --tolerance: must be a finite number >= 0 \(got -1\) \(see --help\)"),
    ("tolerance nan", "plot", lambda d: records(d) + ["--grad_norm_tolerance", "nan"], {},
     r"argument --grad_norm_tolerance: must be a finite number >= 0 \(got nan\) \(see --help\)"),
    ("figure ext", "plot", lambda d: records(d)[:3] + [f"{d}/c.jpg"], {},
     r"--output .*c.jpg: unknown extension '.jpg': use .png, .svg, .pdf"),
    ("record truncated", "plot", lambda d: (records(d), (d / "curves/loss_fsdp.json").write_text('{"st'))[0], {},
     r"loss_fsdp.json: not valid JSON .*; the file is malformed or truncated: rerun that strategy"),
    ("record list", "plot", lambda d: (records(d), (d / "curves/loss_fsdp.json").write_text("[1, 2]"))[0], {},
     r"loss_fsdp.json: expected a JSON object with 'strategy', 'config' and 'steps'"),
    ("record step", "plot", lambda d: edit_record(d, lambda r: r["steps"][1].pop("param_norm")), {},
     r"loss_fsdp.json: steps\[1\] lacks param_norm"),
    ("not comparable", "plot", lambda d: edit_record(d, lambda r: r["config"].update(init_weights_sha256="6" * 64)), {},
     r"not comparable: ddp and fsdp start from different initial weights .*: train both from the same "),
    ("old schema", "plot", lambda d: edit_record(d, lambda r: r.update(schema_version=1)), {},
     r"loss_fsdp.json: schema version 1, this harness reads 7 .*: rerun that strategy, or record the run again"),
    ("record replicas", "plot", lambda d: edit_record(d, lambda r: r["steps"][1].update(replicas={"parted": "x"})), {},
     r"loss_fsdp.json: steps\[1\].replicas is not a replica check's entry \('checked' and 'parted' counts\)"),
    # --- compare_dumps.py -----------------------------------------------------------------------------------
    ("no dumps", "compare_dumps", ["--input_dir", "{d}"], {},
     r"holds no dump_\*.json: run run_verification.py --output_dir .* first"),
    ("dump meta list", "compare_dumps", lambda d: dumps(d, lambda m, t: m.write_text("[1]")), {},
     r"dump_fsdp.json is not a dump's metadata \(it lacks strategy, tp_size, dp_size …\): rerun that strategy"),
    ("dump meta keys", "compare_dumps",
     lambda d: dumps(d, lambda m, t: valid_dump_meta(m, t, {"strategy": "fsdp"})), {},
     r"dump_fsdp.json is not a dump's metadata \(it lacks tp_size, dp_size, precision …\): rerun that strategy"),
    ("dump meta json", "compare_dumps", lambda d: dumps(d, lambda m, t: m.write_text('{"strat')), {},
     r"dump_fsdp.json cannot be read \(JSONDecodeError: .*\): rerun that strategy into the folder"),
    ("dump truncated", "compare_dumps", lambda d: dumps(d, lambda m, t: t.write_bytes(t.read_bytes()[:20])), {},
     r"dump_fsdp.safetensors cannot be read \(.*\): rerun that strategy into the folder"),
    ("dumps tolerance", "compare_dumps", ["--input_dir", "{d}", "--tolerance", "-1"], {},
     r"argument --tolerance: must be a finite number >= 0 \(got -1\) \(see --help\)"),
    # --- run_verification.py ------------------------------------------------------------------------------
    ("verify tolerance", "run_verification", ["--output_dir", "{d}/v", "--tolerance", "-1"], {},
     r"argument --tolerance: must be a finite number >= 0 \(got -1\) \(see --help\)"),
    ("perturb param", "run_verification", ["--output_dir", "{d}/v", "--device", "cpu", "--perturb", "fsdp:no.such.w"], {},
     r"--perturb fsdp:no.such.w: the model has no parameter no.such.w \(e.g. model.layers.0.mlp.up_proj.weight\)"),
    ("perturb form", "run_verification", ["--output_dir", "{d}/v", "--perturb", "megatron"], {},
     r"--perturb megatron: expected STRATEGY:PARAM with STRATEGY one of ddp, deepspeed, fsdp"),
    ("verify layers", "run_verification", ["--output_dir", "{d}/v", "--device", "cpu", "--num_layers", "0"], {},
     r"--num_layers must be a positive integer \(got 0\)"),
    ("verify option", "run_verification", ["--output_dir", "{d}/v", "--strategy", "ddp", "--zero_stage", "2"], {},
     r"--zero_stage is a deepspeed flag, but --strategy ddp runs no deepspeed step: drop it or run --strategy all"),
    ("verify local gpus", "run_verification", ["--output_dir", "{d}/v", "--launcher", "local", "--device", "cuda"], {},
     r"--launcher local --device cuda: torch sees no GPU on this machine: use --device cpu, or --launcher ray for a "
     r"cluster's GPUs"),
    ("verify AutoEP", "run_verification", ["--output_dir", "{d}/v", "--strategy", "deepspeed", "--ep_size", "2"], {},
     r"--ep_size with --strategy deepspeed: DeepSpeed's AutoEP replaces the sparse block by its own modules .* or "
     r"leave deepspeed out"),
    ("verify half folder", "run_verification",
     lambda d: ((d / "v").mkdir(), (d / "v/init_weights.safetensors").write_bytes(b"x"), ["--output_dir", f"{d}/v"])[2],
     {}, r"has init_weights.safetensors but no inputs.safetensors: a layer-check folder needs both; use a fresh"),
    # --- run_verification_main.sh ---------------------------------------------------------------------------
    ("main tp", "main", ["--output_dir", "{d}/m", "--tp_size", "3", "--device", "cpu"], {},
     r"--tp_size 3 does not divide the model's KV-head count \(2\): use a tp_size in \[1, 2\]"),
    ("main tp env", "main", ["--output_dir", "{d}/m"], {"TP_SIZE": "0"}, r"--tp_size must be a positive integer \(got 0\)"),
    ("main tp text", "main", ["--output_dir", "{d}/m", "--tp_size", "abc"], {},
     r"argument --tp_size: invalid int value: 'abc' \(see --help\)"),
    ("main order", "main", ["--output_dir", "{d}/m"], {"STRATEGIES": "fsdp ddp"},
     r"STRATEGIES 'fsdp ddp' must start with ddp: the DDP run writes the initial weights and is the baseline"),
    ("main unknown", "main", ["--output_dir", "{d}/m", "--strategies", "ddp megatron"], {},
     r"unknown strategy 'megatron' in STRATEGIES: use ddp, deepspeed, fsdp"),
    ("main extra", "main", ["--output_dir", "{d}/m", "--strategies", "ddp fsdp", "--extra_args", "--zero_stage 2"], {},
     r"EXTRA_ARGS --zero_stage is a deepspeed flag, but STRATEGIES has no deepspeed run"),
    ("main extra bad", "main", ["--output_dir", "{d}/m", "--extra_args", "--learning_rate nan"], {},
     r"--learning_rate must be a positive number \(got nan\)"),
    ("main flag", "main", ["--output_dir", "{d}/m", "--bogus", "1"], {}, r"unrecognized arguments: --bogus 1 \(see --help\)"),
    ("checkpoint interval", "ddp", train_flags(checkpoint_interval=-1), {},
     r"--checkpoint_interval must be an integer >= 0 \(got -1\)"),
    ("keep checkpoints", "ddp", train_flags(keep_checkpoints=-2), {},
     r"--keep_checkpoints must be an integer >= 0 \(got -2\)"),
    ("max failures", "ddp", train_flags(max_failures=-2), {},
     r"--max_failures must be -1 \(no limit\) or an integer >= 0 \(got -2\)"),
    # --- make_rollouts.py and check_rollouts.py --------------------------------------------------------------
    ("rollouts output", "make_rollouts",
     ["--init_weights_path", "{d}/" + SAVED_WEIGHTS, "--output", "{d}/loss/loss_ddp.json/r.st"], {},
     r"--output .*/loss/loss_ddp.json is not a writable directory \(it is a file\): choose a directory you can write to"),
    ("rollouts to judge", "check_rollouts",
     ["--rollouts", "{d}/r.safetensors", "--init_weights_path", "{d}/" + SAVED_WEIGHTS], {},
     r"--rollouts .*/r.safetensors: no such file: write one with make_rollouts.py"),
    # --- check_context_parallel.py --------------------------------------------------------------------------
    ("cp size", "context_parallel", ["--cp_size", "1"], {},
     r"--cp_size 1: context parallelism splits the sequence over at least 2 ranks: use --cp_size 2 or more"),
    ("cp seq", "context_parallel", ["--seq_length", "100", "--cp_size", "4"], {},
     r"--seq_length 100 is not a multiple of 2 × --cp_size \(8\): the load balancer gives each rank a head and a "
     r"tail chunk"),
    ("cp cuda", "context_parallel", ["--device", "cuda"], {},
     r"--device cuda needs 2 GPUs \(one per CP rank\), this machine has 0: use --device cpu or a smaller --cp_size"),
]


def command_main(command: str):
    from parity.commands import (check_rollouts, compare_curves, compare_layers, context_parallel, layer_check, main_job,
                                 make_rollouts, train)

    return {"plot": compare_curves.main, "compare_dumps": compare_layers.main, "run_verification": layer_check.main,
            "main": main_job.main, "context_parallel": context_parallel.main, "make_rollouts": make_rollouts.main,
            "check_rollouts": check_rollouts.main}.get(command) or (lambda argv: train.main(command, argv=argv))


def snapshot(root) -> dict:
    return {os.path.relpath(os.path.join(d, f), root): os.stat(os.path.join(d, f)).st_mtime_ns
            for d, dirs, files in os.walk(root) for f in files} | {
            os.path.relpath(os.path.join(d, x), root) + "/": 0 for d, dirs, _ in os.walk(root) for x in dirs}


@pytest.mark.parametrize("name,command,argv,env,expected", CASES, ids=[getattr(c, "id", None) or c[0] for c in CASES])
def test_bad_input(workspace, capsys, monkeypatch, name, command, argv, env, expected):
    import re

    (workspace / "a_dir_without").mkdir()
    argv = argv(workspace) if callable(argv) else [a.replace("{d}", str(workspace)) for a in argv]
    for key in ("TP_SIZE", "DP_SIZE", "STRATEGIES", "EXTRA_ARGS", "RAY_ADDRESS"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    before = snapshot(workspace)
    capsys.readouterr()
    started = time.perf_counter()
    try:
        code = command_main(command)(argv)
    except SystemExit as exc:  # argparse's own exit, with its one line
        code = exc.code
    elapsed = time.perf_counter() - started
    out, err = capsys.readouterr()
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert re.search(expected, lines[0]), lines[0]
    assert "Traceback" not in out + err
    assert snapshot(workspace) == before  # nothing written, nothing overwritten (loss/loss_ddp.json kept)
    assert elapsed < 10, f"{elapsed:.1f} s"


SCRIPTS = ["train_ddp.py", "train_deepspeed.py", "train_fsdp.py", "plot_loss_curves.py", "run_verification.py",
           "compare_dumps.py", "run_verification_main.sh", "check_context_parallel.py"]


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_script_as_a_process_prints_one_line_and_exits_2(tmp_path, script):
    """The scripts themselves: an argument that is not a number gives one line and exit 2, nothing else."""
    flag = ("--tp_size" if script.startswith(("train", "run_verification")) else
            "--cp_size" if script == "check_context_parallel.py" else "--tolerance")
    argv = ([sys.executable] if script.endswith(".py") else ["bash"]) + [os.path.join(REPO, script), flag, "x"]
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=tmp_path, timeout=180,
                          env={**os.environ, "RAY_ADDRESS": ""})
    assert (proc.returncode, proc.stdout) == (2, "")
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"error: argument {flag}: ") and "x" in line and line.endswith("(see --help)"), line
    assert os.listdir(tmp_path) == []


def test_an_unreachable_cluster_is_one_line_before_ray_starts(tmp_path, tiny_weights):
    """RAY_ADDRESS naming a port nothing listens on: one line from the harness's own check, made before ray.init (which
    would retry the cluster's GCS for minutes without a word): the connection's own refusal in it says that check spoke.
    No wall-clock bound: on a loaded machine the whole process took 49 s (the timeout guards a hang)."""
    argv = [sys.executable, os.path.join(REPO, "train_ddp.py"),
            *[a.replace("{d}", str(tmp_path)) for a in train_flags(init_weights_path=tiny_weights)]]
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=tmp_path, timeout=180,
                          env={**os.environ, "RAY_ADDRESS": "127.0.0.1:1"})
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: cannot reach the Ray cluster at 127.0.0.1:1 (127.0.0.1:1: Connection refused): start it, or unset "
        "RAY_ADDRESS to run on a local one"]
    assert not (tmp_path / "loss").exists()


def test_good_input_resolves_defaults(tmp_path, tiny_weights):
    """The other side of the catalogue: the same flags without the mistake resolve, with the defaults filled."""
    from parity.driver.config import resolve

    values = {"model_name": "qwen2-tiny", "seq_length": 64, "init_weights_path": tiny_weights,
              "loss_output_dir": tmp_path / "loss", "storage_path": tmp_path / "ray"}
    cfg = resolve("ddp", values)
    assert (cfg.dp_size, cfg.learning_rate, cfg.tokenizer, cfg.experiment_name) == (2, 1e-3, "bytes", "ddp_tp1_dp2")
    assert cfg.final_checkpoint_dir == str(tmp_path / "ray" / "ddp_tp1_dp2" / "final_model")
    assert not os.listdir(tmp_path)  # resolving writes nothing, not even the output folders
    saving = resolve("ddp", {**values, "init_weights_path": tmp_path / "new" / "w.pt", "save_init_weights": True})
    assert saving.save_init_weights and saving.init_weights_path == str(tmp_path / "new" / "w.pt")


def test_a_family_whose_config_names_no_kv_heads_resolves_at_tp2():
    """GPT-NeoX (Pythia's family) names no num_key_value_heads — one KV head per attention head — and before this
    the layout check read that field and crashed every run of it, DDP's too (exit 70, 'a bug of the harness'); Falcon
    names its own (num_kv_heads) or one (multi_query). Its layout at TP 2 resolves (GPT-NeoX measured once at fp32
    parity under FSDP2 + TP, AutoTP and the pipeline: docs/model_families.md); at TP 3 the heads are named."""
    from transformers import FalconConfig, GPTNeoXConfig, LlamaConfig

    from parity.driver.config import resolve
    from parity.errors import ConfigError
    from parity.models.families import kv_heads

    neox = GPTNeoXConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                         vocab_size=2048)
    assert [kv_heads(neox), kv_heads(FalconConfig(num_attention_heads=8, new_decoder_architecture=True,
                                                  num_kv_heads=2)),
            kv_heads(FalconConfig(num_attention_heads=8, multi_query=True)),
            kv_heads(LlamaConfig(num_attention_heads=8, num_key_value_heads=2))] == [4, 2, 1, 2]
    folder = tempfile.mkdtemp()
    neox.save_pretrained(folder)
    values = {"model_name": folder, "seq_length": 64, "init_weights_path": os.path.join(folder, "w.pt"),
              "save_init_weights": True, "loss_output_dir": os.path.join(folder, "loss"), "num_workers": 2,
              "tp_size": 2, "storage_path": os.path.join(folder, "ray")}
    assert resolve("fsdp", values).tp_size == 2
    with pytest.raises(ConfigError, match=r"--tp_size 3 does not divide the model's KV-head count \(4\)"):
        resolve("fsdp", {**values, "num_workers": 3, "tp_size": 3})
