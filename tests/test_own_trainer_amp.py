"""torch's AMP recipe recorded (the fp16_autocast policy, docs/precision.md#fp16_autocast-torchs-amp-recipe), the parts
that need no run: GradScaler's rules, as the verdict judges a record's scales by them, against torch's own GradScaler;
the declared lr across skipped steps in both loops' conventions (torch's recipe steps its scheduler at a skipped step,
Trainer does not). The recorded loop itself, its replay, its calibrated PASS and its seeded bug are
tests/test_own_trainer.py's (AMP: examples/plain_loop.py --fp16, recorded in its shared group)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch


def test_gradscalers_rules_are_torchs():
    """comparing/loss_scales.py's GradScaler rules give, from the recorded settings and the steps skipped, the scale
    torch's own GradScaler had at each step — driven here through overflows, growth and a non-default factor."""
    from parity.comparing.loss_scales import grad_scaler
    from parity.recording.grad_scaler import settings

    param = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([param], lr=0.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_factor=4.0, backoff_factor=0.25,
                                  growth_interval=2)
    skipped = [True, False, False, False, True, True, False, False, False, False]
    scales = []
    for skip in skipped:
        optimizer.zero_grad()
        scaler.scale(param.sum() * (math.inf if skip else 1.0)).backward()
        scales.append(scaler.get_scale())
        scaler.step(optimizer)
        scaler.update()
    assert grad_scaler(settings(scaler), skipped) == scales
    assert scales[:3] == [2.0 ** 10, 2.0 ** 8, 2.0 ** 8] and scales[3] == 2.0 ** 10  # backed off, grown after 2


@pytest.mark.parametrize("steps_at_skip,stepped_twice", [(True, False), (False, False), (True, True)])
def test_the_declared_lr_takes_either_loops_convention_at_skipped_steps(steps_at_skip, stepped_twice):
    """A schedule copied at the start (DeclaredSchedule), the loop's own scheduler stepped at each skipped step (torch's
    AMP recipe) or not (Trainer): the lr applied at every applied step is the declared one either way; a scheduler
    stepped twice an update still parts from it."""
    from parity.recording.resume import DeclaredSchedule

    warnings.simplefilter("ignore", UserWarning)  # the scheduler stepped without the optimizer: moot here
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.ones(1))], lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: 1.0 / (k + 1))
    declared = DeclaredSchedule.copy_of(scheduler, 0, print)
    off = []
    for skip in [True, False, True, True, False, False]:
        applied = optimizer.param_groups[0]["lr"]
        lr = declared.lr(None if skip else applied, skipped=skip)
        off.append(lr is not None and lr != applied)
        if not skip or steps_at_skip:
            scheduler.step()
        if stepped_twice and not skip:
            scheduler.step()
    assert any(off) == stepped_twice, off
