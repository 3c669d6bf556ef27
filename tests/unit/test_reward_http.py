"""The HTTP reward path against real servers on 127.0.0.1: the reference server (in-process and as
``python -m chatrl.reward_server``), and servers that are slow, malformed, flaky or absent."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from chatrl.reward_server import make_server
from chatrl.rewards import FunctionReward, HttpReward, RewardBatch, RewardError, WeightedReward
from tests.launch import REPO

ANSWERS = ["7", "It is 7.", "8", "seven", "-3", "12"]
REFS = ["7", "7", "7", "7", "-3", "21"]


def the_batch(step=4):
    meta = [{"reference": r, "format_regex": r"^\s*-?\d+\s*$"} for r in REFS]
    return RewardBatch([f"What is {r}?" for r in REFS], ANSWERS, meta, step=step)


def local_reward():
    return WeightedReward([(1.0, FunctionReward("exact_match")), (0.5, FunctionReward("regex_format"))])


def serve(server):
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    host, port = server.server_address[:2]
    return f"http://{host}:{port}/"


@pytest.fixture
def reference_server():
    server = make_server(local_reward(), "127.0.0.1", 0)
    yield serve(server)
    server.shutdown()
    server.server_close()


def test_http_scores_equal_the_in_process_function(reference_server):
    expected, _ = local_reward()(the_batch())
    assert expected.tolist() == [1.5, 1.0, 0.5, 0.0, 1.5, 0.5]
    got = HttpReward(reference_server, batch_size=4, timeout=10)(the_batch())  # two requests: 4 + 2 answers
    assert torch.equal(got, expected)


def test_reference_server_reports_bad_requests_and_failing_rewards(reference_server):
    bad = RewardBatch(["q"], ["7"], [{}], step=9)  # exact_match needs a reference: the server answers 500
    t0 = time.time()
    with pytest.raises(RewardError, match=rf"reward server {reference_server} at step 9: failed after 2 "
                                          r"attempt\(s\): HTTP 500: RewardError: .*row 0 has no 'reference'"):
        HttpReward(reference_server, timeout=10, retries=1)(bad)
    assert time.time() - t0 < 5
    import urllib.error
    import urllib.request

    req = urllib.request.Request(reference_server, data=b'{"prompts": [1]}', method="POST")
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(req, timeout=10)
    assert info.value.code == 400 and "list of strings" in json.loads(info.value.read())["error"]


def test_reward_server_module_end_to_end(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "chatrl.reward_server", "--reward-fn", "exact_match",
                             "--reward_fn", "0.5*chatrl.rewards.builtin:regex_format", "--port", "0"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**__import__("os").environ, "PYTHONPATH": str(REPO)})
    try:
        line = proc.stdout.readline()
        assert line.startswith("serving on http://127.0.0.1:"), line + proc.stdout.read() if proc.poll() else line
        url = line.split()[-1]
        got = HttpReward(url, timeout=30)(the_batch())
        assert torch.equal(got, local_reward()(the_batch())[0])
    finally:
        proc.terminate()
        proc.wait(timeout=30)


class Scripted(BaseHTTPRequestHandler):
    """Answers by ``self.server.script``: a list of ``(delay_s, status, body[, headers])`` consumed in
    order (the last one repeats)."""

    def do_POST(self):  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.server.requests += 1
        self.server.times.append(time.time())
        delay, status, body, *headers = self.server.script.pop(0) if len(self.server.script) > 1 else self.server.script[0]
        time.sleep(delay)
        try:
            self.send_response(status)
            for k, v in (headers[0] if headers else {}).items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except OSError:
            pass  # the client gave up

    def log_message(self, *args):
        pass


@pytest.fixture
def scripted():
    servers = []

    def start(script):
        server = ThreadingHTTPServer(("127.0.0.1", 0), Scripted)
        server.daemon_threads = True
        server.script, server.requests, server.times = list(script), 0, []
        servers.append(server)
        return server, serve(server)

    yield start
    for s in servers:
        s.shutdown()
        s.server_close()


def test_slow_server_gives_the_clear_error_within_the_timeout(scripted):
    server, url = scripted([(3.0, 200, b'{"scores": [1]}')])
    t0 = time.time()
    with pytest.raises(RewardError, match=rf"reward server {url} at step 4: failed after 2 attempt\(s\): "
                                          r"no answer within 0.5 s"):
        HttpReward(url, timeout=0.5, retries=1)(the_batch())
    assert time.time() - t0 < 2 * 0.5 + 0.5 + 1.0  # two timeouts, one backoff, slack
    assert server.requests == 2


def test_malformed_json_fails_at_once_without_retrying(scripted):
    server, url = scripted([(0, 200, b"<html>oops")])
    with pytest.raises(RewardError, match=rf"reward server {url} at step 4: malformed JSON response"):
        HttpReward(url, timeout=5, retries=3)(the_batch())
    assert server.requests == 1
    server.script = [(0, 200, b'{"scores": [1, 2]}')]
    with pytest.raises(RewardError, match="returned 2 scores for 6 answers"):
        HttpReward(url, timeout=5, retries=3)(the_batch())
    server.script = [(0, 200, b'{"scores": [1, 2, 3, 4, 5, NaN]}')]
    with pytest.raises(RewardError, match="score 5 is not finite"):
        HttpReward(url, timeout=5)(the_batch())
    server.script = [(0, 404, b'{"error": "no such path"}')]
    with pytest.raises(RewardError, match="HTTP 404: no such path"):
        HttpReward(url, timeout=5, retries=3)(the_batch())


def test_a_5xx_is_retried_and_then_succeeds(scripted):
    server, url = scripted([(0, 503, b"busy"), (0, 200, json.dumps({"scores": [0.5] * 6}).encode())])
    assert HttpReward(url, timeout=5, retries=1)(the_batch()).tolist() == [0.5] * 6
    assert server.requests == 2


OK_BODY = json.dumps({"scores": [0.5] * 6}).encode()


@pytest.mark.parametrize("status, headers", [
    (429, {"Retry-After": "0"}), (408, {}), (429, {"Retry-After": "Wed, 21 Oct 2015 07:28:00 GMT"}),
    (503, {"Retry-After": "0.1"}), (502, {})])
def test_transient_statuses_are_retried_honouring_retry_after(scripted, status, headers):
    """A throttled (429), timed-out (408) or failing (5xx) request is retried within the budget; a
    Retry-After of 0 or of a past date retries at once (no backoff)."""
    server, url = scripted([(0, status, b'{"error": "slow down"}', headers), (0, 200, OK_BODY)])
    assert HttpReward(url, timeout=5, retries=1)(the_batch()).tolist() == [0.5] * 6
    assert server.requests == 2
    gap = server.times[1] - server.times[0]
    if headers.get("Retry-After") == "0" or "2015" in headers.get("Retry-After", ""):
        assert gap < 0.3  # not the 0.5 s backoff
    elif headers:
        assert 0.1 <= gap < 0.4
    else:
        assert gap >= 0.5  # the client's own backoff


def test_retry_after_is_capped_by_the_timeout_and_the_budget_is_kept(scripted):
    from email.utils import formatdate

    server, url = scripted([(0, 429, b'{"error": "slow down"}', {"Retry-After": "1000"})])
    t0 = time.time()
    with pytest.raises(RewardError, match=rf"reward server {url} at step 4: failed after 3 attempt\(s\): "
                                          "HTTP 429: slow down"):
        HttpReward(url, timeout=0.3, retries=2)(the_batch())
    assert server.requests == 3 and time.time() - t0 < 2 * 0.3 + 1.0  # two capped waits, slack
    future = formatdate(time.time() + 1000, usegmt=True)
    server, url = scripted([(0, 503, b"busy", {"Retry-After": future}), (0, 200, OK_BODY)])
    t0 = time.time()
    assert HttpReward(url, timeout=0.4, retries=1)(the_batch()).tolist() == [0.5] * 6
    assert server.requests == 2 and 0.35 < time.time() - t0 < 1.5


@pytest.mark.parametrize("status", [400, 401, 403, 404, 413, 422])
def test_other_4xx_fail_at_once_with_the_servers_message(scripted, status):
    server, url = scripted([(0, status, b'{"error": "bad request body"}', {"Retry-After": "0"}), (0, 200, OK_BODY)])
    with pytest.raises(RewardError, match=f"HTTP {status}: bad request body"):
        HttpReward(url, timeout=5, retries=3)(the_batch())
    assert server.requests == 1


def test_retry_after_header_values():
    from chatrl.rewards.http import is_transient, retry_after_s

    assert [is_transient(c) for c in (408, 429, 500, 503, 599, 400, 404, 413, 200)] == [True] * 5 + [False] * 4
    assert retry_after_s("0", 10) == 0 and retry_after_s("2.5", 10) == 2.5 and retry_after_s("120", 10) == 10
    assert retry_after_s("Wed, 21 Oct 2015 07:28:00 GMT", 10) == 0
    assert retry_after_s("Wed, 21 Oct 2015 07:28:00 GMT", 10, now=1445412475.0) == 5.0
    assert retry_after_s(None, 10) is None and retry_after_s("soon", 10) is None and retry_after_s("-3", 10) == 0


def test_no_server_is_a_clear_error():
    from chatrl.dist import free_port

    url = f"http://127.0.0.1:{free_port()}/"
    with pytest.raises(RewardError, match=rf"reward server {url} at step 4: failed after 1 attempt\(s\): "
                                          "cannot connect"):
        HttpReward(url, timeout=2, retries=0)(the_batch())


def test_text_reward_model_scores_like_the_model(tiny_opt, tmp_path):
    from chatrl.data import encode_answer, encode_prompt
    from chatrl.models import load_tokenizer
    from chatrl.reward_model import load_reward_model, save_reward_model
    from chatrl.rewards.model import TextRewardModel

    tok = load_tokenizer(str(tiny_opt))
    rm = load_reward_model(str(tiny_opt), tok, require_head=False)
    torch.manual_seed(1)
    with torch.no_grad():
        rm.hf.score.weight.normal_(0.0, 1.0)
    save_reward_model(rm, tok, tmp_path / "rm")
    source = TextRewardModel(str(tmp_path / "rm"), max_seq_len=64, device="cpu")
    b = RewardBatch(["What is 2+2?", "Name a colour."], ["4", "Blue, like the sky."])
    got = source(b)
    rm.eval()
    with torch.no_grad():
        expect = []
        for p, a in zip(b.prompts, b.answers, strict=True):
            ids = encode_prompt(tok, ({"role": "user", "content": p},)) + encode_answer(tok, a)
            expect.append(rm(torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long)).end_scores.item())
    assert got.tolist() == pytest.approx(expect, abs=1e-5)
    with pytest.raises(RewardError, match="answer 0 at step 0 does not fit max_seq_len=3"):
        TextRewardModel(str(tmp_path / "rm"), max_seq_len=3, device="cpu")(RewardBatch(["q"], ["a b c d e f"]))
