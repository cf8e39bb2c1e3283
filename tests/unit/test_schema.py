"""params.schema.yaml documents itself: every property it declares has a `description`."""

import copy

import pytest

from eaglet.params import schema

# Subschemas that only test a value (`if: {properties: {kind: {const: vllm}}}`) declare nothing.
CONDITIONS = ("if", "not")
BRANCHES = ("allOf", "anyOf", "oneOf")


def _described(node: dict) -> bool:
    text = node.get("description") if isinstance(node, dict) else None
    return isinstance(text, str) and bool(text.strip())


def properties(node, path: str = "", declared: frozenset = frozenset()):
    """(path, property schema, described) of every property under `node`, at any depth.

    A property of an `if`/`then` branch (under allOf/anyOf/oneOf) that the enclosing object
    already declares and describes, such as a backend's `kind: true`, needs no description of
    its own; any other one does, a `true` included."""
    if not isinstance(node, dict):
        return
    props = node.get("properties", {})
    here = frozenset(n for n, s in props.items() if _described(s))
    for key, value in node.items():
        if key in CONDITIONS:
            continue
        if key == "properties":
            for name, sub in value.items():
                where = f"{path}.{name}" if path else name
                yield where, sub, _described(sub) or name in declared
                yield from properties(sub, where)
        elif key in BRANCHES:
            for i, sub in enumerate(value):
                yield from properties(sub, f"{path}[{key}{i}]", declared | here)
        elif key in ("then", "else"):
            yield from properties(value, path, declared | here)
        elif key == "$defs":
            for name, sub in value.items():
                yield from properties(sub, f"$defs.{name}")
        elif key == "additionalProperties":
            yield from properties(value, f"{path}.*")
        elif isinstance(value, dict):  # items, propertyNames, ...
            yield from properties(value, f"{path}.{key}")


def undescribed(root: dict) -> list[str]:
    missing = [path for path, _, ok in properties(root) if not ok]
    missing += [f"$defs.{n}" for n, d in root.get("$defs", {}).items() if not _described(d)]
    return missing


def test_every_property_has_a_description():
    assert undescribed(schema()) == []
    # the walk reaches every level: backends' if/then, datasets' entries, YaRN inside oneOf
    paths = {path for path, _, _ in properties(schema())}
    assert len(paths) > 150
    for deep in (
        "$defs.backend[allOf3].price_per_mtok.completion",
        "datasets.*.expect.turns",
        "drafters.*.arch.rope_scaling[oneOf1].mscale",
        "drafters.*.evaluate.suites.*.prompts",
        "plan.rates.*.requests_per_s",
    ):
        assert deep in paths


@pytest.mark.parametrize(
    "where",
    [
        ("properties", "target", "properties", "revision"),
        ("$defs", "positive_int"),
        ("$defs", "backend", "allOf", 1, "then", "properties", "url"),
        ("$defs", "backend", "properties", "kind"),  # then its `kind: true` are undescribed
        ("properties", "datasets", "additionalProperties", "properties", "expect"),
        (
            "properties",
            "drafters",
            "additionalProperties",
            "properties",
            "arch",
            "properties",
            "rope_scaling",
            "oneOf",
            1,
            "properties",
            "beta_fast",
        ),
    ],
)
def test_a_removed_description_is_caught(where):
    root = copy.deepcopy(schema())
    node = root
    for part in where:
        node = node[part]
    del node["description"]
    assert undescribed(root)
