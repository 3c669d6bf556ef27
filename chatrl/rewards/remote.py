"""A reward served over HTTP: the client (:class:`HttpReward`) and the JSON protocol.

Protocol (``docs/rewards.md``): one ``POST`` per batch of at most ``batch_size`` answers to the
URL, ``Content-Type: application/json``, body::

    {"step": 12, "prompts": ["..."], "answers": ["..."], "metadata": [{...}],
     "formatted_texts": ["..."], "token_ids": [[...]]}

(lists of equal length; the last two are optional: the conversation as the model saw it, chat
markers and special tokens kept, and its token ids). A ``200`` response's body is ``{"scores": [0.5, ...]}``, one finite
number per answer, in order. Any other status is an error; its body may be ``{"error": "why"}``.
A transient status (408, 429, 5xx) is retried, after the server's ``Retry-After`` when it sends one.
"""

from __future__ import annotations

import email.utils
import http.client
import json
import math
import time
import urllib.error
import urllib.request

import torch

from chatrl.rewards.base import RewardBatch, RewardError, check_scores

MAX_BACKOFF_S = 5.0

#: HTTP statuses that say "try again later": request timeout, too many requests (and every 5xx).
TRANSIENT_STATUSES = (408, 429)


def is_transient(status: int) -> bool:
    """Whether a failed request with this HTTP status is worth retrying (408, 429, 5xx)."""
    return status in TRANSIENT_STATUSES or 500 <= status <= 599


def retry_after_s(value: str | None, cap: float, now: float | None = None) -> float | None:
    """Seconds to wait before the next attempt from a ``Retry-After`` header: a number of seconds
    or an HTTP date (RFC 9110, section 10.2.3), at least 0 and at most ``cap``; None when the
    header is absent or unreadable (the client's own backoff applies then)."""
    if value is None or not value.strip():
        return None
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError):
            return None
        if when is None:
            return None
        seconds = when.timestamp() - (time.time() if now is None else now)
    if not math.isfinite(seconds):
        return None
    return min(max(seconds, 0.0), cap)


def encode_request(batch: RewardBatch, start: int = 0, stop: int | None = None) -> bytes:
    """The JSON body for answers ``[start, stop)`` of ``batch``."""
    sl = slice(start, stop)
    body = {"step": batch.step, "prompts": batch.prompts[sl], "answers": batch.answers[sl],
            "metadata": batch.metadata[sl]}
    if batch.formatted_texts is not None:
        body["formatted_texts"] = batch.formatted_texts[sl]
    if batch.token_ids is not None:
        body["token_ids"] = [[int(i) for i in ids] for ids in batch.token_ids[sl]]
    return json.dumps(body).encode("utf-8")


def decode_request(body: bytes) -> RewardBatch:
    """Parse a request body (the server side).

    A request without ``formatted_texts`` / ``token_ids`` (an older client) is accepted.

    Raises:
        ValueError: not JSON, not an object, a missing/mistyped field or lists of different lengths.
    """
    try:
        req = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"request body is not JSON: {exc}") from None
    if not isinstance(req, dict):
        raise ValueError(f"request body is a {type(req).__name__}, expected an object")
    for key in ("prompts", "answers"):
        if not isinstance(req.get(key), list) or not all(isinstance(x, str) for x in req[key]):
            raise ValueError(f"request field {key!r} must be a list of strings")
    metadata = req.get("metadata") or [{} for _ in req["answers"]]
    if not isinstance(metadata, list) or not all(isinstance(m, dict) for m in metadata):
        raise ValueError("request field 'metadata' must be a list of objects")
    step = req.get("step", 0)
    if not isinstance(step, int):
        raise ValueError("request field 'step' must be an integer")
    texts, ids = req.get("formatted_texts"), req.get("token_ids")
    if texts is not None and (not isinstance(texts, list) or not all(isinstance(t, str) for t in texts)):
        raise ValueError("request field 'formatted_texts' must be a list of strings")
    if ids is not None and (not isinstance(ids, list) or not all(
            isinstance(r, list) and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in r)
            for r in ids)):
        raise ValueError("request field 'token_ids' must be a list of lists of non-negative integers")
    return RewardBatch(req["prompts"], req["answers"], metadata, step=step, formatted_texts=texts, token_ids=ids)


def decode_response(body: bytes, n: int, where: str) -> torch.Tensor:
    """Parse a ``200`` response body into ``(n,)`` scores.

    Raises:
        RewardError: malformed JSON, no ``scores`` list, wrong length, a non-finite score.
    """
    try:
        resp = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RewardError(f"{where}: malformed JSON response ({exc}): {body[:200]!r}") from None
    if not isinstance(resp, dict) or "scores" not in resp:
        raise RewardError(f"{where}: response has no 'scores' list: {body[:200]!r}")
    return check_scores(resp["scores"], n, where)


class HttpReward:
    """A :class:`~chatrl.rewards.base.RewardSource` that asks a reward server (``--reward_url``).

    Args:
        url: ``http://host:port/path`` the requests are POSTed to.
        timeout: seconds for each request (connect and each read).
        retries: extra attempts after a connection error, a timeout or a transient status (408,
            429, 5xx: :func:`is_transient`), not after another 4xx or a malformed answer (those
            would fail again). The wait before a retry is the server's ``Retry-After`` (seconds or
            an HTTP date, capped at ``timeout``), else a backoff of 0.5 s, 1 s, 2 s, … (max 5 s).
        batch_size: answers per request.
        name: log label.

    A call takes at most about ``(retries + 1) * timeout`` plus the waits per request.

    Raises:
        ValueError: a URL that is not http(s), a non-positive timeout or batch size, negative retries.
        RewardError: at call time, naming the URL and the step, when the last attempt failed or
            the answer is malformed.
    """

    def __init__(self, url: str, *, timeout: float = 60.0, retries: int = 2, batch_size: int = 256,
                 name: str = "http"):
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"--reward_url {url!r}: expected http://host:port/path")
        if not timeout > 0 or not math.isfinite(timeout):
            raise ValueError(f"reward server timeout must be > 0 seconds, got {timeout}")
        if retries < 0 or batch_size < 1:
            raise ValueError(f"reward server retries must be >= 0 and batch size >= 1, got {retries}, {batch_size}")
        self.url, self.timeout, self.retries, self.batch_size, self.name = url, timeout, retries, batch_size, name

    def __call__(self, batch: RewardBatch) -> torch.Tensor:
        parts = [self._post(batch, i, min(i + self.batch_size, len(batch)))
                 for i in range(0, len(batch), self.batch_size)]
        return torch.cat(parts) if parts else torch.zeros(0)

    def _post(self, batch: RewardBatch, start: int, stop: int) -> torch.Tensor:
        where = f"reward server {self.url} at step {batch.step}"
        body = encode_request(batch, start, stop)
        last, wait = "", None
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(min(0.5 * 2 ** (attempt - 1), MAX_BACKOFF_S) if wait is None else wait)
            wait = None
            req = urllib.request.Request(self.url, data=body, method="POST",
                                         headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                    data = resp.read()
            except urllib.error.HTTPError as exc:
                detail = _error_detail(exc)
                if not is_transient(exc.code):
                    raise RewardError(f"{where}: HTTP {exc.code}: {detail}") from None
                last = f"HTTP {exc.code}: {detail}"
                wait = retry_after_s(exc.headers.get("Retry-After") if exc.headers else None, self.timeout)
                continue
            except TimeoutError as exc:
                last = f"no answer within {self.timeout} s ({exc})"
                continue
            except urllib.error.URLError as exc:
                reason = exc.reason
                last = (f"no answer within {self.timeout} s" if isinstance(reason, TimeoutError)
                        else f"cannot connect: {reason}")
                continue
            except (http.client.HTTPException, ConnectionError, OSError) as exc:
                last = f"{type(exc).__name__}: {exc}"
                continue
            return decode_response(data, stop - start, where)
        raise RewardError(f"{where}: failed after {self.retries + 1} attempt(s): {last}")


def _error_detail(exc: urllib.error.HTTPError) -> str:
    try:
        body = exc.read()
        err = json.loads(body).get("error")
        return str(err) if err else body[:200].decode("utf-8", "replace")
    except Exception:  # noqa: BLE001 - the status code alone is still a useful message
        return exc.reason if isinstance(exc.reason, str) else ""
