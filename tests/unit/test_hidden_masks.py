"""Samples and loss masks over chat templates (ChatML, Llama-3 style, a <think> reasoning
template): the prompt as the template renders it, then exactly the generated ids.

The tokenizer is a byte-level BPE trained here on the standard library's `email` package
(about 1 s), with each template's special tokens.
"""

import glob
import sysconfig
from pathlib import Path
from types import SimpleNamespace

import pytest

from eaglet.errors import EagletError
from eaglet.stages.hidden.kernel import sequences

SPECIALS = ["<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>"]
SPECIALS += ["<|end_header_id|>", "<|eot_id|>", "<think>", "</think>"]
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LLAMA3 = (
    "<|begin_of_text|>{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>"
    "\n\n{{ m.content | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
THINK = (  # Qwen3-like: the last assistant turn shows its reasoning, earlier ones do not
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' and loop.last and m.reasoning_content %}"
    "<think>\n{{ m.reasoning_content }}\n</think>\n\n{% endif %}{{ m.content }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 6 times 7?"},
    {"role": "assistant", "content": "An earlier answer."},
    {"role": "user", "content": "Say it again."},
]


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    files = sorted(glob.glob(str(Path(sysconfig.get_paths()["stdlib"]) / "email" / "*.py")))
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=2000, special_tokens=SPECIALS, initial_alphabet=alphabet, show_progress=False
    )
    bpe.train(files, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe)


def target(tokenizer, template, max_length=512):
    tokenizer.chat_template = template
    return SimpleNamespace(tokenizer=tokenizer, max_length=max_length, vocab_rows=len(tokenizer))


def record(i, response="The answer is 42.", **kw):
    rec = {"id": f"r{i}", "messages": MESSAGES, "response": response, "output_ids": None}
    return {"reasoning": None, "finish_reason": "stop", **rec, **kw}


def masked(tok, sample):
    pairs = zip(sample["input_ids"], sample["loss_mask"], strict=True)
    return tok.decode([t for t, m in pairs if m])


@pytest.mark.parametrize("template", [CHATML, LLAMA3, THINK])
def test_mask_is_exactly_the_generated_tokens(tokenizer, template):
    """The prompt as each template renders it with its generation prompt (the earlier
    assistant turn unmasked), then the generated ids as they are, and only those masked."""
    t = target(tokenizer, template)
    out = tokenizer("<think>\n6*7\n</think>\n\nThe answer is 42.<|im_end|>")["input_ids"]
    recs = [record(0, output_ids=out), record(1, output_ids=out[:-1], finish_reason="length")]
    (done, cut), stats = sequences(recs, t, Path("r.jsonl"))
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    n = len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    for s, ids in ((done, out), (cut, out[:-1])):
        assert tokenizer.decode(s["input_ids"][:n]) == prompt and not any(s["loss_mask"][:n])
        assert s["input_ids"][n:] == ids and all(s["loss_mask"][n:]) and s["prompt_tokens"] == n
    assert "An earlier answer." in masked(
        tokenizer, {**done, "loss_mask": [not m for m in done["loss_mask"]]}
    )
    assert stats["from_output_ids"] == 2 and stats["unfinished"] == 1


def test_output_ids_truncation_and_skips(tokenizer):
    prompt = target(tokenizer, CHATML).tokenizer.apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=False
    )
    n = len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    t = target(tokenizer, CHATML, max_length=n + 10)
    out = [*range(100, 108), 1]  # generated ids, ending in <|im_end|>: used as they are
    recs = [
        record(0, output_ids=out),
        record(1, output_ids=list(range(300, 320))),  # 10 tokens too long
        record(2, output_ids=[]),
    ]
    samples, stats = sequences(recs, t, Path("r.jsonl"))
    exact, cut = samples[0], samples[1]
    assert exact["input_ids"][n:] == out and sum(exact["loss_mask"]) == len(out)
    assert len(cut["input_ids"]) == n + 10 and sum(cut["loss_mask"]) == 10
    assert stats["truncated"] == 1 and stats["truncated_tokens"] == 10
    assert stats["skipped_empty_response"] == 1 and stats["samples"] == 2
    short = target(tokenizer, CHATML, max_length=n)  # nothing of the turn fits
    assert (
        sequences([record(0, output_ids=out)], short, Path("r.jsonl"))[1]["skipped_no_loss_tokens"]
        == 1
    )


def test_a_record_without_generated_ids_or_with_foreign_ids_is_one_error(tokenizer):
    """Text without the target's tokens (an older eaglet's record) is never re-rendered here;
    an id past the target's rows is never embedded."""
    t = target(tokenizer, CHATML)
    with pytest.raises(
        EagletError, match=r"r\.jsonl: response r0: no output_ids: .*eaglet generate"
    ):
        sequences([record(0)], t, Path("r.jsonl"))
    with pytest.raises(
        EagletError, match=r"response r1: output id 5000 outside the target's 2000 rows"
    ):
        sequences([record(1, output_ids=[5, 5000])], t, Path("r.jsonl"))
