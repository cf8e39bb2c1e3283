"""What eaglet checks when it loads a target's config and tokenizer, on real files: the
miniature Kimi-K2.5 (tests/kimi_fixture.py) as the hub ships it, and edited copies of it."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import transformers

from eaglet.errors import EagletError
from eaglet.model.target import (
    MODEL_TYPE_ALIASES,
    SMOLLM2,
    check_special_tokens,
    load_config,
    load_tokenizer,
    resolve,
)

from ..kimi_fixture import ORDINARY, SPECIAL, TEXT, TOOL_MARKERS, VOCAB, tiny_kimi

TOOL_CALL_BEGIN = ORDINARY + 13  # `<|tool_call_begin|>`, `special: false` in K2.5's config


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    return tiny_kimi(tmp_path_factory.mktemp("kimi") / "target")


def _copy(kimi: Path, to: Path, **edits) -> Path:
    """A copy of the miniature with JSON files edited: name -> function(data)."""
    shutil.copytree(kimi, to)
    for name, edit in edits.items():
        path = to / f"{name}.json"
        data = json.loads(path.read_text())
        edit(data)
        path.write_text(json.dumps(data))
    return to


def test_kimi_k2_text_config_loads_as_deepseek_v3(kimi, tmp_path):
    """`text_config.model_type: kimi_k2` as the hub ships it, and a plain K2 config.json."""
    raw = json.loads((kimi / "config.json").read_text())
    assert raw["text_config"]["model_type"] == "kimi_k2" and MODEL_TYPE_ALIASES["kimi_k2"]
    for folder in (kimi, _copy(kimi, tmp_path / "k2", config=lambda c: c.update(TEXT))):
        cfg = load_config(resolve(str(folder), trust=True))
        assert type(cfg).__name__ == "DeepseekV3Config" and cfg.model_type == "deepseek_v3"
        sizes = ("hidden_size", "num_hidden_layers", "vocab_size", "kv_lora_rank")
        sizes += ("q_lora_rank", "n_routed_experts", "num_experts_per_tok", "v_head_dim")
        assert {k: getattr(cfg, k) for k in sizes} == {k: TEXT[k] for k in sizes}
        assert cfg.rope_scaling["factor"] == TEXT["rope_scaling"]["factor"]
    nope = _copy(kimi, tmp_path / "nope", config=lambda c: c["text_config"].update(model_type="x"))
    with pytest.raises(EagletError, match=r"text_config\.model_type: 'x' is not a transformers"):
        load_config(resolve(str(nope), trust=True))


def test_every_marker_the_template_emits_must_be_one_id(kimi, tmp_path):
    """Special or not: Kimi's tool-call markers are `special: false` yet one token each."""
    spec = resolve(str(kimi), trust=True)
    added = json.loads((kimi / "tokenizer_config.json").read_text())["added_tokens_decoder"]
    template = (kimi / "chat_template.jinja").read_text()
    for k in TOOL_MARKERS:
        assert added[str(ORDINARY + k)]["special"] is False and SPECIAL[k] in template
    generic = load_tokenizer(resolve(SMOLLM2))
    with pytest.raises(EagletError, match=r"special token '\[BOS\]' encodes to \[\d+, \d+"):
        check_special_tokens(spec, generic)

    # a tokenizer that does not know `<|tool_call_begin|>`: its config lacks it, the template
    # still emits it, so the tokenizer reads it as several ordinary ids
    def drop(config):
        del config["added_tokens_decoder"][str(TOOL_CALL_BEGIN)]

    splits = _copy(kimi, tmp_path / "splits", tokenizer_config=drop)
    # loading it stops: the template writes the marker, the class splits it (issue 53)
    with pytest.raises(
        EagletError,
        match=r"chat template marker '<\|tool_call_begin\|>' encodes to \[\d+, .*"
        r"does not list it.*target\.trust_remote_code is on",
    ):
        load_tokenizer(resolve(str(splits), trust=True))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(splits), trust_remote_code=True)  # its own files
    ids = tok.encode("<|tool_call_begin|>", add_special_tokens=False)
    assert len(ids) > 1
    message = (
        r"tokenizer_config\.json: chat template marker '<\|tool_call_begin\|>' encodes to "
        rf"\[{ids[0]}, .*not its one id \[{TOOL_CALL_BEGIN}\]"
    )
    with pytest.raises(EagletError, match=message):
        check_special_tokens(spec, tok)
    check_special_tokens(spec, load_tokenizer(spec))  # the target's own: every marker one id


def test_ids_past_the_embedding_rows_are_one_error(kimi, tmp_path):
    """A vocab_size smaller than the tokenizer stops at load, not as an IndexError later."""
    small = VOCAB - 8
    short = _copy(
        kimi, tmp_path / "short", config=lambda c: c["text_config"].update(vocab_size=small)
    )
    message = (
        rf"tokenizer_config\.json: token id {VOCAB - 1} \(of {VOCAB} tokens\) is past the "
        rf"model's embedding rows: .*config\.json: text_config\.vocab_size is {small} "
    )
    with pytest.raises(EagletError, match=message) as e:
        load_tokenizer(resolve(str(short), trust=True))
    assert "\n" not in str(e.value)
    assert len(load_tokenizer(resolve(str(kimi), trust=True))) == VOCAB  # exactly fits


@pytest.mark.parametrize(
    "line,error",
    [
        (  # Kimi K2's generation of tokenization_kimi.py on transformers 5.x
            "from transformers.models.gpt2.tokenization_gpt2 import bytes_to_unicode",
            r"ImportError: cannot import name 'bytes_to_unicode' from "
            r"'transformers\.models\.gpt2\.tokenization_gpt2'",  # its path left out
        ),
        (
            "import eaglet_no_such_module",
            r"ImportError: .* not found in your environment: eaglet_no_such_module.*",
        ),
    ],
)
def test_repository_code_that_does_not_import_is_one_error(kimi, tmp_path, line, error):
    folder = _copy(kimi, tmp_path / f"noimport{len(line)}")
    code = folder / "tokenization_kimi.py"
    future = "from __future__ import annotations\n"
    code.write_text(code.read_text().replace(future, f"{future}{line}\n", 1))
    version = re.escape(transformers.__version__)
    message = (
        rf"tokenization_kimi\.py: the repository's tokenizer code does not import on "
        rf"transformers {version} \({error}\): use a target\.revision whose code loads on "
        rf"transformers {version}, or pin the transformers version"
    )
    with pytest.raises(EagletError, match=message) as e:
        load_tokenizer(resolve(str(folder), trust=True))
    assert "\n" not in str(e.value) and "site-packages" not in str(e.value)
