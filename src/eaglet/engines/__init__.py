"""The engine layer: one module per engine (transformers, vllm, sglang, openai), each declaring
what it can do (`CAN`: generate, hidden, speculate), one HTTP client and retry policy (`http`),
one lookup the stages use (`lookup`). The vLLM server is started and always stopped here."""
