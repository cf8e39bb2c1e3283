"""What several benchmarks share: the demo projects they build, the stages they time, the
drafters they train and serve. Run any benchmark as `.venv/bin/python -m benchmarks.NAME`."""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from pathlib import Path

import torch
import yaml

from eaglet.engines.vllm.config import ServeConfig
from eaglet.engines.vllm.generate import target_stop_ids
from eaglet.engines.vllm.server import Engine
from eaglet.formats import exports, speculative
from eaglet.formats.drafter import load_drafter
from eaglet.formats.io import read_json, read_jsonl, write_jsonl_zst
from eaglet.formats.metrics import summary_of
from eaglet.formats.records import response_record
from eaglet.graph.keys import Keys, build, sidecar_of
from eaglet.model.drafter import DrafterConfig
from eaglet.model.speculative import against_greedy
from eaglet.model.target import (
    SMOLLM2,
    load_config,
    load_head,
    load_tokenizer,
    materialize,
    resolve,
    spec_of,
)
from eaglet.params import load
from eaglet.stages.evaluate import engine as evaluate_engine
from eaglet.stages.evaluate import suites
from eaglet.stages.export import kernel as export_kernel
from eaglet.stages.hidden import kernel as hidden_kernel
from eaglet.stages.hidden import read as hidden_read
from eaglet.stages.train import kernel as train_kernel
from eaglet.stages.train.spec import TrainHyper
from eaglet.stages.vocab import kernel as vocab_kernel

ROOT = Path(__file__).resolve().parents[1]


def pressure() -> str:
    try:
        return Path("/proc/pressure/cpu").read_text().splitlines()[0]
    except OSError:
        return "n/a"


def corpus() -> str:
    """Every string value of the demo files: real English text for the responses."""
    texts = []

    def walk(x):
        if isinstance(x, str):
            texts.append(x)
        elif isinstance(x, dict | list):
            for v in x.values() if isinstance(x, dict) else x:
                walk(v)

    for p in sorted((ROOT / "data" / "demo").glob("*.json*")):
        lines = [p.read_text()] if p.suffix == ".json" else p.read_text().splitlines()
        for line in lines:
            walk(json.loads(line))
    return "\n".join(texts)


def project(root: Path, args) -> Path:
    shutil.copytree(ROOT / "data" / "demo", root / "data" / "demo")
    data = {
        "target": {"model": SMOLLM2},
        "datasets": {"sg": {"path": "data/demo/sharegpt.jsonl", "format": "sharegpt"}},
        "hidden": {"threads": args.threads, "compute_dtype": args.compute_dtype},
    }
    (root / "params.yaml").write_text(yaml.safe_dump(data))
    params = load(root / "params.yaml")
    tok = load_tokenizer(resolve(SMOLLM2))
    text_ids = tok(corpus(), add_special_tokens=False)["input_ids"]
    prompt_recs = list(read_jsonl(build("prompts", params, "sg")))
    records = []
    for i in range(args.samples):
        p = prompt_recs[i % len(prompt_recs)]
        p = {**p, "id": f"{p['id']}-{i}"}
        start = (i * 997) % (len(text_ids) - args.tokens)
        ids = [*text_ids[start : start + args.tokens - 1], 2]  # ends in <|im_end|>
        result = {
            "response": tok.decode(ids, skip_special_tokens=True),
            "output_ids": ids,
            "prompt_tokens": 0,
            "completion_tokens": len(ids),
            "finish_reason": "stop",
            "model": SMOLLM2,
            "latency_s": 0.0,
        }
        records.append(response_record(p, result, "local", {}))
    write_jsonl_zst(Keys(params).path("responses", "sg"), records)
    return root / "params.yaml"


def with_hidden(params_file: Path, **cfg) -> Path:
    data = yaml.safe_load(params_file.read_text())
    data["hidden"].update(cfg)
    out = params_file.with_name(f"params-{abs(hash(json.dumps(cfg, sort_keys=True)))}.yaml")
    out.write_text(yaml.safe_dump(data))
    return out


def stage(params_file: Path, out: Path) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    build("hidden", load(params_file), "sg", out=out, quiet=True)
    return read_json(sidecar_of(out))["stats"]


def bare(model, seqs: list[list[int]], batch_tokens: int) -> float:
    """Seconds for the decoder trunk alone over the same length batches as the stage."""
    trunk = model.base_model
    groups = hidden_kernel.length_batches([len(s) for s in seqs], batch_tokens)
    t0 = time.perf_counter()
    with torch.inference_mode():
        for g in groups:
            width = max(len(seqs[i]) for i in g)
            ids = torch.zeros((len(g), width), dtype=torch.long)
            for row, i in enumerate(g):
                ids[row, : len(seqs[i])] = torch.tensor(seqs[i])
            trunk(input_ids=ids, use_cache=False)
    return time.perf_counter() - t0


def fit_args(params, drafter: str, readers: list) -> dict:
    """train_kernel.fit's arguments as the drafter's train stage passes them (its hyperparameters,
    the target's head), the draft vocab picked from `readers`."""
    d = params.drafter(drafter)
    hp = Keys(params).provenance("train", drafter)["params"]["train"]
    spec = spec_of(params)
    size = d["draft_vocab_size"]
    d2t, t2d = vocab_kernel.select(
        vocab_kernel.count_tokens(readers, readers[0].manifest["target"]["vocab_size"]), size
    )
    cfg = DrafterConfig.from_target(
        load_config(spec), size, readers[0].manifest["aux_layer_ids"]["sglang"]
    )
    embed, lm_head = load_head(spec)
    return {
        "readers": readers,
        "cfg": cfg,
        "tensors": {"embed": embed, "lm_head": lm_head, "d2t": d2t, "t2d": t2d},
        "hp": hp | {"heldout_fraction": d["heldout_fraction"]},
    }


def train_eaglet(a: dict, hp: dict, out: Path) -> dict:
    """eaglet's train stage on the demo's data and hyperparameters; its vLLM export."""
    t0 = time.perf_counter()
    hyper = TrainHyper.of(hp)
    st = train_kernel.fit(**a, hp=hyper, out=out / "trained", checkpoint_every=10**9, quiet=True)
    seconds = time.perf_counter() - t0
    model = load_drafter(out / "trained")
    return {"seconds": seconds, "stats": st, "model": model}


def export_eaglet(model, verifier: dict, out: Path) -> Path:
    folder = out / "vllm"
    folder.mkdir(parents=True, exist_ok=True)
    exports.write(model, "vllm", folder, verifier, 3)
    export_kernel.validate(folder, model)
    return folder


def serve_all(
    params, drafter: str, exports: dict[str, Path], threads: int, greedy_check: bool
) -> dict:
    """Plain greedy once (the reference text), then each drafter at the evaluate stage's
    fewest steps, on its prompts."""
    cfg = params.drafter(drafter)["evaluate"]
    spec = spec_of(params)
    folder = materialize(spec)
    tok = load_tokenizer(spec)
    readers = hidden_read.open_readers(hidden_read.states(params, drafter))
    # the first evaluate suite (the demo's: the natural held-out prompts)
    prompts = next(
        iter(suites.prompts(suites.configured(params, drafter), drafter, readers, tok, []).values())
    )
    stop = sorted(target_stop_ids(tok, folder))
    serve = ServeConfig(
        model=folder,
        served_name=spec.name,
        dtype=cfg["dtype"],
        max_model_len=params.target["max_length"],
        max_num_seqs=cfg["engine_concurrency"],
        enforce_eager=cfg["engine_eager"],
        threads=threads,
    )
    new, conc = cfg["max_new_tokens"], cfg["engine_concurrency"]
    steps = min(cfg["num_steps"])
    out: dict = {"prompts": len(prompts), "steps": steps}
    plain, greedy_tps = None, None
    if greedy_check:
        with Engine(serve) as engine:
            plain = evaluate_engine.run(engine, serve.served_name, prompts, new, stop, conc)
        greedy_tps = plain["tokens"] / plain["seconds"]
    for name, path in exports.items():
        spec_serve = dataclasses.replace(serve, speculative=speculative.eagle3(path, steps))
        with Engine(spec_serve) as e:
            r = evaluate_engine.run(e, serve.served_name, prompts, new, stop, conc)
        m = r["counters"].summary()
        if plain:
            same = [a == b for a, b in zip(r["outputs"], plain["outputs"], strict=True)]
            m.update(against_greedy(same, r["tokens"] / r["seconds"], greedy_tps))
        out[name] = m
        print(f"# {name}: {json.dumps(m)}", flush=True)
    return out


def engine_acceptance(keys: Keys, name: str) -> str:
    """vLLM's acceptance length of drafter `name` per suite and temperature (per num_steps),
    from its evaluate sidecar: `natural t=0 1.398; ...`."""
    sidecar = keys.sidecar("evaluate", name)
    ev = summary_of(read_json(sidecar)["stats"], str(sidecar))
    acc = []
    for suite, s in ev.suites.items():
        for t, v in s.vllm.items():
            acc.append(f"{suite} t={t:g} " + "/".join(f"{x:.3f}" for x in v.values()))
    return "; ".join(acc)
