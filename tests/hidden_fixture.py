"""Hidden-state samples for tests, shaped exactly as eaglet.formats.hidden_store.HiddenReader
yields them.

They come from a real target run with output_hidden_states=True: HF tuple index k is the output
of decoder layer k-1, so SGLang id i is index i+1, and the last entry is after the final norm.
"""

from __future__ import annotations

from pathlib import Path

import torch

TINY = {
    "vocab_size": 1024,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 512,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "eos_token_id": 2,
}


def sgl_ids(num_layers: int) -> list[int]:
    return [1, num_layers // 2 - 1, num_layers - 4]


def tiny_llama(path: Path | None = None, seed: int = 0):
    """A random 8-layer Llama (hidden 256) built under a fixed seed; saved to `path` if given."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**TINY)).eval().requires_grad_(False)
    if path is not None:
        model.save_pretrained(path)
    return model


def sample(model, sid: str, prompt: list[int], response: list[int]) -> dict:
    """One sample of the reader contract from a real forward pass of `model`."""
    ids = torch.tensor(prompt + response)
    with torch.no_grad():
        hs = model(ids[None], output_hidden_states=True).hidden_states
    layers = sgl_ids(model.config.num_hidden_layers)
    return {
        "id": sid,
        "input_ids": ids,
        "loss_mask": torch.tensor([False] * len(prompt) + [True] * len(response)),
        "aux": torch.stack([hs[i + 1][0] for i in layers], dim=1),
        "last": hs[-1][0],
    }


def greedy_samples(model, n: int, prompt_len: int, new_tokens: int, seed: int = 0) -> list[dict]:
    """Random prompts answered greedily by the model itself, like regenerated responses."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        prompt = torch.randint(3, model.config.vocab_size, (prompt_len,), generator=g)
        with torch.no_grad():
            full = model.generate(
                prompt[None], max_new_tokens=new_tokens, do_sample=False, eos_token_id=2
            )
        out.append(sample(model, f"s{i:04d}", prompt.tolist(), full[0, prompt_len:].tolist()))
    return out


class MemoryReader:
    """The reader contract over samples held in memory; `cfg` is the target's config."""

    def __init__(self, samples: list[dict], cfg):
        layers = sgl_ids(cfg.num_hidden_layers)
        self.manifest = {
            "target": {
                "model": "tiny-llama",
                "num_hidden_layers": cfg.num_hidden_layers,
                "hidden_size": cfg.hidden_size,
                "vocab_size": cfg.vocab_size,
            },
            "aux_layer_ids": {"sglang": layers, "vllm": [i + 1 for i in layers]},
            "dtype": "float32",
            "samples": [{"id": s["id"], "tokens": len(s["input_ids"])} for s in samples],
        }
        self._samples = {s["id"]: s for s in samples}
        self.ids = [s["id"] for s in samples]

    def __len__(self) -> int:
        return len(self.ids)

    def __iter__(self):
        return (self._samples[i] for i in self.ids)

    def get(self, sid: str) -> dict:
        return self._samples[sid]


HP = {
    "ttt_length": 3,
    "step_weight": 0.8,
    "epochs": 8,
    "max_steps": None,
    "batch_size": 4,
    "grad_accum": 1,
    "lr": 3e-3,
    "min_lr_ratio": 0.1,
    "warmup_ratio": 0.05,
    "weight_decay": 0.0,
    "max_grad_norm": 0.5,
    "dtype": "float32",
    "seed": 0,
    "heldout_fraction": 0.1,
    "max_length": 512,
    "processes": 1,
    "device": "cpu",
}


def hyper(**over):
    """The tiny runs' hyperparameters (HP), typed as the trainer reads them, with `over`."""
    from eaglet.stages.train.spec import TrainHyper

    return TrainHyper.of(HP | over)


def evaluate_settings(**over):
    """Evaluate settings for a tiny engine run (one greedy pass, fp32 on CPU), with `over`."""
    from eaglet.stages.evaluate.spec import EvaluateSettings

    base = dict(
        num_steps=(3,),
        prompts=2,
        temperatures=(0.0,),
        seed=0,
        max_new_tokens=8,
        dtype="float32",
        device="cpu",
        engine="vllm",
        engine_concurrency=1,
        engine_eager=True,
        engine_tensor_parallel_size=1,
        engine_extra_args=(),
        in_process=False,
    )
    return EvaluateSettings(**(base | over))


def fit_tiny(bundle: dict, out: Path, draft_vocab: int = 256, init=None, **hp) -> dict:
    """Train a drafter on a tiny-target bundle with eaglet.stages.train.kernel.fit (from the drafter
    `init`, when given); return its stats."""
    from eaglet.model.drafter import DrafterConfig
    from eaglet.stages.train import kernel as train_kernel
    from eaglet.stages.vocab import kernel as vocab_kernel

    reader = MemoryReader(bundle["samples"], bundle["config"])
    cfg = DrafterConfig.from_target(
        bundle["config"], draft_vocab, sgl_ids(TINY["num_hidden_layers"])
    )
    d2t, t2d = vocab_kernel.select(vocab_kernel.count_tokens([reader], cfg.vocab_size), draft_vocab)
    every = hp.pop("checkpoint_every", 1000)
    tensors = {"embed": bundle["embed"], "lm_head": bundle["lm_head"], "d2t": d2t, "t2d": t2d}
    return train_kernel.fit([reader], cfg, tensors, hyper(**hp), out, every, quiet=True, init=init)


def bundle(n: int = 20, prompt_len: int = 8, new_tokens: int = 16) -> dict:
    """What training needs of the tiny target: its samples, embeddings, lm_head and config."""
    from types import SimpleNamespace

    model = tiny_llama()
    return {
        "samples": greedy_samples(model, n, prompt_len, new_tokens),
        "embed": model.model.embed_tokens.weight.clone(),
        "lm_head": model.lm_head.weight.clone(),
        "config": SimpleNamespace(**TINY, rms_norm_eps=model.config.rms_norm_eps),
    }
