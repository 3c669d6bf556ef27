"""The web chat: ``python chat.py --web --path ACTOR [--compare OTHER_ACTOR]`` → http://127.0.0.1:7860.

A Starlette app served by uvicorn (``pip install -e ".[web]"``). The page (one HTML document, no
external resources) keeps the conversation; each message is answered by every loaded model (two
side by side with ``--compare``, e.g. step 1's actor against step 3's, so the effect of RLHF shows
directly). The server formats and trims the history exactly as the terminal chat does
(:func:`chatrl.conversation.prompt_ids_within`) and streams tokens as server-sent events produced by
transformers' ``TextIteratorStreamer``.

API (JSON):

- ``GET /api/info`` → ``{"models": [{"name", "role", "path", "context"}], "system_prompt": bool, "defaults": {...}}``
  (``role``: what the model is, e.g. ``RLHF (step 3, ppo)`` or ``SFT (step 1)``, from its run marker)
- ``POST /api/chat`` with ``{"model": index, "messages": [{"role", "content"}, ...], "max_new_tokens",
  "temperature" (0: greedy), "top_p", "top_k", "repetition_penalty"}`` → ``text/event-stream`` of
  ``{"delta": text}`` events and a last ``{"done": true, "answer": text, "dropped_turns": n}``. A bad
  request gets status 400 and ``{"error": message}``.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

from chatrl.checkpoint import RUN_MARKER
from chatrl.conversation import HUMAN_MARKER, StopAtMarker, prompt_ids_within
from chatrl.data.formatting import uses_chat_template
from chatrl.models.causal_lm import load_chat_lm, load_tokenizer, stop_token_ids
from chatrl.models.precision import resolve_dtype

ROLES = ("system", "user", "assistant")


def model_role(path: str) -> str | None:
    """What a model folder is, from the run marker chatrl wrote beside it (in it, or in its parent for
    step 3's ``actor/``): ``SFT (step 1)``, ``DPO (step 2)``, ``RLHF (step 3, grpo)``,
    ``RLHF EMA (step 3, ppo)``; None when no marker says."""
    folder = Path(path)
    for where in (folder, folder.parent):
        try:
            marker = json.loads((where / RUN_MARKER).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        step = marker.get("step")
        if step == 1:
            return "SFT (step 1)"
        if step == "2-dpo":
            return "DPO (step 2)"
        if step == 3 and where != folder:
            algorithm = (marker.get("args") or {}).get("rl_algorithm") or "ppo"
            return f"RLHF{' EMA' if folder.name == 'actor_ema' else ''} (step 3, {algorithm})"
    return None


class ChatModel:
    """One loaded model folder: tokenizer (left padding), causal LM in eval mode (in ``dtype``: fp32, bf16 or
    fp16, chat.py's --dtype resolved), context window, and its role in the pipeline
    (:func:`model_role`, else ``role``) shown over its column.

    Raises:
        OSError / FileNotFoundError: ``path`` holds no loadable model (from transformers / chatrl.models.causal_lm).
    """

    def __init__(self, path: str, device: str, trust_remote_code: bool = False, role: str = "model",
                 dtype: str = "fp32"):
        self.path, self.name = path, _short_name(path)
        self.role = model_role(path) or role
        self.tokenizer = load_tokenizer(path, padding_side="left", trust_remote_code=trust_remote_code)
        self.model = load_chat_lm(path, dtype, device, trust_remote_code, self.tokenizer)
        self.device = device
        self.stop_ids = stop_token_ids(self.tokenizer, self.model)  # the stop set of every chatrl generation
        self.context = getattr(self.model.config, "max_position_embeddings", None) or self.tokenizer.model_max_length
        templated = uses_chat_template(self.tokenizer)
        self.stop = None if templated else [HUMAN_MARKER]
        # The Human/Assistant convention puts a system turn first as plain text; a template must know the role.
        self.system_prompt = not templated or "system" in str(self.tokenizer.chat_template)

    def stream(self, messages: list[dict], settings: dict):
        """Yield ``{"delta": text}`` events of the answer to ``messages`` (ending with a user turn), then
        ``{"done": True, "answer": stripped answer, "dropped_turns": turns trimmed to fit the context}``."""
        import torch
        from transformers import StoppingCriteria, StoppingCriteriaList, TextIteratorStreamer

        max_new = settings["max_new_tokens"]
        ids, kept = prompt_ids_within(self.tokenizer, messages, max(8, self.context - max_new))
        input_ids = torch.tensor([ids], device=self.device)
        streamer = TextIteratorStreamer(self.tokenizer, skip_prompt=True, skip_special_tokens=True, timeout=600)
        cancelled = threading.Event()

        class Cancel(StoppingCriteria):
            def __call__(self, input_ids, scores, **kwargs):
                return cancelled.is_set()

        greedy = settings["temperature"] <= 0
        sampling = {} if greedy else {"temperature": settings["temperature"], "top_p": settings["top_p"],
                                      "top_k": settings["top_k"]}
        kwargs = dict(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new,
                      do_sample=not greedy, **sampling, repetition_penalty=settings["repetition_penalty"],
                      eos_token_id=self.stop_ids, pad_token_id=self.tokenizer.pad_token_id,
                      stop_strings=self.stop, tokenizer=self.tokenizer, streamer=streamer,
                      stopping_criteria=StoppingCriteriaList([Cancel()]))

        def run():
            with torch.no_grad():
                self.model.generate(**kwargs)

        worker = threading.Thread(target=run, daemon=True)
        worker.start()
        cut = StopAtMarker() if self.stop else None
        answer = ""
        try:
            for piece in streamer:
                shown = cut.feed(piece) if cut else piece
                if shown:
                    answer += shown
                    yield {"delta": shown}
            rest = cut.flush() if cut else ""
            if rest:
                answer += rest
                yield {"delta": rest}
            yield {"done": True, "answer": answer.strip(), "dropped_turns": _turns(messages) - _turns(kept)}
        finally:  # the client went away, or the answer is complete: stop generating either way
            cancelled.set()


def _turns(messages: list[dict]) -> int:
    return sum(m["role"] == "user" for m in messages)


def _short_name(path: str) -> str:
    p = Path(path)
    return "/".join(p.parts[-2:]) if p.exists() else path


def check_request(body, n_models: int, context: int, defaults: dict | None = None) -> tuple[int, list[dict], dict]:
    """Validate a ``/api/chat`` body; returns ``(model index, messages, settings)``; a setting the body
    leaves out takes its value from ``defaults`` (the command line's).

    Raises:
        ValueError: naming the field that is wrong.
    """
    if not isinstance(body, dict):
        raise ValueError("the body must be a JSON object")
    model = body.get("model", 0)
    if not isinstance(model, int) or not 0 <= model < n_models:
        raise ValueError(f"model: an index from 0 to {n_models - 1}, got {model!r}")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages: a non-empty list of {role, content}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise ValueError(f"messages[{i}]: need {{'role': one of {ROLES}, 'content': text}}")
    if messages[-1]["role"] != "user":
        raise ValueError("messages: the last message must be the user's")
    messages = [m for m in messages if m["role"] != "system" or m["content"].strip()]
    settings = {}
    for name, kind, lo, hi, default in (("max_new_tokens", int, 1, context - 1, 128), ("temperature", float, 0, 10, 0.7),
                                        ("top_p", float, 1e-6, 1, 0.9), ("top_k", int, 0, 10**6, 0),
                                        ("repetition_penalty", float, 0.1, 10, 1.0)):
        value = body.get(name, (defaults or {}).get(name, default))
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi:
            raise ValueError(f"{name}: a number from {lo} to {hi}, got {value!r}")
        settings[name] = kind(value)
    return model, [{"role": m["role"], "content": m["content"]} for m in messages], settings


def build_app(models: list[ChatModel], defaults: dict):
    """The Starlette app serving the page and the API for ``models`` (one, or two side by side)."""
    from starlette.applications import Starlette
    from starlette.responses import HTMLResponse, JSONResponse, StreamingResponse
    from starlette.routing import Route

    async def page(request):
        return HTMLResponse(PAGE)

    async def info(request):
        return JSONResponse({"models": [{"name": m.name, "role": m.role, "path": m.path, "context": m.context}
                                        for m in models],
                             "system_prompt": all(m.system_prompt for m in models), "defaults": defaults})

    async def chat(request):
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return JSONResponse({"error": "the body is not JSON"}, status_code=400)
        try:
            index, messages, settings = check_request(body, len(models), min(m.context for m in models), defaults)
        except ValueError as e:
            return JSONResponse({"error": str(e)}, status_code=400)

        def events():
            for event in models[index].stream(messages, settings):
                yield f"data: {json.dumps(event)}\n\n"

        return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    return Starlette(routes=[Route("/", page), Route("/api/info", info), Route("/api/chat", chat, methods=["POST"])])


def serve(args) -> None:
    """Load ``args.path`` (and ``args.compare``) and serve the chat on ``args.host:args.port`` until Ctrl-C."""
    try:
        import uvicorn
    except ImportError as e:
        raise SystemExit(f"chat.py --web needs {e.name}: pip install -e \".[web]\"") from None
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.seed is not None:
        torch.manual_seed(args.seed)
    dtype = resolve_dtype(getattr(args, "dtype", "fp32"), torch.device(device).type)[0]
    models = [ChatModel(p, device, args.trust_remote_code, role, dtype) for p, role in
              ((args.path, "model"), (args.compare, "compared model")) if p]
    defaults = {"max_new_tokens": args.max_new_tokens, "temperature": 0.0 if args.greedy else args.temperature,
                "top_p": args.top_p, "top_k": args.top_k, "repetition_penalty": args.repetition_penalty,
                "system_prompt": args.system_prompt}
    app = build_app(models, defaults)
    print(f"chatrl web chat: http://{args.host}:{args.port}  ({' | '.join(f'{m.role}: {m.path}' for m in models)}; "
          "Ctrl-C stops)", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


PAGE = r"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>chatrl chat</title><link rel="icon" href="data:,">
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:0;color:#222;background:#f7f7f8}
header{padding:10px 18px;background:#fff;border-bottom:1px solid #ddd;display:flex;gap:18px;align-items:center;flex-wrap:wrap}
header h1{font-size:17px;margin:0} label{font-size:13px;color:#444} input[type=number]{width:64px}
#system{width:100%;box-sizing:border-box;font:inherit;font-size:13px}
#columns{display:grid;gap:12px;padding:12px 18px}
.col{background:#fff;border:1px solid #ddd;border-radius:6px;display:flex;flex-direction:column;min-height:50vh}
.col h2{font-size:14px;margin:0;padding:8px 12px;border-bottom:1px solid #eee;color:#555;word-break:break-all}
.msgs{padding:8px 12px;overflow-y:auto;flex:1}
.msg{margin:8px 0;padding:8px 10px;border-radius:6px;white-space:pre-wrap;line-height:1.4}
.user{background:#e8f0fe} .assistant{background:#f1f3f4} .note{color:#888;font-size:12px}
footer{display:flex;gap:8px;padding:0 18px 18px} #input{flex:1;font:inherit;padding:8px;min-height:44px}
button{font:inherit;padding:6px 16px}
</style></head>
<body>
<header><h1>chatrl chat</h1>
<label>temperature <input id="temperature" type="number" step="0.1" min="0"></label>
<label>top-p <input id="top_p" type="number" step="0.05" min="0" max="1"></label>
<label>top-k <input id="top_k" type="number" step="1" min="0"></label>
<label>max new tokens <input id="max_new_tokens" type="number" step="16" min="1"></label>
<label>repetition penalty <input id="repetition_penalty" type="number" step="0.05" min="0.1"></label>
<div id="system-box" style="flex-basis:100%;display:none"><label>system prompt
<textarea id="system" rows="2"></textarea></label></div>
</header>
<div id="columns"></div>
<footer><textarea id="input" placeholder="Message (Enter sends, Shift+Enter: new line)"></textarea>
<button id="send">Send</button><button id="clear">Clear</button></footer>
<script>
"use strict";
const settingNames = ["temperature", "top_p", "top_k", "max_new_tokens", "repetition_penalty"];
let columns = [], busy = 0;

function el(tag, cls, text) { const e = document.createElement(tag); if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text; return e; }

async function init() {
  const info = await (await fetch("/api/info")).json();
  for (const n of settingNames) document.getElementById(n).value = info.defaults[n];
  if (info.system_prompt) { document.getElementById("system-box").style.display = "";
    document.getElementById("system").value = info.defaults.system_prompt || ""; }
  const box = document.getElementById("columns");
  box.style.gridTemplateColumns = `repeat(${info.models.length}, 1fr)`;
  info.models.forEach((m, i) => {
    const col = el("div", "col"); col.dataset.model = i;
    col.appendChild(el("h2", null, `${m.role}: ${m.name} (context ${m.context})`));
    const msgs = el("div", "msgs"); col.appendChild(msgs); box.appendChild(col);
    columns.push({history: [], msgs});
  });
  document.body.dataset.ready = "1";
}

function settings() { const s = {};
  for (const n of settingNames) s[n] = Number(document.getElementById(n).value); return s; }

async function answer(i, text) {
  const c = columns[i];
  c.history.push({role: "user", content: text});
  c.msgs.appendChild(el("div", "msg user", text));
  const out = el("div", "msg assistant", ""); c.msgs.appendChild(out);
  out.dataset.chunks = "0"; out.dataset.reads = "0";  // events and network reads: > 1 read means it streamed
  const system = document.getElementById("system").value.trim();
  const messages = (system && document.getElementById("system-box").style.display !== "none"
    ? [{role: "system", content: system}] : []).concat(c.history);
  const resp = await fetch("/api/chat", {method: "POST", headers: {"Content-Type": "application/json"},
    body: JSON.stringify({model: i, messages, ...settings()})});
  if (!resp.ok) { out.textContent = "error: " + (await resp.json()).error; out.dataset.done = "error";
    c.history.pop(); return; }
  const reader = resp.body.getReader(), decoder = new TextDecoder();
  let buf = "";
  for (;;) {
    const {value, done} = await reader.read();
    if (done) break;
    out.dataset.reads = String(Number(out.dataset.reads) + 1);
    buf += decoder.decode(value, {stream: true});
    let end;
    while ((end = buf.indexOf("\n\n")) >= 0) {
      const line = buf.slice(0, end); buf = buf.slice(end + 2);
      if (!line.startsWith("data: ")) continue;
      const ev = JSON.parse(line.slice(6));
      if (ev.delta !== undefined) { out.textContent += ev.delta; out.dataset.chunks = String(Number(out.dataset.chunks) + 1); }
      if (ev.done) {
        out.textContent = ev.answer; out.dataset.done = "1";
        c.history.push({role: "assistant", content: ev.answer});
        if (ev.dropped_turns) c.msgs.appendChild(el("div", "note",
          `(${ev.dropped_turns} oldest exchange(s) left out: the conversation no longer fits the context)`));
      }
    }
    c.msgs.scrollTop = c.msgs.scrollHeight;
  }
}

async function send() {
  const input = document.getElementById("input"), text = input.value.trim();
  if (!text || busy) return;
  input.value = ""; busy = 1; document.getElementById("send").disabled = true;
  try { await Promise.all(columns.map((_, i) => answer(i, text))); }
  finally { busy = 0; document.getElementById("send").disabled = false; }
}

document.getElementById("send").addEventListener("click", send);
document.getElementById("input").addEventListener("keydown", e => {
  if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); send(); } });
document.getElementById("clear").addEventListener("click", () => {
  for (const c of columns) { c.history = []; c.msgs.replaceChildren(); } });
init();
</script></body></html>
"""
