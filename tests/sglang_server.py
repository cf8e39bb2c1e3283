"""A loopback HTTP server that answers SGLang's `/generate` with a real forward pass.

It runs a transformers model in-process and replies in SGLang's response shape with
`return_hidden_states`: `meta_info.hidden_states[0]` holds the prefill states of every input
token, [T, W] as nested lists. Like a real server it returns one kind of state per launch:
`mode="aux"` (`--enable-return-aux-hidden-states`: the EAGLE-3 aux layers concatenated,
taken from transformers' `output_hidden_states` at index SGL-id + 1) or `mode="full"`
(`--enable-return-hidden-states`: the state fed to lm_head, the tuple's last entry).

`faults` are served in order, one per request, before any answer: "503" (busy, with
`Retry-After: 0`), "truncated" (a 200 whose JSON is cut in half), "drop" (the connection is
closed without an answer).
"""

from __future__ import annotations

import json
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch


class SGLangServer:
    def __init__(self, model, mode: str, layer_ids: list[int], faults: list[str] = ()):
        self.model, self.mode, self.layer_ids = model, mode, layer_ids
        self.faults = list(faults)
        self.requests = 0
        self._lock = threading.Lock()
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self._httpd.server_port}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)

    def __enter__(self) -> SGLangServer:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    @torch.inference_mode()
    def answer(self, ids: list[int]) -> dict:
        with self._lock:
            out = self.model(torch.tensor([ids]), output_hidden_states=True)
        hs = out.hidden_states
        if self.mode == "aux":
            states = torch.cat([hs[i + 1][0] for i in self.layer_ids], dim=-1)
        else:
            states = hs[-1][0]
        return {
            "text": "",
            "output_ids": [int(out.logits[0, -1].argmax())],
            "meta_info": {
                "id": uuid.uuid4().hex,
                "finish_reason": {"type": "length", "length": 1},
                "prompt_tokens": len(ids),
                "completion_tokens": 1,
                "cached_tokens": 0,
                "hidden_states": [states.float().tolist()],
            },
        }

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                return None

            def _send(self, code: int, body: object, headers=None, cut: bool = False) -> None:
                data = json.dumps(body).encode()
                if cut:
                    data = data[: len(data) // 2]
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.requests += 1
                if self.path != "/generate":
                    return self._send(404, {"error": "not found"})
                fault = server.faults.pop(0) if server.faults else None
                if fault == "503":
                    return self._send(503, {"error": "busy"}, {"Retry-After": "0"})
                if fault == "drop":
                    self.close_connection = True
                    return None
                if fault == "truncated":
                    return self._send(200, [{"text": "", "meta_info": {}}], cut=True)
                if not body.get("return_hidden_states"):
                    return self._send(400, {"error": "return_hidden_states not set"})
                ids = body["input_ids"]
                if ids and isinstance(ids[0], list):
                    return self._send(200, [server.answer(x) for x in ids])
                return self._send(200, server.answer(ids))

        return Handler
