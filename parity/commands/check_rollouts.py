"""check_rollouts.py: the inputs of an RL update judged, from a rollout file written by any framework
(parity/objectives/rollouts.py has the schema; docs/sampler.md): the sampler's log-probs against the trainer's model
rescoring each sequence at the weights it was sampled with, and the advantages against the estimator the file's
settings name. No training run is needed. Exit 0: every judged part PASSes; 1: one FAILs; 2: bad input."""

from __future__ import annotations

import json

from parity import console, storage
from parity.commands.common import OneLineParser, run_command
from parity.errors import ConfigError


def build_parser() -> OneLineParser:
    p = OneLineParser(__doc__)
    p.add_argument("--rollouts", required=True, help="the rollout file (.safetensors)")
    p.add_argument("--model_name", default="qwen2-tiny", help="the trainer's model: a built-in model or a local "
                                                             "model directory")
    p.add_argument("--num_layers", type=int, default=None)
    p.add_argument("--init_weights_path", required=True, help="the trainer's weights at step 0 (the initial weights)")
    p.add_argument("--weights", action="append", default=[], metavar="STEP=FILE",
                   help="the trainer's weights at a later step, for the rows sampled with them (repeat per step)")
    p.add_argument("--output", default=None, help="the verdict as JSON (written whole)")
    return p


def weight_files(a) -> dict[int, str]:
    """Trainer step → weights file, from --init_weights_path and each --weights STEP=FILE."""
    files = {0: a.init_weights_path}
    for given in a.weights:
        step, _, path = given.partition("=")
        if not step.isdigit() or not path:
            raise ConfigError(f"--weights {given}: give STEP=FILE, the trainer's weights file at that step")
        files[int(step)] = path
    for step, path in files.items():
        if not storage.exists(path):
            raise ConfigError(f"the weights of step {step}, {path}: no such file")
    return files


def check(a) -> int:
    from parity.models.model import build_model, load_init_weights, resolve_model_config
    from parity.objectives.rollouts import read_rollouts
    from parity.rollout_check import advantages, sampler

    if a.output:
        storage.check_writable_dir("--output", storage.parent(storage.absolute(a.output)))
    rollouts = read_rollouts(a.rollouts)
    t = rollouts.tensors
    estimator = advantages.declared_estimator(rollouts.generation_settings)
    judges_advantages = rollouts.family == "grpo" and "rewards" in t and estimator is not None
    if not rollouts.sampler and not judges_advantages:
        raise ConfigError(f"--rollouts {a.rollouts} holds neither the sampler's log-probs (sampler_logps, "
                          f"docs/sampler.md) nor GRPO rewards with an estimator named in its settings: nothing to "
                          f"judge")
    if estimator is not None and estimator not in advantages.ESTIMATORS:
        raise ConfigError(f"--rollouts {a.rollouts} names the advantage estimator {estimator!r}: the harness computes "
                          f"{', '.join(advantages.ESTIMATORS)}")
    verdict = {"rollouts": a.rollouts}
    if rollouts.sampler:
        files = weight_files(a)
        needed = sorted(set(t["sampler_weights_step"].tolist()) - set(files))
        if needed:
            raise ConfigError(f"--rollouts {a.rollouts}: rows were sampled with the weights of step {needed[0]}: pass "
                              f"--weights {needed[0]}=FILE (the trainer's weights then)")
        config = resolve_model_config(a.model_name, a.num_layers)
        models = {}
        for step, path in files.items():
            models[step] = build_model(config, 0).eval()
            load_init_weights(models[step], path)
        verdict["sampler"] = sampler.judge(rollouts, models, rollouts.sampler)
        console.say(describe_sampler(verdict["sampler"], rollouts.sampler))
    if judges_advantages:
        verdict["advantages"] = advantages.judge(t["advantages"], t["rewards"], t["group"], t["generation"], estimator)
        console.say(advantages.describe(verdict["advantages"]))
    if a.output:
        storage.write_bytes_atomic(a.output, json.dumps(verdict, indent=1).encode())
    failed = [k for k in ("sampler", "advantages") if verdict.get(k, {}).get("verdict") == "FAIL"]
    console.say(f"VERDICT: {'FAIL — ' + ', '.join(failed) if failed else 'PASS'}")
    return 1 if failed else 0


def describe_sampler(result: dict, settings: dict) -> str:
    """The sampler verdict in a few lines (parity/rollout_check/spread.py's checks)."""
    from parity.comparing.tolerances import NOISE_K
    from parity.rollout_check.spread import SPREAD_K

    penalties = "".join(f", {k.replace('_', ' ')} {settings[k]:g}" for k, default in
                        (("repetition_penalty", 1.0), ("frequency_penalty", 0.0), ("presence_penalty", 0.0))
                        if settings.get(k, default) != default)
    steps = [g for g in result["groups"] if g != "all"]
    lines = [f"sampler ({settings['engine']} {settings['version']}, {settings['dtype']}, {settings['logprob_mode']} "
             f"log-probs, temperature {settings['temperature']:g}{penalties}): {result['verdict']} over "
             f"{result['tokens']} tokens" + (f", and each step's rows apart ({', '.join(steps)})" if steps else ""),
             "  sampler − trainer |·| at 50/90/99 %: " + " / ".join(f"{v:.2e}" for v in result["quantiles"].values())
             + "; the trainer's own noise: " + " / ".join(f"{v:.2e}" for v in result["noise_quantiles"].values())
             + f"; signed mean {result['signed_mean']:.2e}"]
    names = {"signed_mean": "signed mean", "q50": "|·| at 50 %", "q90": "|·| at 90 %", "max_abs": "largest"}
    margins = [f"{names[c]} {m:.2f}" if m is not None else f"{names[c]}: too few tokens"
               for c, m in result["margins"].items()]
    lines.append(f"  statistic ÷ bound, the largest over all tokens and each step's: {', '.join(margins)} (quantiles "
                 f"within {SPREAD_K:g} × the noise's with the slack of the token count, the largest within "
                 f"{NOISE_K:g} × the noise's)")
    if result["failed"]:
        group, check = result["failed"]["group"], result["failed"]["check"]
        g = result["groups"][group]
        rank = g["ranks"].get(check)
        which = f" (the {rank}{_th(rank)} largest of {g['tokens']})" if rank else ""
        rows = "all tokens" if group == "all" else f"{group}'s rows"
        lines.append(f"  outside: {rows}, {names[check]} {g['statistics'][check]:.3e}{which} > bound "
                     f"{g['bounds'][check]:.3e} ({g['margins'][check]:.1f} ×)")
    worst = result["worst_sequence"]
    lines.append(f"  worst sequence: row {worst['row']}, summed gap {worst['sum']:.3e}")
    first = result["first_outside"]
    if first:
        lines.append(f"  first token outside: row {first['row']}, position {first['position']} (token {first['token']}):"
                     f" sampler {first['sampler']:.5f}, trainer {first['trainer']:.5f}")
    if result["verdict"] == "FAIL":
        known = "none the harness knows (temperature, penalties, truncation, weights, token)"
        lines.append(f"  cause: {result['cause'] or known}")
    return "\n".join(lines)


def _th(n: int) -> str:
    return "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")


def main(argv: list[str] | None = None) -> int:
    return run_command(lambda: check(build_parser().parse_args(argv)), "check_rollouts.py")
