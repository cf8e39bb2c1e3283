"""What decides the export's check: the probe the exported folder and the checkpoint must agree
on (the folder's bytes are eaglet.formats.exports)."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import torch

from eaglet.errors import EagletError
from eaglet.formats import exports
from eaglet.model.drafter import Drafter

PROBE_STEPS = 3


def probe(model: Drafter, seed: int = 0) -> list[torch.Tensor]:
    """Draft logits of a fixed random input over PROBE_STEPS chained steps."""
    g = torch.Generator().manual_seed(seed)
    cfg = model.cfg
    aux = torch.randn(1, 24, len(cfg.aux_layer_ids), cfg.target_hidden_size, generator=g)
    ids = torch.randint(0, cfg.vocab_size, (1, 24), generator=g)
    with torch.no_grad():
        return model(aux, ids, PROBE_STEPS)


def validate(folder: Path, reference: Drafter) -> dict:
    """Reload `folder` from its files alone and check it against the trained `reference`:
    config fields, tensors, vocab maps, and the same draft outputs on a probe. Raises
    EagletError on the first problem; returns what was checked."""
    folder = Path(folder)
    fmt, model = exports.load_export(folder, reference.embed_tokens.weight)
    ref = reference.cfg
    if model.cfg != ref:
        mine, theirs = asdict(model.cfg), asdict(ref)
        diff = {k: (v, theirs[k]) for k, v in mine.items() if theirs[k] != v}
        raise EagletError(f"{folder}/config.json: differs from the trained drafter: {diff}")
    # the trained weights as the export stores them (SGLang's embeddings stay the target's)
    stored = {exports._internal(n): t for n, t in exports.tensors(reference, fmt).items()}
    rounded = Drafter(ref)
    rounded.load_state_dict(
        {n: stored[n].float() if n in stored else t for n, t in reference.state_dict().items()}
    )
    got, want, exact = probe(model), probe(rounded.eval()), probe(reference.eval())
    for k, (a, b) in enumerate(zip(got, want, strict=True)):
        if not torch.allclose(a, b, rtol=1e-4, atol=1e-4):
            err = float((a - b).abs().max())
            raise EagletError(f"{folder}: step {k} outputs differ from the trained drafter ({err})")
    agree = [
        float((a.argmax(-1) == b.argmax(-1)).float().mean())
        for a, b in zip(got, exact, strict=True)
    ]
    return {
        "format": fmt,
        "tensors": len(exports.expected_shapes(ref, fmt)),
        "aux_layer_ids": list(
            ref.aux_layer_ids if fmt == "sglang" else [i + 1 for i in ref.aux_layer_ids]
        ),
        "max_abs_diff": max(float((a - b).abs().max()) for a, b in zip(got, want, strict=True)),
        "top1_agreement_vs_fp32": agree,
    }
