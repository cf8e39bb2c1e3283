"""A loopback OpenAI-compatible server that answers as Kimi-K2.5's serving stack does.

For each prompt (by its last user message) it holds the token stream the target generated, an
oracle written by the test in Kimi's output grammar. Its answer is what vLLM's `kimi_k2`
reasoning and tool-call parsers make of that stream (the parsers a Kimi server runs): the
reasoning apart (`reasoning`, as OpenRouter names it, or `reasoning_content`, as Moonshot's
API does), the content, tool calls with the provider's own ids (`call_...`, not Kimi's), and
usage counting the stream's tokens, reasoning included. So a client that rebuilds the stream
from the pieces can be checked token by token against what the target emitted.

`ids="kimi"`: tool calls keep the id the parser reads from the stream (the header the model
emitted), as Moonshot's API and a vLLM server do. A stream may be a list of pieces, a `Plain`
piece being text the model wrote as ordinary tokens even where it spells a marker (`</think>`):
the server parses the stream by its tokens, so such text reaches the answer as it is.
"""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

END = "<|im_end|>"


class Plain(str):
    """Text the model emitted as ordinary tokens, whatever markers it spells."""


def stream_ids(tokenizer: Any, stream: str | list[str]) -> list[int]:
    """The tokens of a stream: marker text as its id, `Plain` pieces as ordinary tokens."""
    if isinstance(stream, str):
        return tokenizer(stream, add_special_tokens=False)["input_ids"]
    ids: list[int] = []
    for piece in stream:
        plain = isinstance(piece, Plain)
        ids += tokenizer.encode(piece, allow_special_tokens=not plain)
    return ids


class KimiAPI:
    def __init__(
        self,
        tokenizer: Any,
        streams: dict[str, Any],
        field: str = "reasoning",
        ids: str = "provider",
    ):
        self.tokenizer, self.streams, self.field, self.ids = tokenizer, streams, field, ids
        self.bodies: list[dict] = []
        self.url = ""
        self._server: ThreadingHTTPServer | None = None

    def answer(self, body: dict) -> dict:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.reasoning.kimi_k2_reasoning_parser import KimiK2ReasoningParser
        from vllm.tool_parsers.kimi_k2_tool_parser import KimiK2ToolParser

        last = next(m["content"] for m in reversed(body["messages"]) if m["role"] == "user")
        # the mode asked for, as vLLM/SGLang (template argument) or OpenRouter take it
        thinking = body.get("chat_template_kwargs", {}).get(
            "thinking", body.get("reasoning", {}).get("enabled", True)
        )
        stream = self.streams[last]
        if isinstance(stream, dict):  # the stream the target emits in each mode
            stream = stream[thinking]
        ids = stream_ids(self.tokenizer, stream)
        # the parsers read text: plain pieces stand aside as sentinels, so that only the
        # tokens that are markers act as markers (as a server parsing by ids does)
        pieces = [stream] if isinstance(stream, str) else stream
        plain = {f"\x00{k}\x00": p for k, p in enumerate(pieces) if isinstance(p, Plain)}
        text = "".join(
            next((s for s, q in plain.items() if q is p), p) if isinstance(p, Plain) else p
            for p in pieces
        )
        finished = text.endswith(END)
        request = ChatCompletionRequest(
            model="kimi", messages=[{"role": "user", "content": "-"}], tools=body.get("tools")
        )
        parser = KimiK2ReasoningParser(self.tokenizer, chat_template_kwargs={"thinking": thinking})
        reasoning, content = parser.extract_reasoning(text.removesuffix(END), request)
        message: dict[str, Any] = {"role": "assistant", "content": content or ""}
        calls = KimiK2ToolParser(self.tokenizer).extract_tool_calls(content or "", request)
        if calls.tools_called:
            message["content"] = calls.content or None
            message["tool_calls"] = [
                {
                    "id": c.id
                    if self.ids == "kimi"
                    else "call_" + hashlib.sha256(f"{last}{k}".encode()).hexdigest()[:8],
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": c.function.arguments},
                }
                for k, c in enumerate(calls.tool_calls)
            ]
        if thinking:  # Moonshot sends the field in thinking mode, empty when nothing was thought
            message[self.field] = reasoning or ""
        message = json.loads(_restore(json.dumps(message), plain))
        finish = "tool_calls" if calls.tools_called else "stop"
        return {
            "id": "gen-" + hashlib.sha256(last.encode()).hexdigest()[:12],
            "model": "moonshotai/kimi-k2.5",
            "provider": "Moonshot AI",
            "choices": [
                {"index": 0, "message": message, "finish_reason": finish if finished else "length"}
            ],
            "usage": {"prompt_tokens": 40, "completion_tokens": len(ids), "cost": 1e-6 * len(ids)},
        }

    def start(self) -> KimiAPI:
        api = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def _send(self, status: int, payload: dict) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.path.endswith("/models"):
                    self._send(200, {"data": [{"id": "moonshotai/kimi-k2.5"}]})
                else:
                    self._send(404, {"error": {"code": 404, "message": "no route"}})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                api.bodies.append(body)
                self._send(200, api.answer(body))

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_port}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()


def _restore(text: str, plain: dict[str, str]) -> str:
    """JSON text with each sentinel back as the plain text it stood for."""
    for sentinel, piece in plain.items():
        text = text.replace(json.dumps(sentinel)[1:-1], json.dumps(piece)[1:-1])
    return text
