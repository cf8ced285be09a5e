"""report.html in a real browser: the system's headless Chromium, driven by Playwright from pip (pointed at that
Chromium with executable_path; `playwright install`, which downloads a browser, is never run).

Both pages come from real training runs on CPU (qwen2-tiny, fp32, STEPS steps, local gloo groups: Ray adds nothing to a
page), compared by plot_loss_curves.py's own code:
- PASS: DDP (DP=2) against FSDP + TP (TP=2), calibrated on DDP's real twin at DP=1 (a noise reference; in fp32 the
  main job calibrates only with NOISE_REFERENCE=on, so this is the cheapest real calibrated page), with the time
  table the main job would write from those groups' wall times and the records' own timings beside it.
- FAIL: the same DDP baseline against a real seeded bug, the catalogue's FSDPShardFault (TP rank 0's shard of
  layers.1.mlp.up_proj 1e-3 off), with a clean DeepSpeed AutoTP run beside it that PASSes. The bug FAILs at step 0
  (what tests/test_calibration.py asserts of it in fp32); the layer check then runs in the folder the replay command
  names, with that command's layout and --strategy_class, so the fault it finds is the seeded bug itself, not a
  --perturb stand-in. It runs from the initial weights rather than from --replay's checkpoint: a local group writes no
  checkpoint (Ray Train's session does), and for step 0 the replay starts from the initial weights anyway. After it
  run_verification.py's code has written the comparison's page again, with the module.
The teacher-forced check is off in these runs (--no_teacher_forced): its step-0 bound trips on clean FSDP at this
setting (k_proj.bias), and what is tested here is the page. Each page is opened with JavaScript (hover readouts
compared with the JSON) and without it (static figures)."""

import json
import os
import re
import shlex
import shutil
import time

import pytest

from conftest import copy_record
from parity.comparing.html_report import TIMES_NAME

# Debian's binary itself (its /usr/bin/chromium is a wrapper script), else whatever the PATH has
CHROMIUM = next((p for p in ("/usr/lib/chromium/chromium", shutil.which("chromium"), shutil.which("chromium-browser"))
                 if p and os.path.isfile(p)), None)
MODULE = "model.layers.1.mlp.up_proj"


def _browser_or_skip():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("playwright is not installed: pip install -e '.[test]' (no browser download is needed)")
    if CHROMIUM is None:
        pytest.skip("no system Chromium (apt-get install -y chromium; .ci/run installs it where it can)")
    return sync_playwright


@pytest.fixture(scope="module")
def browser():
    sync_playwright = _browser_or_skip()
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield b
        b.close()


STEPS = 4  # the hovers read steps 0 and 3
# qwen2-tiny as the shared parity runs train it (conftest.PARITY: lr 1e-4), shortened; no checkpoint, no teacher-forced
SETTING = {"model_name": "qwen2-tiny", "seq_length": 64, "debug_steps": STEPS, "learning_rate": 1e-4,
           "log_interval": STEPS, "checkpoint_interval": 0, "no_teacher_forced": True, "precision": "fp32",
           "device": "cpu"}
BUG = "parity.calibration.bugs:FSDPShardFault"
TP2 = {"num_workers": 2, "tp_size": 2, "batch_size": 4}  # the global batch of DDP's DP=2 × 2


@pytest.fixture(scope="module")
def folders(tmp_path_factory, tiny_weights):
    """(PASS folder, FAIL folder): each with its comparison's outputs and report.html, made from real runs; the FAIL's
    layer check in the replay command's folder."""
    from parity.commands.compare_curves import compare_and_report
    from parity.commands.layer_check import main as layer_check
    from parity.commands.main_job import run_title, time_table_json
    from parity.driver.local_group import plan, run_group
    from parity.training.record import load_record, run_record_path

    root = tmp_path_factory.mktemp("report")
    passing, failing = root / "pass", root / "fail"

    def run(folder, strategy, **values):
        return plan(strategy, {**SETTING, "init_weights_path": tiny_weights, "loss_output_dir": folder,
                               "storage_path": folder / "runs", **values})

    started = time.perf_counter()
    groups = [[run(passing, "ddp", num_workers=2, batch_size=2), run(passing, "fsdp", **TP2),
               run(failing, "fsdp", **TP2, strategy_class=BUG), run(failing, "deepspeed", **TP2)],
              [run(passing, "ddp", num_workers=1, batch_size=4, noise_reference=True)]]  # DDP's twin at DP=1
    times = []
    for group in groups:  # the time table as the main job writes it: each group's wall time, each run's own timings
        t0, began = time.perf_counter(), time.time()
        run_group(group)
        runs = [(run_title(cfg) + ("" if cfg.loss_output_dir == str(passing) else " (the FAIL page's)"),
                 load_record(run_record_path(cfg))["final"]["timings"]) for cfg, _ in group]
        times.append((f"{group[0][0].num_workers}-worker group", time.perf_counter() - t0, began, time.time(), runs))
    (passing / TIMES_NAME).write_text(json.dumps(time_table_json(times, time.perf_counter() - started)))
    assert compare_and_report(str(passing), str(passing / "loss_curves.png")) == 0

    copy_record(str(passing / "loss_ddp.json"), failing)  # the one baseline beside the bug, with its tensor series
    assert compare_and_report(str(failing), str(failing / "loss_curves.png")) == 1
    before = (failing / "report.html").read_text()
    saved = json.loads((failing / "curve_comparison.json").read_text())
    step = saved["against_baseline"]["fsdp"]["first_outside"]["step"]
    command = shlex.split(saved["replay_commands"]["fsdp"])
    assert command[:2] == ["python", "run_verification.py"] and BUG in command
    flags = dict(zip(command[2::2], command[3::2]))  # every flag of this one has a value
    assert all(k.startswith("--") and not v.startswith("--") for k, v in flags.items()), command
    assert flags["--output_dir"] == str(failing / f"replay_step_{step}") and flags["--step"] == str(step)
    argv = [*(x for k, v in flags.items() if k not in ("--replay", "--step") for x in (k, v)),
            "--strategy", "ddp", "fsdp", "--device", "cpu", "--seq_length", "32", "--launcher", "local"]
    assert layer_check(argv) == 1
    named = f"the first divergent module: {MODULE} (forward output)"  # (the heatmap names every tensor, up_proj's too)
    assert named not in before and named in (failing / "report.html").read_text()  # written again, with the module
    return passing, failing


def open_page(browser, path, shots, name, javascript=True):
    """(page, console messages, requests) of `path` opened from file://; a screenshot into `shots`."""
    context = browser.new_context(java_script_enabled=javascript, viewport={"width": 1200, "height": 900})
    page = context.new_page()
    messages, requests = [], []
    page.on("console", lambda m: messages.append((m.type, m.text)))
    page.on("pageerror", lambda e: messages.append(("pageerror", str(e))))
    page.on("request", lambda r: requests.append(r.url))
    page.goto(path.as_uri())
    page.screenshot(path=str(shots / f"{name}.png"), full_page=True)
    return page, messages, requests


def assert_rendered(page, messages, requests, url):
    assert [m for m in messages if m[0] in ("error", "pageerror", "warning")] == []
    assert [r for r in requests if r != url and not r.startswith("data:")] == []
    assert page.locator("#verdict").is_visible()
    charts = page.locator("svg.panel, img")
    assert charts.count() > 0
    for i in range(charts.count()):
        box = charts.nth(i).bounding_box()
        assert box and box["width"] > 50 and box["height"] > 50, (i, box)
    broken = page.evaluate("Array.from(document.images).filter(i => !(i.complete && i.naturalWidth > 0)).length")
    assert broken == 0


def hover(page, panel: str, step: int, num_steps: int) -> dict:
    """Point at `step` on the panel; the readout's cells, {(run, quantity, kind): text}."""
    svg = page.locator(f'svg.panel[data-panel="{panel}"]')
    svg.scroll_into_view_if_needed()
    box = svg.bounding_box()
    geometry = page.evaluate(f"""(() => {{ const s = document.querySelector('svg.panel[data-panel="{panel}"]');
        return [+s.dataset.left, +s.dataset.right, s.viewBox.baseVal.width]; }})()""")
    left, right, width = geometry
    x = box["x"] + (left + (right - left) * step / (num_steps - 1)) * box["width"] / width
    page.mouse.move(x, box["y"] + box["height"] / 2)
    assert page.locator("#readout").is_visible()
    assert page.locator("#readout caption").inner_text() == f"Step {step}"
    cells = page.eval_on_selector_all("#readout td[data-run]", "cells => cells.map(c => [c.dataset.run, c.dataset.q, "
                                                               "c.dataset.kind, c.textContent])")
    return {(run, q, kind): text for run, q, kind, text in cells}


def assert_readout_is_the_json(cells: dict, saved: dict, step: int):
    for name, run in saved["runs"].items():
        for q in ("loss", "grad_norm", "param_norm"):
            assert float(cells[(name, q, "value")]) == pytest.approx(run["series"][q][step], rel=1e-7), (name, q)
    for name, against in saved["against_baseline"].items():
        for q in ("loss", "grad_norm", "param_norm"):
            rel, bound = cells[(name, q, "bound")].split(" ✗")[0].split(" / ")
            assert float(bound) == pytest.approx(against["bounds"][q][step], rel=1e-3)
            base = saved["runs"][saved["baseline"]]["series"][q][step]
            assert float(rel) == pytest.approx((saved["runs"][name]["series"][q][step] - base) / abs(base),
                                               rel=1e-3, abs=1e-12)


def test_the_pass_page(browser, folders, tmp_path):
    passing, _ = folders
    saved = json.loads((passing / "curve_comparison.json").read_text())
    assert saved["verdict"] == "PASS" and saved["against_baseline"]["fsdp"]["calibrated"]
    page, messages, requests = open_page(browser, passing / "report.html", tmp_path, "pass")
    assert_rendered(page, messages, requests, (passing / "report.html").as_uri())
    verdict = page.locator("#verdict").inner_text()
    assert verdict.startswith("PASS: every run (FSDP (TP=2, DP=1)) trains the same model as DDP (TP=1, DP=2)")
    assert saved["noise_references"] == ["noise_reference_ddp_tp1_dp1_fp32.json"]
    assert page.locator("svg.panel").count() == 4 and page.locator("svg.panel polygon.band").count() == 3
    table = json.loads((passing / TIMES_NAME).read_text())
    assert f"Where the time went ({table['total_s']:.0f} s)" in page.inner_text("#time")
    assert "fsdp tp=2 dp=1 fp32" in page.inner_text("#time")
    runs = page.inner_text("#runs")
    assert "calibrated" in runs and "uncalibrated" not in runs.split("FSDP")[1]
    ratios = saved["against_baseline"]["fsdp"]["noise_ratio"]
    assert f"loss {ratios['loss']:.1f}" in runs
    for step in (0, 3):
        assert_readout_is_the_json(hover(page, "loss", step, saved["num_steps"]), saved, step)
    page.screenshot(path=str(tmp_path / "pass_hover.png"))
    tensors = saved["against_baseline"]["fsdp"]["tensors"]  # every tensor within its calibrated bound, far inside
    assert (tensors["calibrated"], tensors["first_outside"]) == (True, None)
    assert 0 < max(p["ratio"] for p in tensors["largest"].values()) < 1
    assert page.locator('svg.tensor-map[data-run="fsdp"] .cells rect').count() == 26 * STEPS
    assert page.locator('svg.tensor-map[data-run="fsdp"] .cells rect.tco').count() == 0
    page.emulate_media(media="print")  # on paper: the verdict and the figures, not the navigation or the readout
    assert page.locator("#verdict").is_visible() and page.locator("svg.panel").first.is_visible()
    assert not page.locator("nav").is_visible() and not page.locator("#readout").is_visible()
    page.pdf(path=str(tmp_path / "pass.pdf"))
    assert (tmp_path / "pass.pdf").read_bytes()[:5] == b"%PDF-"


def test_the_fail_page_names_the_step_and_the_module(browser, folders, tmp_path):
    _, failing = folders
    saved = json.loads((failing / "curve_comparison.json").read_text())
    page, messages, requests = open_page(browser, failing / "report.html", tmp_path, "fail")
    assert_rendered(page, messages, requests, (failing / "report.html").as_uri())
    first = saved["against_baseline"]["fsdp"]["first_outside"]
    step = first["step"]
    assert step == 0 and first["test"] == "step"  # the shard is off from the first forward (test_calibration.py)
    assert saved["against_baseline"]["deepspeed"]["verdict"] == "PASS"
    verdict = page.locator("#verdict").inner_text()
    assert f"FSDP (TP=2, DP=1) FAILs: first step outside: step {step}" in verdict
    assert f"the first divergent module: {MODULE} (forward output)" in verdict
    why = page.inner_text("#why-fsdp")
    assert f"First divergent module: {MODULE}, phase forward output" in why
    assert saved["replay_commands"]["fsdp"] in why and "FSDPShardFault" in why
    assert page.locator("#why-fsdp img.heatmap").count() == 1
    marker = page.locator(f"svg.panel[data-panel={first['quantity']}] .outside text")
    assert marker.text_content() == f"FSDP: first outside, step {step}"
    cells = hover(page, "grad_norm", step, saved["num_steps"])
    assert_readout_is_the_json(cells, saved, step)
    assert cells[("fsdp", first["quantity"], "bound")].endswith("✗ outside")
    assert not [v for (run, *_), v in cells.items() if run == "deepspeed" and "✗" in v]
    assert_readout_is_the_json(hover(page, "loss", STEPS - 1, saved["num_steps"]), saved, STEPS - 1)
    page.screenshot(path=str(tmp_path / "fail_hover.png"))
    assert_tensor_heatmap(page, saved, tmp_path)
    layer_page = failing / f"replay_step_{step}" / "report.html"
    layer, messages, requests = open_page(browser, layer_page, tmp_path, "layer")
    assert_rendered(layer, messages, requests, layer_page.as_uri())
    assert layer.locator("#verdict").inner_text().startswith(
        f"FAIL: FSDP (TP=2, DP=1) first diverges from DDP (TP=1, DP=1) at module {MODULE} (forward output)")
    assert "✗" in layer.locator("table.modules tr", has_text=MODULE).inner_text()


def assert_tensor_heatmap(page, saved: dict, tmp_path):
    """The FAIL's tensor verdict: its line in the verdict before the layer check's module, the first cell outside
    framed in its heatmap, the cell's readout the JSON's values; DeepSpeed's record holds no series (one line)."""
    found = saved["against_baseline"]["fsdp"]["tensors"]
    f, m = found["first_outside"], found["matrix"]
    assert f["step"] == 0 and f["ratio"] > 3  # measured 7.0: the shard fault's update (its gradients 0.33 of 1e-3)
    verdict = page.locator("#verdict").inner_text()
    assert verdict.index(f"the tensor verdict fails first at step 0 ({f['tensor']}, {f['phase']}") < \
        verdict.index("the first divergent module")  # (at one step the curves' point is the run's first outside)
    heatmap = page.locator('svg.tensor-map[data-run="fsdp"]')
    heatmap.scroll_into_view_if_needed()
    assert heatmap.locator(".cells rect").count() == len(m["tensors"]) * STEPS
    assert heatmap.locator(".first-outside text").text_content() == \
        f"✗ first outside: step 0, {f['tensor']} ({f['phase']})"
    row = m["tensors"].index(f["tensor"])
    cell = heatmap.locator(f'.cells rect[x="0"][y="{row}"]')
    assert cell.get_attribute("class") == "tco"
    cell.hover()
    readout = page.locator("#readout")
    caption = readout.locator("caption")
    assert (caption.get_attribute("data-tensor"), caption.get_attribute("data-step"),
            caption.get_attribute("data-phase")) == (f["tensor"], "0", f["phase"])
    value, reference = (float(readout.locator(f'td[data-kind="{k}"]').inner_text()) for k in ("value", "reference"))
    assert (value, reference) == (pytest.approx(f["value"], rel=1e-5), pytest.approx(f["reference"], rel=1e-5))
    assert readout.locator('td[data-kind="ratio"]').inner_text().endswith("✗ outside")
    page.screenshot(path=str(tmp_path / "tensor_hover.png"))
    assert "tensor verdict: PASS: 26 tensors" in page.inner_text("#tensors-deepspeed")  # DeepSpeed's pieces, read too


def test_without_javascript_the_verdict_and_the_static_figures_are_there(browser, folders, tmp_path):
    for name, folder in zip(("pass", "fail"), folders):
        page, messages, requests = open_page(browser, folder / "report.html", tmp_path, f"{name}_no_js",
                                             javascript=False)
        assert_rendered(page, messages, requests, (folder / "report.html").as_uri())
        assert page.locator("#verdict").inner_text().startswith(name.upper())
        assert page.locator("svg.panel polyline.curve").count() >= 4
        assert not page.locator("#readout").is_visible()
        # a heatmap cell reads its values from its <title>, the first cell outside too
        saved = json.loads((folder / "curve_comparison.json").read_text())["against_baseline"]["fsdp"]["tensors"]
        m = saved["matrix"]
        title = page.locator('svg.tensor-map[data-run="fsdp"] .cells rect[x="1"][y="0"] title').text_content()
        step, phase, value, reference = m["at"][0][1]
        assert title == (f"{m['tensors'][0]}, step 1, {m['phases'][phase]}: FSDP {value:.6g} vs DDP {reference:.6g}, "
                         f"{m['ratio'][0][1]:.3g} × bound")


def test_the_page_is_whole_in_a_copied_folder(browser, folders, tmp_path):
    """Copied elsewhere, the FAIL's folder keeps working: every link of its page is relative and lands on a file of
    the copy; the page names nothing outside it."""
    _, failing = folders
    copy = tmp_path / "copied"
    shutil.copytree(failing, copy)
    html = (copy / "report.html").read_text()
    assert not re.search(r"""(src|href)=["'](https?:|//)""", html)
    page, messages, requests = open_page(browser, copy / "report.html", tmp_path, "copied")
    assert_rendered(page, messages, requests, (copy / "report.html").as_uri())
    links = page.eval_on_selector_all("a[href]", "links => links.map(a => a.getAttribute('href'))")
    files = [link for link in links if not link.startswith("#")]
    assert {"loss_ddp.json", "loss_fsdp.json", "loss_deepspeed.json", "curve_comparison.json", "loss_curves.png",
            "replay_step_0/report.html"} <= set(files)
    assert [link for link in files if not os.path.isfile(copy / link)] == []
    kib = os.path.getsize(copy / "report.html") / 1024
    assert 10 < kib < 1024, kib  # one file, the heatmap inline
