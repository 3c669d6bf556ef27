"""The HTTP reward path against real servers on 127.0.0.1: the reference server (in-process and as
``python -m chatrl.tools.reward_server``), and servers that are slow, malformed, flaky or absent."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from chatrl.rewards import FunctionReward, HttpReward, RewardBatch, RewardError, WeightedReward
from chatrl.tools.reward_server import make_server
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
                                          r"attempt\(s\): HTTP 500: RewardFunctionError: .*row 0 has no 'reference'"):
        HttpReward(reference_server, timeout=10, retries=1)(bad)
    assert time.time() - t0 < 5
    import urllib.error
    import urllib.request

    req = urllib.request.Request(reference_server, data=b'{"prompts": [1]}', method="POST")
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(req, timeout=10)
    assert info.value.code == 400 and "list of strings" in json.loads(info.value.read())["error"]


def test_reward_server_module_end_to_end(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "chatrl.tools.reward_server", "--reward-fn", "exact_match",
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
    from chatrl.rewards.remote import is_transient, retry_after_s

    assert [is_transient(c) for c in (408, 429, 500, 503, 599, 400, 404, 413, 200)] == [True] * 5 + [False] * 4
    assert retry_after_s("0", 10) == 0 and retry_after_s("2.5", 10) == 2.5 and retry_after_s("120", 10) == 10
    assert retry_after_s("Wed, 21 Oct 2015 07:28:00 GMT", 10) == 0
    assert retry_after_s("Wed, 21 Oct 2015 07:28:00 GMT", 10, now=1445412475.0) == 5.0
    assert retry_after_s(None, 10) is None and retry_after_s("soon", 10) is None and retry_after_s("-3", 10) == 0


def test_no_server_is_a_clear_error():
    from chatrl.distributed.dist import free_port

    url = f"http://127.0.0.1:{free_port()}/"
    with pytest.raises(RewardError, match=rf"reward server {url} at step 4: failed after 1 attempt\(s\): "
                                          "cannot connect"):
        HttpReward(url, timeout=2, retries=0)(the_batch())


def test_text_reward_model_scores_like_the_model(tiny_opt, tmp_path):
    from chatrl.data import encode_answer, encode_prompt
    from chatrl.models.causal_lm import load_tokenizer
    from chatrl.models.reward_model import load_reward_model, save_reward_model
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


@pytest.fixture(scope="module")
def qwen2_reward_model(tmp_path_factory, shared):
    """A tiny reward model with the Qwen2 tokenizer (ChatML template) and a random head."""
    from chatrl.models.causal_lm import load_tokenizer
    from chatrl.models.reward_model import load_reward_model, save_reward_model
    from chatrl.models.tiny import TinySpec, make_tiny_model

    root = tmp_path_factory.mktemp("qwen2_rm")
    make_tiny_model("qwen2", root / "lm", TinySpec(hidden=32, layers=2, heads=2, ffn=64))
    tok = load_tokenizer(str(root / "lm"))
    rm = load_reward_model(str(root / "lm"), tok, require_head=False)
    torch.manual_seed(3)
    with torch.no_grad():
        rm.hf.score.weight.normal_(0.0, 1.0)
    save_reward_model(rm, tok, root / "rm")
    return root / "rm"


def chatml_rollouts(tok):
    """Step 3's rollouts as the trainer holds them: ChatML prompts left-padded, answers right-padded
    through their stop token (one natural, one of arbitrary ids, one cut off without a stop token)."""
    from chatrl.data import encode_answer
    from chatrl.data.formatting import encode_prompts
    from chatrl.generation import left_pad

    prompts = encode_prompts(tok, [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}],
                                   [{"role": "user", "content": "Name a colour."}],
                                   [{"role": "user", "content": "Say <|im_end|> please."}]])
    g = torch.Generator().manual_seed(0)
    answers = [encode_answer(tok, "It is 4."), torch.randint(0, len(tok) - 8, (9,), generator=g).tolist()
               + [tok.convert_tokens_to_ids("<|im_end|>")], encode_answer(tok, "Blue, like the sky")[:3]]
    ids, mask = left_pad(prompts, tok.pad_token_id)
    width = max(len(a) for a in answers)
    ans = torch.full((3, width), tok.pad_token_id)
    act = torch.zeros(3, width, dtype=torch.long)
    for i, a in enumerate(answers):
        ans[i, :len(a)], act[i, :len(a)] = torch.tensor(a), 1
    return torch.cat([ids, ans], 1), torch.cat([mask, act], 1), act, ids.shape[1]


def test_served_reward_model_scores_the_in_process_conversation(qwen2_reward_model):
    """A reward model behind `python -m chatrl.tools.reward_server` gives the score the in-process model
    gives to step 3's rollouts (ChatML markers, a prompt with marker text, arbitrary ids, a cut answer);
    before, prompts lost their markers on the way and were templated anew (another text, another score)."""
    from chatrl.models.causal_lm import load_tokenizer
    from chatrl.models.reward_model import load_reward_model
    from chatrl.rewards import ModelReward, reward_batch_from_tokens
    from chatrl.rewards.model import TextRewardModel
    from chatrl.rewards.remote import encode_request

    rm_dir = str(qwen2_reward_model)
    tok = load_tokenizer(rm_dir, padding_side="left")
    rm = load_reward_model(rm_dir, tok, require_head=True).eval()
    seq, mask, act, p = chatml_rollouts(tok)
    with torch.no_grad():
        in_process = ModelReward(lambda s, m, _: rm(s, m).end_scores)(
            reward_batch_from_tokens(tok, seq, mask, act, p, step=2))
    batch = reward_batch_from_tokens(tok, seq, mask, act, p, step=2)
    assert batch.formatted_texts[0].startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user")
    assert batch.formatted_texts[0].endswith("<|im_start|>assistant\nIt is 4.<|im_end|>")
    text_model = TextRewardModel(rm_dir, device="cpu")
    legacy = text_model(RewardBatch(batch.prompts, batch.answers, step=2))  # what the server saw before
    assert (legacy - in_process).abs().max() > 1e-3
    texts_only = text_model(RewardBatch(batch.prompts, batch.answers, step=2, formatted_texts=batch.formatted_texts))
    assert texts_only[0].item() == pytest.approx(in_process[0].item(), abs=1e-5)  # natural text tokenizes back alike

    proc = subprocess.Popen([sys.executable, "-m", "chatrl.tools.reward_server", "--reward_model", rm_dir, "--port", "0"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**__import__("os").environ, "PYTHONPATH": str(REPO)})
    try:
        seen = []
        for line in proc.stdout:  # model loading may print first
            seen.append(line)
            if line.startswith("serving on http://127.0.0.1:"):
                break
        assert seen and seen[-1].startswith("serving on"), "".join(seen)
        url = seen[-1].split()[-1]
        served = HttpReward(url, timeout=60, batch_size=2)(batch)
        assert served.tolist() == pytest.approx(in_process.tolist(), abs=1e-5)
        # an older client's request (no formatted_texts / token_ids) is still answered, as before
        import urllib.request

        old = json.loads(encode_request(batch))
        del old["formatted_texts"], old["token_ids"]
        req = urllib.request.Request(url, data=json.dumps(old).encode(), method="POST")
        with urllib.request.urlopen(req, timeout=60) as resp:
            assert json.loads(resp.read())["scores"] == pytest.approx(legacy.tolist(), abs=1e-5)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_request_carries_the_conversation_and_checks_the_new_fields():
    from chatrl.rewards import decode_request, encode_request

    b = RewardBatch(["q1", "q2"], ["a1", "a2"], step=5, formatted_texts=["<s>q1 a1</s>", "<s>q2 a2"],
                    token_ids=[[1, 5, 6, 2], [1, 7, 8]])
    back = decode_request(encode_request(b, 1, 2))
    assert (back.prompts, back.formatted_texts, back.token_ids, back.step) == (["q2"], ["<s>q2 a2"], [[1, 7, 8]], 5)
    body = json.loads(encode_request(b))
    for field, bad, message in (("formatted_texts", [1, 2], "list of strings"), ("token_ids", [[1], [-1]], "non-negative"),
                                ("token_ids", [[True], [1]], "non-negative"), ("formatted_texts", ["x"], "1 formatted_texts")):
        with pytest.raises(ValueError, match=message):
            decode_request(json.dumps({**body, field: bad}).encode())
