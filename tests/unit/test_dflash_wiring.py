"""method: dflash in params (keys, one-line errors) and the train/export stage code around
eaglet.model.dflash (save, load, export, validate, serving command)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from eaglet.errors import EagletError
from eaglet.formats.dflash import is_dflash, load_dflash, save_dflash
from eaglet.formats.metrics import EngineInfo, Greedy, Metrics, Run, Suite, summary_json
from eaglet.graph.keys import Keys
from eaglet.model.arch import FIELDS
from eaglet.model.dflash.config import DFlashConfig
from eaglet.model.dflash.train import Hyper, fit, init
from eaglet.params import load
from eaglet.stages.evaluate.spec import EvaluateSettings
from eaglet.stages.export import dflash as export_dflash
from eaglet.stages.hidden import read as hidden_read
from eaglet.stages.train import dflash as train_dflash

from ..conftest import tiny_params, write_params
from ..hidden_fixture import TINY, MemoryReader, bundle, hyper

# drafters.<d>.evaluate as its spec resolves it (EvaluateSpec.evaluate)
EVALUATE = {
    "num_steps": [3],
    "prompts": 2,
    "temperatures": [0],
    "seed": 0,
    "max_new_tokens": 8,
    "dtype": "float32",
    "device": "cpu",
    "engine": "vllm",
    "engine_concurrency": 1,
    "engine_eager": True,
    "engine_tensor_parallel_size": 1,
    "engine_extra_args": [],
    "in_process": False,
}


def test_eagle3_keys_unchanged_and_dflash_keyed(project):
    """method left out and method: eagle3 give the same train key as before the option (the
    spec holds no method then); dflash keys its resolved section, defaults filled and the
    layers defaulting to the stored EAGLE-3 ones."""
    data = tiny_params()
    base = Keys(load(write_params(project, data)))
    train_key, spec = base.key("train", "d"), base.spec("train", "d").values
    assert "method" not in spec.train and "dflash" not in spec.train
    data["drafters"]["d"]["method"] = "eagle3"
    assert Keys(load(write_params(project, data))).key("train", "d") == train_key
    data["drafters"]["d"] |= {"method": "dflash", "dflash": {"mask_token_id": 16}}
    keys = Keys(load(write_params(project, data)))
    assert keys.key("train", "d") != train_key
    assert keys.spec("train", "d").values.train["dflash"] == {
        "block_size": 8,
        "num_layers": 1,
        "anchors": 512,
        "gamma": 4.0,
        "mask_token_id": 16,
        "target_layer_ids": [1, 14, 26],  # what the hidden stage stores for SmolLM2
        "num_target_layers": 30,
    }
    # the same responses and hidden states as the EAGLE-3 drafter
    assert keys.dataset_keys("hidden", "d") == base.dataset_keys("hidden", "d")


@pytest.mark.parametrize(
    ("section", "field", "says"),
    [
        ({"mask_token_id": 16, "block_size": 1}, "block_size", "minimum"),
        ({"mask_token_id": 2}, "mask_token_id", "eos_token_id"),  # SmolLM2's <|im_end|>
        ({}, "mask_token_id", "required"),
        ({"mask_token_id": 49152}, "mask_token_id", "vocab"),
        ({"mask_token_id": 16, "target_layer_ids": [1, 30]}, "target_layer_ids", "out of range"),
        ({"mask_token_id": 16, "target_layer_ids": [1, 20]}, "target_layer_ids", "not stored"),
    ],
)
def test_bad_dflash_params_are_one_line_naming_the_field(project, section, field, says):
    data = tiny_params()
    data["drafters"]["d"] |= {"method": "dflash", "dflash": section}
    with pytest.raises(EagletError) as e:
        Keys(load(write_params(project, data))).key("train", "d")
    message = str(e.value)
    assert "\n" not in message and f"dflash.{field}" in message and says in message, message


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"datasets": {"sg": 2, "dolly": 1}}, "datasets"),
        ({"train": {"phases": [{"epochs": 1}]}}, "train.phases"),
        ({"train": {"select": {"by": "offline_acceptance"}}}, "train.select"),
        ({"train": {"grad_accum": 2}}, "train.grad_accum"),
    ],
)
def test_what_the_dflash_trainer_does_not_do_is_refused_naming_the_field(project, change, field):
    """Weights, phases, selection and accumulation are EAGLE-3's trainer's: a DFlash drafter
    asking for them is refused, not trained without them."""
    data = tiny_params()
    d = data["drafters"]["d"]
    d |= {"method": "dflash", "dflash": {"mask_token_id": 16}}
    d["datasets"] = change.get("datasets", d["datasets"])
    d["train"] |= change.get("train", {})
    with pytest.raises(EagletError) as e:
        Keys(load(write_params(project, data))).key("train", "d")
    message = str(e.value)
    assert "\n" not in message and f"drafters.d.{field}:" in message, message
    assert "method dflash" in message


def test_the_mask_token_must_not_be_in_the_answers():
    data = [{"input_ids": torch.tensor([5, 7, 9]), "loss_mask": torch.tensor([0, 1, 1]).bool()}]
    train_dflash.check_mask_token(data, 5, "p: drafters.d.dflash")  # in the prompt only: fine
    with pytest.raises(EagletError, match=r"^p: drafters.d.dflash.mask_token_id: 9 is a token"):
        train_dflash.check_mask_token(data, 9, "p: drafters.d.dflash")


def test_trained_folder_exports_for_both_engines(tmp_path):
    """A drafter trained on the tiny target's samples, saved as the train stage saves it, then
    exported by the export stage's DFlash path: z-lab's config, the logits of the trained
    drafter within bf16 rounding, and each engine's launch command with block_size - 1
    drafts."""
    data = bundle(n=6, new_tokens=12)
    cfg = DFlashConfig.from_target(
        TINY, target_layer_ids=[1, 3, 4], mask_token_id=5, block_size=4, draft_vocab_size=256
    )
    vocab = torch.arange(256) * 4  # every fourth target id
    model = init(cfg, data["embed"], data["lm_head"], vocab - torch.arange(256))
    rows = fit(model, data["samples"], Hyper(steps=4, batch_size=3, anchors=8))
    trained = tmp_path / "trained"
    save_dflash(model, trained, rows)
    assert is_dflash(trained)
    assert (trained / "metrics.csv").read_text().count("\n") == 5
    back = load_dflash(trained, data["embed"])
    for name, t in model.state_dict().items():
        assert torch.equal(t, back.state_dict()[name]), name
    for fmt, engine in (("vllm", "vllm serve"), ("sglang", "sglang.launch_server")):
        spec = SimpleNamespace(
            name="d",
            values=SimpleNamespace(format=fmt, verifier="org/tiny"),
            provenance=lambda: {"stage": "test"},
        )
        setup = SimpleNamespace(trained=trained, root=tmp_path)
        out, command = export_dflash.run(spec, setup, tmp_path / fmt)
        config = json.loads((out / "config.json").read_text())
        assert config["architectures"] == ["DFlashDraftModel"]
        assert config["dflash_config"] == {
            "target_layer_ids": [1, 3, 4],
            "mask_token_id": 5,
            "block_size": 4,
        }
        assert "eagle_aux_hidden_state_layer_ids" not in config  # vLLM would read it unshifted
        assert engine in command
        assert ('"num_speculative_tokens":3' in command) == (fmt == "vllm")
        assert ("--speculative-dflash-block-size 4" in command) == (fmt == "sglang")


def test_the_stage_trains_on_the_stored_layers_it_names(tmp_path):
    """eaglet.stages.train.dflash.train over a reader (the store's contract): the drafter's
    layers picked out of the stored ones, the held-out split left out, steps from epochs, a d2t
    vocab; the loss falls and the folder loads back."""
    data = bundle(n=8, new_tokens=12)
    reader = MemoryReader(data["samples"], data["config"])
    section = {"block_size": 4, "num_layers": 1, "anchors": 16, "gamma": 4.0}
    section |= {"mask_token_id": 5, "target_layer_ids": [1, 4], "num_target_layers": 8}
    train = {"epochs": 6, "batch_size": 2, "lr": 3e-3, "warmup_ratio": 0.1, "seed": 0}
    train |= {"max_grad_norm": 1.0, "max_length": 64, "dflash": section}
    text = TINY | {"rms_norm_eps": 1e-6}  # the tiny target (LlamaConfig's default eps)
    arch = {k: text[k] for k in FIELDS if k != "rope_scaling"}
    hp = hyper(**train, heldout_fraction=0.25)
    values = SimpleNamespace(hyper=hp, arch=arch | {"rope_scaling": None})
    d2t = torch.arange(512) * 2 - torch.arange(512)  # target ids 0, 2, 4, ...
    out = tmp_path / "trained"
    stats = train_dflash.train(
        [reader], values, "p: drafters.d.dflash", out, data["embed"], data["lm_head"], d2t
    )
    kept, _ = hidden_read.split([reader], 0.25)
    assert stats["samples"] == len(kept) and stats["steps"] == 6 * -(-len(kept) // 2)
    back = load_dflash(out, data["embed"])
    assert back.cfg.target_layer_ids == (1, 4) and back.cfg.draft_vocab_size == 512
    assert back.fc.in_features == 2 * data["config"].hidden_size
    with open(out / "metrics.csv") as f:
        losses = [float(line.split(",")[1]) for line in list(f)[1:]]
    assert losses[-1] < losses[0]


def test_evaluate_sets_a_dflash_drafter_to_block_size_minus_one(tmp_path):
    """evaluate's settings for a trained DFlash folder: method dflash, num_steps block_size - 1
    whatever evaluate.num_steps lists (an EAGLE-3 folder keeps its settings, the same object);
    its engine-only metrics give the summary."""
    from eaglet.stages.evaluate import kernel as evaluate_kernel

    data = bundle(n=3, new_tokens=8)
    cfg = DFlashConfig.from_target(TINY, target_layer_ids=[1, 3, 4], mask_token_id=5, block_size=4)
    model = init(cfg, data["embed"], data["lm_head"], None)
    trained = tmp_path / "trained"
    save_dflash(model, trained, fit(model, data["samples"], Hyper(steps=2, batch_size=3)))
    settings = EvaluateSettings.of(EVALUATE | {"num_steps": [3, 7], "temperatures": [0.0]})
    spec = SimpleNamespace(values=SimpleNamespace(settings=settings))
    got, method = evaluate_kernel.settings(spec, SimpleNamespace(trained=trained))
    assert (method, got.num_steps, settings.num_steps) == ("dflash", (3,), (3, 7))
    eagle = evaluate_kernel.settings(spec, SimpleNamespace(trained=tmp_path / "eagle3"))
    assert eagle[0] is settings and eagle[1] == "eagle3"

    run = Run(1.8, (0.5, 0.4, 0.2), 18, 9.0, Greedy(True, 0, None, None))
    metrics = Metrics(
        drafter="d",
        prompts=2,
        temperatures=(0.0,),
        greedy_reference=None,
        in_process=False,
        suites={"q": Suite(prompts=2, source="q.jsonl", eaglet={}, vllm={0.0: {3: run}})},
        offline={},
        engine=EngineInfo("vllm", 1),
        notes={},
        elapsed_s=1.0,
    )
    stats = evaluate_kernel.summary(metrics, list(got.num_steps))
    assert stats.acceptance_length == 1.8 and stats.acceptance_length_by == "vllm"
    assert summary_json(stats)["suites"]["q"]["vllm_temperature_0"] == {"num_steps_3": 1.8}
