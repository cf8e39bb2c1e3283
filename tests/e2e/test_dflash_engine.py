"""Stock vLLM (the CPU build) serving a DFlash drafter eaglet trained on SmolLM2's own greedy
answers: the engine's greedy text is the target's, and it accepts what eaglet's drafter
predicts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from eaglet.formats import dflash_export
from eaglet.formats.dflash import save_dflash
from eaglet.model.dflash.config import DFlashConfig
from eaglet.model.dflash.train import Hyper, fit, init
from eaglet.model.target import materialize, resolve
from eaglet.stages.vocab import kernel as vocab_kernel

from ..hidden_fixture import evaluate_settings

QUESTIONS = [
    "Is it safe to put a cast iron pan in the dishwasher?",
    "What is the capital of France?",
    "Give me three tips for sleeping better.",
    "How do I boil an egg?",
    "Write a haiku about the sea.",
    "What does a CPU do?",
    "Name two primary colors.",
    "Why is the sky blue?",
]
NEW = 32
LAYERS = [1, 14, 26]  # EAGLE-3's stored states on SmolLM2 (outputs of these layers)
MASK = 16  # <empty_output>: a Jupyter-notebook marker the chat model never answers with
BLOCK = 4
STEPS = 50  # slot accuracy ~0.85 there (0.98 at 150): acceptance high, not all-or-nothing
VOCAB = 1024  # a draft vocabulary (lm_head + d2t): the full 49,152 trains 48x slower here
EOS = 2


def greedy(target, prompt: list[int]) -> list[int]:
    """The target's plain greedy answer (transformers, fp32), its stop token left out."""
    out = target.generate(
        torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, eos_token_id=EOS
    )[0, len(prompt) :].tolist()
    return out[: out.index(EOS)] if EOS in out else out


def chain(model, sample: dict, start: int, k: int) -> list[int]:
    """The drafts accepted in each round of greedy verification over the stored answer from
    position `start` (the first answer token, produced by the target's prefill): each round's
    block is anchored at the token the target just produced, its K drafts are accepted while
    they equal the answer, then the target's own next token anchors the next round."""
    ids, aux = sample["input_ids"], sample["aux"]
    a, end, rounds = start, len(ids), []
    with torch.no_grad():
        while a < end - 1:
            drafts = model(aux[None].float(), ids[None], torch.tensor([[a]]))[0, 0, 1:].argmax(-1)
            drafts = model.to_target(drafts)
            n = 0
            while n < k and a + n + 1 < end and drafts[n] == ids[a + n + 1]:
                n += 1
            rounds.append(n)
            a += n + 1
    return rounds


@pytest.mark.engine
def test_evaluate_measures_a_trained_dflash_export_on_stock_vllm(tmp_path):
    """SmolLM2's greedy answers to 8 questions, its states at EAGLE-3's layers, a 1-layer
    DFlash drafter (block 4, a 1,024-token draft vocabulary) trained on them for 50 steps,
    saved as the train stage saves it and exported; the evaluate stage's engine path
    (evaluate_kernel.settings, evaluate_engine.engine_metrics: a plain server, then vLLM serving
    the export with method dflash, fp32, eager) measures it: num_steps is block_size - 1 whatever
    evaluate.num_steps lists, the plain greedy tokens are the target's own (transformers), the
    speculative ones equal them, and acceptance length and acceptance per position from
    /metrics equal eaglet's own greedy chain over the same answers with the exported (bf16)
    weights."""
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from eaglet.stages.evaluate import engine as evaluate_engine
    from eaglet.stages.evaluate import kernel as evaluate_kernel

    torch.manual_seed(0)
    folder = materialize(resolve("smollm2-135m-instruct"))
    tok = AutoTokenizer.from_pretrained(folder)
    target = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompts = [
        list(
            tok.apply_chat_template(
                [{"role": "user", "content": q}],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
            )
        )
        for q in QUESTIONS
    ]
    samples = []
    with torch.no_grad():
        for p in prompts:
            answer = greedy(target, p)
            assert MASK not in answer
            ids = torch.tensor(p + answer)
            hs = target(ids[None], output_hidden_states=True).hidden_states
            aux = torch.stack([hs[i + 1][0] for i in LAYERS], dim=1)  # output of layer i
            mask = torch.arange(len(ids)) >= len(p)
            samples.append({"input_ids": ids, "loss_mask": mask, "aux": aux, "prompt": len(p)})

    text = json.loads((Path(folder) / "config.json").read_text())
    counts = torch.zeros(text["vocab_size"], dtype=torch.long)
    for s in samples:
        counts += torch.bincount(s["input_ids"][s["loss_mask"]], minlength=len(counts))
    d2t, _ = vocab_kernel.select(counts, VOCAB)  # eaglet's vocab stage's choice over these answers
    cfg = DFlashConfig.from_target(
        text, target_layer_ids=LAYERS, mask_token_id=MASK, block_size=BLOCK, draft_vocab_size=VOCAB
    )
    embed = target.model.embed_tokens.weight.detach()
    model = init(cfg, embed, target.lm_head.weight.detach(), d2t)
    rows = fit(model, samples, Hyper(steps=STEPS, lr=2e-3, batch_size=8, warmup=10))
    print(f"loss {rows[0]['loss']:.3f} -> {rows[-1]['loss']:.3f}, slot accuracy {rows[-1]['acc']}")
    assert rows[-1]["loss"] < 0.5 * rows[0]["loss"]
    trained, out = tmp_path / "train", tmp_path / "dflash"
    save_dflash(model, trained, rows)
    dflash_export.write(model, out)
    exported = dflash_export.load(out, embed)
    rounds = [n for s in samples for n in chain(exported, s, s["prompt"], BLOCK - 1)]
    own = 1 + sum(rounds) / len(rounds)
    per_position = [sum(n >= j for n in rounds) / len(rounds) for j in range(1, BLOCK)]

    cfg = evaluate_settings(  # EAGLE-3's lists: a DFlash drafter drafts block_size - 1
        num_steps=(1, 5), prompts=len(samples), max_new_tokens=NEW
    )
    spec = SimpleNamespace(name="dflash", values=SimpleNamespace(settings=cfg))
    setup = SimpleNamespace(
        trained=trained,
        export=out,
        target=resolve("smollm2-135m-instruct"),
        engine_url=None,
        target_max_length=1024,
        threads=2,
    )
    cfg, method = evaluate_kernel.settings(spec, setup)
    assert (method, cfg.num_steps) == ("dflash", (BLOCK - 1,))
    _, engine = evaluate_engine.engine_metrics(spec, setup, {"q": prompts}, {EOS}, cfg, method)
    suite = engine["q"]
    m = suite.runs[0][BLOCK - 1]
    print(f"eaglet chain {own:.3f} {per_position} over {len(rounds)} rounds; vLLM {m}")
    outputs = [o[: o.index(EOS)] if EOS in o else o for o in suite.greedy_outputs]
    assert outputs == [s["input_ids"][s["prompt"] :].tolist() for s in samples]
    assert m.greedy.greedy_equal and m.greedy.greedy_mismatches == 0
    # each round's block depends only on the context and the anchor, the same in both; a
    # round cut by max_tokens may end apart (vLLM verifies drafts past the cut)
    assert own > 1.5 and abs(m.counters.drafts - len(rounds)) <= 1
    assert m.acceptance_length == pytest.approx(own, abs=0.05)
    assert m.counters.accepted_per_position == pytest.approx(per_position, abs=0.05)
