"""`reinforge report RUN_DIR --html` on a real run, opened in a real headless Chromium (the OS
package, driven by Playwright): it loads without script errors, draws the curves, and the
sample browser's filters change what it shows; multi-turn episodes show turn by turn."""

import json
import os
import re
import shutil
from pathlib import Path

import pytest

from reinforge.errors import ExitCode

from .conftest import TINY_RUN, cli

CHROMIUM = os.environ.get("REINFORGE_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",  # CI runs as root
    "--headless",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
TOOL_CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "37*97"}}</tool_call>'


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A tiny SFT + RL run, and two tool episodes (a call, its result, an answer) in its
    samples.jsonl as the trainer writes them (`episode_fields` over real token ids)."""
    out = tmp_path_factory.mktemp("html")
    args = [*TINY_RUN, f"run.output_dir={out}", "run.name=r", "run.max_steps=2", "sft.steps=2"]
    done = cli("train", *args, "log.samples_per_step=4")
    assert done.returncode == ExitCode.OK, done.stdout + done.stderr
    run = out / "r"
    with (run / "samples.jsonl").open("a") as f:
        for reward in (1.0, 0.0):
            f.write(json.dumps(tool_episode_row(reward)) + "\n")
    return run


def tool_episode_row(reward: float) -> dict:
    from reinforge.metrics import episode_fields
    from reinforge.models.loading import load_tokenizer
    from reinforge.models.tiny import builtin_path
    from reinforge.types import Completion, Message, Task, Trajectory

    tok = load_tokenizer(str(builtin_path("micro", 0)))
    parts = [
        (TOOL_CALL + "<|im_end|>\n", 1),
        ("<|im_start|>user\n<tool_response>3589</tool_response><|im_end|>\n", 0),
        ("<|im_start|>assistant\n", 0),
        ("yes<|im_end|>", 1),
    ]
    ids, mask = [], []
    for text, sampled in parts:
        piece = tok.encode(text, add_special_tokens=False)
        ids += piece
        mask += [sampled] * len(piece)
    task = Task(
        "calc-1", (Message("user", "Is 37*97 above 3000?"),), "yes", info={"data_source": "calc"}
    )
    completion = Completion(ids, [0.0] * len(ids), "stop", tok.decode(ids), loss_mask=mask)
    trajectory = Trajectory(task, [1, 2], completion, reward=reward, rewards={"env": reward})
    row = {
        "step": 2,
        "phase": "rl",
        "prompt": "Is 37*97 above 3000?",
        "completion": completion.text,
    }
    return {
        **row,
        "answer": "yes",
        "reward": reward,
        "rewards": trajectory.rewards,
        "advantage": 0.0,
        **episode_fields(tok, trajectory),
    }


def test_episode_turns_follow_the_loss_mask():
    row = tool_episode_row(1.0)
    assert [t["role"] for t in row["turns"]] == ["assistant", "env", "assistant"]
    assert TOOL_CALL in row["turns"][0]["text"] and "3589" in row["turns"][1]["text"]
    assert row["data_source"] == "calc"


def test_html_report_is_one_self_contained_file(run_dir):
    out = cli("report", str(run_dir), "--html")
    assert out.returncode == 0, out.stdout + out.stderr
    page = (run_dir / "report.html").read_text()
    assert "html report:" in out.stdout
    assert not re.search(r"<(script|link|img)[^>]+(src|href)=", page)  # nothing fetched
    assert "sft" in page and "3589" in page and "[rollout]" in page


def test_html_report_in_headless_chromium(run_dir, tmp_path):
    if not Path(CHROMIUM).exists():
        pytest.skip(f"no Chromium at {CHROMIUM} (apt-get install chromium; .ci/run installs it)")
    sync_api = pytest.importorskip(
        "playwright.sync_api", reason="pip install playwright (dev extra)"
    )
    page_file = tmp_path / "report.html"
    assert cli("report", str(run_dir), "--html", str(page_file)).returncode == 0
    samples = [json.loads(x) for x in (run_dir / "samples.jsonl").read_text().splitlines()]
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1300, "height": 900})
        errors = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.goto(page_file.as_uri())
        charts = page.locator(".chart")
        names = charts.evaluate_all("cs => cs.map(c => c.dataset.metric)")
        assert {"sft/loss", "entropy", "step_s"} <= set(names), names
        unchanged = page.locator("#flat").inner_text()  # constant curves are listed, not drawn
        for key in ("reward_mean", "eval_accuracy", "sft/lr", "grad_norm"):
            assert key in names or f" {key} " in unchanged, key
        points = page.locator('.chart[data-metric="sft/loss"] polyline').get_attribute("points")
        assert len(points.split()) == 2  # one vertex per SFT step

        rows = page.locator("#sample-rows tr.sample")
        assert rows.count() == len(samples)
        page.fill("#f-step-min", "2")
        assert rows.count() == sum(s["step"] >= 2 for s in samples) < len(samples)
        page.select_option("#f-source", "calc")
        assert rows.count() == 2
        page.fill("#f-reward-min", "0.5")
        assert rows.count() == 1
        rows.first.click()
        turns = page.locator("tr.detail .turn")
        assert turns.count() == 4  # the prompt, the call, the tool's result, the answer
        assert "3589" in page.locator("tr.detail .turn.env").inner_text()
        assert "calculator" in page.locator("tr.detail .call").inner_text()
        shot = tmp_path / "report.png"
        page.screenshot(path=str(shot), full_page=True)
        browser.close()
    assert not errors, errors
    assert shot.stat().st_size > 20_000
    if os.environ.get("REINFORGE_SCREENSHOTS"):  # to look at it: a folder to copy it to
        shutil.copy(shot, Path(os.environ["REINFORGE_SCREENSHOTS"]) / "report.png")


def test_sample_text_cannot_end_the_data_block():
    from reinforge.report.page import render

    page = render({"name": "x", "samples": [{"completion": "</script><!--<script>alert(1)"}]})
    blob = page.split('id="run-data">')[1].split("</script>")[0]
    assert json.loads(blob)["samples"][0]["completion"] == "</script><!--<script>alert(1)"
