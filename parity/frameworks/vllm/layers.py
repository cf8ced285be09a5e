"""Where an in-process vLLM engine's forward first parts from the trainer's transformers model (docs/sampler.md#the-
first-layer-apart): the same rows through both at the same weights, each decoder layer's output compared — vLLM's
layer returns its MLP output and the residual apart (the residual added by the next layer's norm), their sum is the
stream transformers' layer returns. Judged per layer against the noise of the arithmetic: transformers' model under
autocast to the engine's dtype against fp32 (in fp32, the rounding of fp32). Needs the engine in this process for its
hooks (TRL's colocate mode; VLLM_ENABLE_V1_MULTIPROCESSING=0). The trainer's model runs its decoder alone, under
no_grad, with hooks of its own on its layers for the call: no copy of the model, its weights untouched.

vLLM's defaults compile the model (torch.compile of its forward, whose graph calls no layer's forward hook: the probe
saw none and stopped on the empty captures). For the probe's requests the engine runs its model's Python forward
(vLLM's own switch, `do_not_compile`, set on the compiled modules for the call and put back), the same weights and
layers; the compiled graph's arithmetic is what the sampler verdict judges. A CUDA graph of the whole model replayed
for a request runs no Python at all: where no layer's output came back, the probe says so in one line naming the
setting."""

from __future__ import annotations

import torch

from parity.frameworks.sampling import NotCompared
from parity.precision import DTYPES

NOISE_K = 20  # a layer parts where its gap exceeds this × its noise
FP32_FLOOR = 1e-6  # relative: fp32's rounding of a layer's output over a few layers (its noise where both are fp32)


def engine_layer_outputs(llm, rows: list[list[int]]) -> list[torch.Tensor]:
    """Each decoder layer's output stream on `rows` (token ids) as the engine computes it, fp32 [tokens, hidden], the
    rows' tokens one after another: each row one prompt of a one-token request, the prefix cache emptied first (a
    cached prefix skips its tokens' layers)."""
    from vllm import SamplingParams

    captured: list[list[torch.Tensor]] = []

    def hook(index):
        def take(module, args, output):
            hidden, residual = output if isinstance(output, tuple) else (output, None)
            captured[-1][index] = (hidden if residual is None else hidden + residual).detach().float().cpu()
        return take

    def attach(model):
        layers = model.model.layers
        compiled = [m for m in model.modules() if getattr(m, "do_not_compile", None) is False]
        for module in compiled:
            module.do_not_compile = True  # its Python forward, and the layers' hooks, for the probe's requests
        return [layer.register_forward_hook(hook(i)) for i, layer in enumerate(layers)], len(layers), compiled

    handles, count, compiled = llm.apply_model(attach)[0]
    try:
        for row in rows:
            llm.reset_prefix_cache()
            captured.append([None] * count)
            llm.generate([{"prompt_token_ids": row}], SamplingParams(max_tokens=1, detokenize=False), use_tqdm=False)
    finally:
        for handle in handles:
            handle.remove()
        for module in compiled:
            module.do_not_compile = False
    if any(output is None for row in captured for output in row):
        config = llm.llm_engine.vllm_config.compilation_config
        raise NotCompared(f"vLLM ran no layer's Python forward for the probe (compilation mode "
                          f"{getattr(config.mode, 'name', config.mode)}, "
                          f"cudagraph_mode {config.cudagraph_mode}: a graph ran the whole model): enforce_eager=True, "
                          f"or cudagraph_mode PIECEWISE, lets it compare")
    return [torch.cat([row[i] for row in captured]) for i in range(count)]


@torch.no_grad()
def model_layer_outputs(model, rows: list[list[int]], dtype: torch.dtype) -> list[torch.Tensor]:
    """The same from a transformers causal LM's decoder (fp32 weights), under autocast to `dtype` (fp32: none)."""
    outputs: list[list[torch.Tensor]] = []
    decoder = model.get_decoder()
    handles = [layer.register_forward_hook(
        lambda module, args, output, i=i: outputs[-1].__setitem__(i, (output[0] if isinstance(output, tuple)
                                                                      else output)[0].detach().float().cpu()))
        for i, layer in enumerate(decoder.layers)]
    device = next(model.parameters()).device
    try:
        with (torch.autocast(device.type, enabled=False) if dtype == torch.float32 else
              torch.autocast(device.type, dtype=dtype)):
            for row in rows:
                outputs.append([None] * len(decoder.layers))
                decoder(input_ids=torch.tensor([row], device=device), use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return [torch.cat([row[i] for row in outputs]) for i in range(len(decoder.layers))]


def first_layer_apart(llm, model, rows: list[list[int]], dtype: str) -> dict:
    """{"layers": [{"layer", "gap", "noise"} each, relative to the layer's largest |output|], "first": the first layer
    whose gap exceeds NOISE_K × its noise, or None} of the engine against `model` (at the same weights) on `rows`, the
    engine's dtype `dtype` (fp32, bf16, fp16)."""
    engine = engine_layer_outputs(llm, rows)
    exact = model_layer_outputs(model, rows, torch.float32)
    low = model_layer_outputs(model, rows, DTYPES[dtype]) if dtype != "fp32" else exact
    layers, first = [], None
    for i, (e, x, lo) in enumerate(zip(engine, exact, low)):
        scale = x.abs().max().clamp_min(1e-30)
        gap = float((e - x).abs().max() / scale)
        noise = max(float((lo - x).abs().max() / scale), FP32_FLOOR)
        layers.append({"layer": i, "gap": gap, "noise": noise})
        if first is None and gap > NOISE_K * noise:
            first = i
    return {"layers": layers, "first": first, "rows": len(rows), "tokens": int(exact[0].shape[0]) if exact else 0}


__all__ = ["NotCompared", "first_layer_apart"]
