"""The sampler seam (docs/sampler.md#the-sampler-seam): an engine that samples an RL run's completions is a room of
parity/frameworks/ whose FRAMEWORK declares its `Engine` (`sampler`); the registry gives it by name (`engine`) and
lists them (`engines`: make_rollouts.py's --sampler). Not a room: what the rooms that sample and the rooms that drive
a sampler (TRL's GRPOTrainer and its colocated vLLM) share. What the house asks of an engine:
- how it samples: `start` at a model's weights, then `Session.sample`, a prompt's completions at a seed, each with the
  engine's log-prob of each token as the settings ask (make_rollouts.py);
- how it reports its sampler side, the rollout file's sampler metadata
  (docs/sampler.md#what-the-rollout-file-holds-of-the-sampler): of a session it started (`Session.side`), of an engine
  a trainer built (`engine_side`), of the sampling parameters a trainer hands it (`sampling_side`);
- how it reloads weights (`reload`): named tensors into the engine in place, its next samples drawn at them (a
  trainer's weight sync; tests/trl_vllm_cpu.py's on a CPU).
An engine in the trainer's process may also say where its forward first parts from the trainer's model
(`first_layer_apart`). What an engine does not do raises NotImplementedError naming it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable


@dataclass(frozen=True)
class Sampling:
    """What make_rollouts.py's flags ask an engine to sample with."""
    dtype: str  # its weights and arithmetic: fp32, bf16
    logprob_mode: str  # processed (after the penalty, temperature and truncation) or raw (the logits')
    temperature: float
    top_p: float
    top_k: int  # 0: every token
    min_p: float
    repetition_penalty: float
    max_tokens: int  # a completion's most tokens
    stops: tuple[int, ...]  # the ids that end a completion
    max_len: int  # a prompt and its completion
    seed: int


class Session:
    """An engine started at a model's weights: `handle` its own object (vLLM's LLM, the model transformers' generate
    runs), `sample(prompt, count, seed)` a prompt's `count` completions — (tokens, truncated: no stop token within
    max_tokens, the engine's log-prob of each token) each —, `side()` the rollout file's sampler metadata."""

    def __init__(self, engine: Engine, handle, sampling: Sampling, version: str,
                 sample: Callable[[object, int, int], list[tuple]]):
        self.engine, self.handle, self.sampling, self.version, self.sample = engine, handle, sampling, version, sample

    def side(self) -> dict:
        s = self.sampling
        return {"engine": self.engine.name, "version": self.version, "dtype": s.dtype, "temperature": s.temperature,
                "top_p": s.top_p, "top_k": s.top_k, "min_p": s.min_p, "repetition_penalty": s.repetition_penalty,
                "logprob_mode": s.logprob_mode}


class NotCompared(Exception):
    """Why an engine's layers could not be read, in one line naming the setting."""


class Engine:
    """A sampling engine's room fills this in (module docstring); `name` is its room's and the file's `engine`,
    `describe` its words in --sampler's help."""
    name: str
    describe: str

    def version(self) -> str:
        """Its release; ConfigError in one line where it cannot be imported (before anything is written)."""
        raise NotImplementedError(f"{self.name}: version")

    def start(self, model, config, sampling: Sampling) -> Session:
        """A session at `model`'s weights (fp32, its Hugging Face `config`), sampling as `sampling` says."""
        raise NotImplementedError(f"{self.name} does not sample for make_rollouts.py")

    def reload(self, handle, weights: Iterable[tuple[str, object]]) -> None:
        """(Hugging Face name, tensor) pairs into the engine `handle` in place: its next samples at those weights."""
        raise NotImplementedError(f"{self.name} does not reload weights")

    def engine_side(self, handle) -> tuple[dict, str | None]:
        """(the sampler metadata the engine `handle` decides — engine, version, dtype, logprob_mode —, why the file
        cannot describe it, else None) of an engine a trainer built."""
        raise NotImplementedError(f"{self.name}: the sampler side of an engine built elsewhere")

    def sampling_side(self, params) -> dict:
        """The file's sampling keys (temperature, top_p, top_k, min_p, penalties; `shaped_by`) of what a trainer
        hands the engine to sample with."""
        raise NotImplementedError(f"{self.name}: the sampling side of its parameters")

    def first_layer_apart(self, handle, model, rows: list[list[int]], dtype: str) -> dict:
        """Where the engine's forward first parts from `model`'s (a transformers causal LM at the same weights) on
        `rows`, layer by layer (docs/sampler.md#the-first-layer-apart); NotCompared where its layers cannot be read."""
        raise NotCompared(f"{self.name}'s layers are not compared")
