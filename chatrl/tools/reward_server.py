"""A small reference reward server: ``python -m chatrl.tools.reward_server``.

Serves any chatrl reward (a Python function, a built-in rule, a trained reward model, or a
weighted sum of them) over the JSON protocol of :mod:`chatrl.rewards.remote` (``docs/rewards.md``),
so rewards can run on another machine than training::

    python -m chatrl.tools.reward_server --reward_fn exact_match --port 8000
    python -m chatrl.tools.reward_server --reward_model out/step2 --reward_fn 0.2*regex_format

then train with ``--reward_url http://that-host:8000/``. Requests are served one at a time (a
model is not shared between threads); the first line printed is ``serving on http://HOST:PORT/``
(with ``--port 0`` the system picks a free port).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from chatrl import config
from chatrl.cli import normalize_argv
from chatrl.models.precision import DTYPE_CHOICES
from chatrl.rewards import RewardContext, WeightedReward, decode_request, kinds

log = logging.getLogger(__name__)

#: Largest request body accepted, bytes.
MAX_BODY = 256 * 1024 * 1024


def make_server(reward: WeightedReward, host: str = "127.0.0.1", port: int = 0) -> ThreadingHTTPServer:
    """An HTTP server answering ``POST`` requests with ``reward``'s total scores.

    ``400`` with ``{"error"}`` for a malformed request, ``500`` with ``{"error"}`` when the reward
    fails; ``200`` with ``{"scores"}`` otherwise. Start it with ``serve_forever()``;
    ``server.server_address`` holds the bound port.
    """
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def _send(self, code: int, obj: dict) -> None:
            body = json.dumps(obj).encode("utf-8")
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self):  # noqa: N802 - http.server's naming
            length = int(self.headers.get("Content-Length") or 0)
            if length > MAX_BODY:
                self._send(413, {"error": f"request body of {length} bytes is over {MAX_BODY}"})
                return
            try:
                batch = decode_request(self.rfile.read(length))
            except ValueError as exc:
                self._send(400, {"error": str(exc)})
                return
            try:
                with lock:
                    total, _ = reward(batch)
            except Exception as exc:  # noqa: BLE001 - reported to the client, the server keeps serving
                log.exception("reward failed")
                self._send(500, {"error": f"{type(exc).__name__}: {exc}"})
                return
            self._send(200, {"scores": total.tolist()})

        def log_message(self, fmt, *args):
            log.debug("%s " + fmt, self.address_string(), *args)

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    return server


def build_parser() -> argparse.ArgumentParser:
    """The reward server's flags."""
    p = config.new_parser("serve a chatrl reward over HTTP (docs/rewards.md)", prog="python -m chatrl.tools.reward_server")
    p.add_argument("--reward_fn", action="append", default=[],
                   help="[WEIGHT*]module:function, path/to/file.py:function or a built-in (exact_match, "
                        "regex_format); repeat to add several")
    p.add_argument("--reward_model", default=None, help="a reward-model folder (step 2's --output_dir)")
    p.add_argument("--reward_model_weight", type=float, default=1.0, help="weight of --reward_model")
    p.add_argument("--max_seq_len", type=int, default=512, help="reward model: max tokens of prompt + answer")
    p.add_argument("--batch_size", type=int, default=8, help="reward model: sequences per forward pass")
    p.add_argument("--dtype", default="fp32", choices=list(DTYPE_CHOICES),
                   help="reward model dtype (auto: bf16 where the device runs it natively; scores are fp32 in every "
                        "dtype)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 for every interface)")
    p.add_argument("--port", type=int, default=8000, help="port (0: any free port)")
    return p


def main(argv: list[str] | None = None) -> None:

    """``python -m chatrl.tools.reward_server``: serve the weighted reward on a local port until interrupted."""
    parser = build_parser()
    args = parser.parse_args(normalize_argv(list(sys.argv[1:] if argv is None else argv)))
    if not args.reward_fn and not args.reward_model:
        parser.error("give --reward_fn and/or --reward_model")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    context = RewardContext(max_seq_len=args.max_seq_len, batch_size=args.batch_size, dtype=args.dtype)
    settings = config.RewardConfig(reward_fn=args.reward_fn)  # each value built by its kind
    model = ([(args.reward_model_weight, kinds.KINDS["model"].source(args.reward_model, settings, context))]
             if args.reward_model else [])
    server = make_server(WeightedReward(model + kinds.sources(settings, context)), args.host, args.port)
    host, port = server.server_address[:2]
    print(f"serving on http://{host}:{port}/", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
