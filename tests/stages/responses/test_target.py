import pytest

from eaglet.errors import EagletError
from eaglet.model.target import (
    SMOLLM2,
    SMOLLM2_HUB,
    load_model,
    load_tokenizer,
    materialize,
    reference,
    resolve,
)


@pytest.fixture(scope="module")
def smollm2():
    spec = resolve(SMOLLM2)
    return spec, load_tokenizer(spec), load_model(spec, "cpu", "float32")


def test_alias_resolves_to_the_shipped_gguf():
    spec = resolve(SMOLLM2)
    assert spec.kind == "gguf" and spec.location.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    ident = spec.identity()
    assert ident["model"] == SMOLLM2 and len(ident["gguf_sha256"]) == 64
    folder = materialize(spec)
    assert ident["gguf_sha256"][:16] in folder
    assert materialize(spec) == folder  # converted once, then reused


def test_loads_offline_with_the_real_config(smollm2, monkeypatch):
    _, tok, model = smollm2
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size) == (30, 576, 49152)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (9, 3)
    assert not hasattr(cfg, "quantization_config")
    assert tok.eos_token == "<|im_end|>" and tok.convert_tokens_to_ids("<|im_start|>") == 1


def test_generates_coherent_text(smollm2):
    import torch

    from eaglet.formats.chat import prompt_ids

    _, tok, model = smollm2
    ids = prompt_ids(tok, [{"role": "user", "content": "What is the capital of France?"}])
    out = model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)
    text = tok.decode(out[0, len(ids) :], skip_special_tokens=True)
    assert "Paris" in text


def test_local_folder_and_errors(tmp_path):
    folder = materialize(resolve(SMOLLM2))
    local = resolve(folder)
    assert local.kind == "local" and len(local.identity()["tree_sha256"]) == 64
    assert resolve("org/model", "a" * 40).kind == "hub"
    (tmp_path / "empty").mkdir()
    with pytest.raises(EagletError, match=r"no config\.json"):
        resolve(str(tmp_path / "empty"))
    with pytest.raises(EagletError, match="not a built-in alias"):
        resolve("no-such-model")


@pytest.mark.slow
def test_conversion_keeps_the_gguf_logits_exactly(smollm2):
    """The cached safetensors folder computes exactly what transformers' own GGUF load does."""
    import torch
    from transformers import AutoModelForCausalLM

    spec, tok, model = smollm2
    gguf = AutoModelForCausalLM.from_pretrained(
        spec.location.rsplit("/", 1)[0], gguf_file=spec.location.rsplit("/", 1)[1]
    ).eval()
    ids = torch.tensor([tok("The quick brown fox jumps over the lazy dog")["input_ids"]])
    with torch.inference_mode():
        assert torch.equal(gguf(ids).logits, model(ids).logits)


def test_exports_name_the_target_portably(tmp_path):
    assert reference(resolve(SMOLLM2), None, tmp_path) == SMOLLM2_HUB
    folder = tmp_path / "targets" / "tiny"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    local = resolve(str(folder))
    assert reference(local, None, tmp_path) == "./targets/tiny"  # relative, never absolute
    assert reference(local, "org/tiny", tmp_path) == "org/tiny"
    with pytest.raises(EagletError, match=r"target\.hub_id"):
        reference(local, None, tmp_path / "elsewhere")


def test_a_hub_ref_is_pinned_to_its_commit(tmp_path, monkeypatch):
    from huggingface_hub import constants

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--org--tiny"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    (repo / "snapshots" / commit).mkdir(parents=True)
    (repo / "snapshots" / commit / "config.json").write_text("{}")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    spec = resolve("org/tiny")  # revision unset: main, as cached
    assert spec.revision == commit and spec.identity() == {"model": "org/tiny", "revision": commit}
    other = "f" * 40
    assert resolve("org/tiny", other).revision == other  # a commit is taken as is
    with pytest.raises(EagletError, match="moving ref"):
        resolve("org/tiny", "dev")  # a branch nobody has cached, offline
