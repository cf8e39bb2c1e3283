"""vLLM's own draft model classes built on CPU from an export folder, as its loader builds them
(the engine config read from config.json, weights by load_weights, then
process_weights_after_loading), with no engine running: for tests that compare vLLM's module to
eaglet's drafter."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def vllm_loader(target: Path, max_model_len: int = 512) -> Iterator:
    """load(folder, cls) -> (model, draft hf_config, loaded): vLLM's `cls` for the export
    `folder` speculating for the model at `target` (only its config.json is read), fp32 on CPU;
    `loaded`, a copy of its parameters as load_weights left them (processing after loading
    repacks some of them for the CPU's kernels). One process group of one for vLLM's parallel
    layers, for the time of the block."""
    import torch
    from safetensors.torch import load_file
    from transformers import CONFIG_MAPPING
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.distributed.parallel_state import (
        destroy_distributed_environment,
        destroy_model_parallel,
    )
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    started = []
    # vLLM's config reader renames transformers' config classes in place (`config_class.
    # model_type = "kimi_k2"` for a Kimi draft), which later configs of this process would read
    classes = {c: c.model_type for c in CONFIG_MAPPING.values()}

    def load(folder: Path, cls):
        spec = {"method": "eagle3", "model": str(folder), "num_speculative_tokens": 3}
        args = EngineArgs(
            model=str(target),
            speculative_config=spec,
            dtype="float32",
            enforce_eager=True,
            skip_tokenizer_init=True,
            max_model_len=max_model_len,
        )
        config = args.create_engine_config()
        with set_current_vllm_config(config):
            if not started:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", 0))
                    port = s.getsockname()[1]
                init_distributed_environment(1, 0, f"tcp://127.0.0.1:{port}", 0, "gloo")
                initialize_model_parallel(1, 1)
                started.append(True)
            model = cls(vllm_config=config)
            model.load_weights(load_file(str(folder / "model.safetensors")).items())
            loaded = {n: p.detach().clone() for n, p in model.named_parameters()}
            draft = config.speculative_config.draft_model_config
            process_weights_after_loading(model, draft, torch.device("cpu"))
        return model.eval(), draft.hf_config, loaded

    try:
        yield load
    finally:
        for c, model_type in classes.items():
            c.model_type = model_type
        if started:
            destroy_model_parallel()
            destroy_distributed_environment()
