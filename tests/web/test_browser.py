"""The run report and the web chat in a real headless Chromium (Debian's ``chromium``, driven by
playwright over the DevTools protocol): no JavaScript errors, no network requests from the report,
the expected number of charts drawn, a chat message answered by two models with streamed tokens.
Screenshots go to ``tests/artifacts/`` (or ``$CHATRL_TEST_ARTIFACTS``)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from chatrl.distributed.dist import free_port
from tests.conftest import REPO, STORIES

ARTIFACTS = Path(os.environ.get("CHATRL_TEST_ARTIFACTS", REPO / "tests" / "artifacts"))


def find_chromium() -> str | None:
    for name in (os.environ.get("CHATRL_CHROMIUM"), "chromium", "chromium-browser", "google-chrome"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


@pytest.fixture(scope="module")
def browser():
    exe = find_chromium()
    if exe is None:
        pytest.skip("no Chromium on PATH (Debian: apt-get install chromium; .ci/run installs it; or set CHATRL_CHROMIUM)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is missing: pip install -e '.[dev]'")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=exe, headless=True, args=["--no-sandbox", "--disable-gpu"])
        yield b
        b.close()


def open_page(browser, url: str):
    """A page at ``url`` with its JS errors (uncaught exceptions, console errors) and requested URLs recorded."""
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.errors, page.requests = [], []
    page.on("pageerror", lambda e: page.errors.append(f"uncaught: {e}"))
    page.on("console", lambda m: page.errors.append(f"console.{m.type}: {m.text}") if m.type == "error" else None)
    page.on("request", lambda r: page.requests.append(r.url))
    page.goto(url)
    return page


def test_report_renders_offline_with_every_chart(browser, tmp_path):
    pytest.importorskip("plotly", reason="the report needs plotly: pip install -e '.[web]'")
    from chatrl.tools.report import write_report
    from tests.unit.test_report import make_output

    path = write_report(make_output(tmp_path / "out"))
    page = open_page(browser, path.as_uri())
    expected = 3 + 2 + 6  # hand-counted in make_output's docstring
    assert page.locator('meta[name="chatrl-charts"]').get_attribute("content") == str(expected)
    page.wait_for_function(f"document.querySelectorAll('.js-plotly-plot .main-svg').length >= {2 * expected}",
                           timeout=60_000)  # plotly draws two svg layers per chart
    drawn = page.evaluate("Array.from(document.querySelectorAll('.js-plotly-plot'))"
                          ".filter(d => d.querySelector('.main-svg .scatterlayer .trace')).length")
    assert drawn == expected
    assert page.locator("table.alerts td", has_text="eos_collapse").count() == 1
    assert page.locator("table.certificate tr.fail").count() == 1 and page.locator("table.certificate tr.pass").count() == 2
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "report.png"), full_page=True)
    assert page.errors == []
    assert [u for u in page.requests if not u.startswith(("file:", "data:", "blob:"))] == []
    page.close()


@pytest.fixture(scope="module")
def chat_server():
    pytest.importorskip("uvicorn", reason="the web chat needs uvicorn and starlette: pip install -e '.[web]'")
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, str(REPO / "chat.py"), "--web", "--path", str(STORIES), "--compare", str(STORIES),
           "--port", str(port), "--max_new_tokens", "32", "--seed", "0", "--device", "cpu"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 240
    while True:
        try:
            with urllib.request.urlopen(url + "/api/info", timeout=5) as r:
                info = json.load(r)
            break
        except OSError:
            if proc.poll() is not None or time.time() > deadline:
                proc.kill()
                pytest.fail(f"chat.py --web did not start: {proc.stdout.read()[-3000:]}")
            time.sleep(0.5)
    yield url, info
    proc.terminate()
    proc.wait(timeout=30)


def test_web_chat_streams_answers_side_by_side(browser, chat_server):
    url, info = chat_server
    assert [m["context"] for m in info["models"]] == [512, 512]
    page = open_page(browser, url)
    page.wait_for_selector("body[data-ready='1']", timeout=30_000)
    assert page.locator(".col").count() == 2
    # each column says which model it is (from chatrl's run marker; these folders have none: the flags)
    assert [m["role"] for m in info["models"]] == ["model", "compared model"]
    assert page.locator(".col h2").nth(0).inner_text().startswith("model: ")
    assert page.locator(".col h2").nth(1).inner_text().startswith("compared model: ")
    assert page.locator("#system-box").is_visible()  # the Human/Assistant convention takes a system prompt
    page.fill("#system", "Tell short stories.")
    page.fill("#input", "Tell me a story about a cat.")
    page.click("#send")
    page.wait_for_function("document.querySelectorAll('.assistant[data-done]').length == 2", timeout=180_000)
    answers = page.locator(".assistant")
    for i in range(2):
        a = answers.nth(i)
        assert a.get_attribute("data-done") == "1"
        assert a.inner_text().strip() != ""
        assert int(a.get_attribute("data-chunks")) >= 2 and int(a.get_attribute("data-reads")) >= 2, \
            "the answer arrived in one piece, not streamed"
    assert page.locator(".user").count() == 2 and page.input_value("#input") == ""
    page.fill("#input", "And then?")  # a second turn goes with the history
    page.press("#input", "Enter")
    page.wait_for_function("document.querySelectorAll('.assistant[data-done]').length == 4", timeout=180_000)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "web_chat.png"), full_page=True)
    assert page.errors == []
    page.close()


def test_inspector_renders_offline_and_recolours_tokens(browser, tmp_path):
    """The token inspector (python -m chatrl.tools.inspector) of two recorded runs side by side: every rollout's
    tokens drawn, each colouring applied (the clip hits of the hand-made trace among them), no JS
    error, no network request. ``CHATRL_INSPECT_OUTPUT`` (a step-3 output with records, e.g. the
    demo's) is drawn too when given: its screenshot is ``inspector_demo.png``."""
    pytest.importorskip("plotly", reason="the inspector needs plotly: pip install -e '.[web]'")
    import torch

    from chatrl.evidence.rollout_records import recorded_steps, write_step
    from chatrl.tools.inspector import write_inspector
    from tests.unit.test_certificate import _experience

    for run, seed in (("a", 0), ("b", 1)):
        trace = {"ratio": [torch.full((2, 4), 1.1)], "clip": [torch.tensor([[1, 0, 0, 0], [0, -1, 0, 0]], dtype=torch.int8)]}
        write_step(tmp_path / run, 2, 0, 1, _experience(seed), trace,
                   {"args": {}, "tokenizer": str(STORIES), "ppo_epochs": 1, "figures": {"actor_loss": 0.1}})
    page = open_page(browser, write_inspector(tmp_path / "a", 2, tmp_path / "b").as_uri())
    page.wait_for_selector("body[data-ready='1']", timeout=60_000)
    # 2 runs × (an answer of 3 tokens and its first pad, an answer of 2 and its pad)
    assert page.locator(".sample").count() == 4 and page.locator(".t").count() == 2 * (4 + 3)
    assert page.evaluate("document.body.dataset.colour") == "advantages"
    page.check("input[value=clip]")
    colours = page.evaluate("Array.from(document.querySelectorAll('.col')[0].querySelectorAll('.t'))"
                            ".map(t => t.style.background)")
    assert colours[0].startswith("rgba(214, 39, 40") and colours[5].startswith("rgba(31, 119, 180")  # upper, lower
    assert colours[1] in ("transparent", "rgba(0, 0, 0, 0)")
    page.check("input[value=mask]")
    assert page.evaluate("document.body.dataset.colour") == "mask"
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "inspector.png"), full_page=True)
    assert page.errors == []
    assert [u for u in page.requests if not u.startswith(("file:", "data:", "blob:"))] == []
    page.close()
    demo = os.environ.get("CHATRL_INSPECT_OUTPUT")
    if demo:
        from chatrl.evidence.rollout_records import resolve_output

        page = open_page(browser, write_inspector(demo, recorded_steps(resolve_output(demo))[-1],
                                                  path=tmp_path / "demo.html").as_uri())
        page.wait_for_selector("body[data-ready='1']", timeout=120_000)
        page.check("input[value=logp_gap]")
        page.screenshot(path=str(ARTIFACTS / "inspector_demo.png"), full_page=False)
        assert page.errors == [] and page.locator(".sample").count() > 0
        page.close()
