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

`mode="generate"` serves generation instead, as a target's server would: SGLang `/generate`
(the model's real greedy output ids) and the OpenAI/OpenRouter chat route (the tokenizer's chat
template, the real greedy answer as the target's serving stack returns it: decoded text, or for
a Kimi tokenizer vLLM's kimi_k2 parsers' reasoning, content and calls; usage counting the
emitted tokens, with a cost at fake_llm's prices; a bearer key when `api_key` is set).
"""

from __future__ import annotations

import json
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch

from .fake_llm import PRICE_COMPLETION, PRICE_PROMPT


class SGLangServer:
    def __init__(
        self,
        model,
        mode: str,
        layer_ids: list[int] = (),
        faults: list[str] = (),
        tokenizer=None,
        api_key: str | None = None,
    ):
        self.model, self.mode, self.layer_ids = model, mode, layer_ids
        self.faults = list(faults)
        self.tokenizer, self.api_key = tokenizer, api_key
        self.routes: dict[str, int] = {}  # path -> requests answered
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

    def stops(self) -> set:
        """The model's eos, the tokenizer's and the generation config's (Kimi: <|im_end|>)."""
        stop = {self.model.config.eos_token_id, self.tokenizer.eos_token_id}
        return stop | {getattr(self.model.generation_config, "eos_token_id", None)}

    @torch.inference_mode()
    def greedy(self, ids: list[int], max_new: int) -> list[int]:
        """The model's greedy continuation of `ids`, up to its eos (kept) or `max_new` tokens."""
        out: list[int] = []
        stop = self.stops()
        with self._lock:
            while len(out) < max_new:
                out.append(int(self.model(torch.tensor([ids + out])).logits[0, -1].argmax()))
                if out[-1] in stop:
                    break
        return out

    def generate(self, body: dict) -> dict:
        """SGLang `/generate` (no hidden states): the model's real greedy output ids."""
        ids, cap = body["input_ids"], body["sampling_params"]["max_new_tokens"]
        out = self.greedy(ids, cap)
        length = len(out) == cap and out[-1] != self.tokenizer.eos_token_id
        finish = (
            {"type": "length", "length": cap} if length else {"type": "stop", "matched": out[-1]}
        )
        return {
            "text": self.tokenizer.decode(out, skip_special_tokens=True),
            "output_ids": out,
            "meta_info": {
                "id": uuid.uuid4().hex,
                "finish_reason": finish,
                "prompt_tokens": len(ids),
                "completion_tokens": len(out),
                "cached_tokens": 0,
            },
        }

    def chat(self, body: dict) -> dict:
        """OpenAI/OpenRouter chat: the target's template, real greedy text, usage with cost."""
        ids = self.tokenizer.apply_chat_template(
            body["messages"], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        out = self.greedy(list(ids), body["max_tokens"])
        finish = "stop" if out[-1] in self.stops() else "length"
        cost = round(len(ids) * PRICE_PROMPT + len(out) * PRICE_COMPLETION, 10)
        message = self.message(out[:-1] if finish == "stop" else out, body)
        return {
            "id": "gen-" + uuid.uuid4().hex[:16],
            "model": body.get("model"),
            "provider": (body.get("provider") or {}).get("order", ["local"])[0],
            "choices": [{"index": 0, "message": message, "finish_reason": finish}],
            "usage": {
                "prompt_tokens": len(ids),
                "completion_tokens": len(out),
                "total_tokens": len(ids) + len(out),
                "cost": cost,
            },
        }

    def message(self, out: list[int], body: dict) -> dict:
        """The answer as the target's serving stack returns it: for a Kimi tokenizer, what
        vLLM's kimi_k2 reasoning and tool parsers make of the emitted tokens (reasoning apart,
        OpenRouter's field); for others, the decoded text."""
        if "<|tool_calls_section_begin|>" not in self.tokenizer.get_vocab():
            return {
                "role": "assistant",
                "content": self.tokenizer.decode(out, skip_special_tokens=True),
            }
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.reasoning.kimi_k2_reasoning_parser import KimiK2ReasoningParser
        from vllm.tool_parsers.kimi_k2_tool_parser import KimiK2ToolParser

        text = self.tokenizer.decode(out, skip_special_tokens=False)
        req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "-"}])
        reasoning, content = KimiK2ReasoningParser(self.tokenizer).extract_reasoning(text, req)
        message = {"role": "assistant", "content": content or ""}
        calls = KimiK2ToolParser(self.tokenizer).extract_tool_calls(content or "", req)
        if calls.tools_called:
            message["content"] = calls.content or ""
            message["tool_calls"] = [c.model_dump(exclude_none=True) for c in calls.tool_calls]
        if reasoning:
            message["reasoning"] = reasoning
        return message

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
                server.routes[self.path] = server.routes.get(self.path, 0) + 1
                if server.mode == "generate":
                    return self._generation(body)
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

            def _generation(self, body: dict) -> None:
                if self.path == "/generate":
                    return self._send(200, server.generate(body))
                if self.path not in ("/v1/chat/completions", "/chat/completions"):
                    return self._send(404, {"error": "not found"})
                if (
                    server.api_key
                    and self.headers.get("Authorization") != f"Bearer {server.api_key}"
                ):
                    return self._send(401, {"error": {"code": 401, "message": "No auth"}})
                return self._send(200, server.chat(body))

            def do_GET(self) -> None:
                if self.path in ("/health", "/get_model_info", "/v1/models", "/v1/key"):
                    pricing = {"prompt": str(PRICE_PROMPT), "completion": str(PRICE_COMPLETION)}
                    data = {"data": [{"id": "target", "pricing": pricing}], "model_path": "target"}
                    if self.path == "/v1/key":
                        data = {"data": {"limit": 10.0, "limit_remaining": 10.0}}
                    return self._send(200, data)
                return self._send(404, {"error": "not found"})

        return Handler
