"""drafters.<d>.dflash resolved for the train key (method: dflash): every field explicit, each
bad value one line naming the field. Imports no torch (keys are computed without it)."""

from __future__ import annotations

from eaglet.errors import EagletError

DEFAULTS = {"block_size": 8, "num_layers": 1, "anchors": 512, "gamma": 4.0}


def resolve(section: dict, text: dict, stored: list[int], field: str, target_where: str) -> dict:
    """The dflash section with defaults, checked against the target's text config and the
    layers the hidden stage stores (`stored`, 0-based outputs of decoder layers, ascending as
    the store keeps them). `field`: e.g. "params.yaml: drafters.d.dflash"."""
    out = DEFAULTS | dict(section)
    if out["block_size"] < 2:
        raise EagletError(
            f"{field}.block_size: {out['block_size']}; a block is the anchor token and at "
            "least one mask (2 or more)"
        )
    n = text["num_hidden_layers"]
    ids = list(out.get("target_layer_ids") or stored)
    bad = [i for i in ids if not 0 <= i < n]
    if bad:
        raise EagletError(
            f"{field}.target_layer_ids: {bad} out of range for a target of {n} layers "
            f"({target_where}: num_hidden_layers; ids are 0-based layer outputs: 0 .. {n - 1})"
        )
    missing = [i for i in ids if i not in stored]
    if missing:
        raise EagletError(
            f"{field}.target_layer_ids: {missing} not stored by the hidden stage (it stores "
            f"{stored}: hidden.aux_layer_ids in SGLang's numbering)"
        )
    out["target_layer_ids"] = sorted(ids)  # fc reads them in ascending layer order
    out["num_target_layers"] = n
    mask = out.get("mask_token_id")
    if mask is None:
        raise EagletError(
            f"{field}.mask_token_id: required with method dflash (a token id the target never "
            "emits, e.g. an unused special token; not eos or pad)"
        )
    vocab = text["vocab_size"]
    if mask >= vocab:
        raise EagletError(f"{field}.mask_token_id: {mask}; the target's vocab is 0 .. {vocab - 1}")
    emitted = {k: text.get(k) for k in ("eos_token_id", "pad_token_id", "bos_token_id")}
    for name, value in emitted.items():
        if mask == value or (isinstance(value, list) and mask in value):
            raise EagletError(
                f"{field}.mask_token_id: {mask} is the target's {name} ({target_where}): "
                "the target emits it; pick a token it never emits"
            )
    return out
