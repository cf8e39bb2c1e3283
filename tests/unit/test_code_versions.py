"""Keys follow declared code versions, and the lock keeps the versions honest.

Each test that edits code does it in a copy of the package and computes keys and the guard in a
fresh interpreter that imports eaglet from that copy, so the edit is real source, parsed as the
user's clone would parse it.
"""

import ast

from eaglet.graph import code
from eaglet.graph.keys import STAGES

STAGE_NAMES = list(STAGES)


def test_the_lock_matches_the_code():
    """A kernel edited without a version bump (or a recorded `--same-bytes`) fails here."""
    problems = [s.problem() for s in code.states({n: s.module for n, s in STAGES.items()})]
    assert not any(problems), "\n".join(filter(None, problems))


def test_kernel_digests_ignore_wording_and_docs():
    digest = code._digest_of
    a = b'def f(x):\n    "doc"\n    if x < 0:\n        raise ValueError(f"bad {x}")\n    return x\n'
    b = b'def f(x):\n    print("hi")\n    if x < 0:\n        raise ValueError("no")\n    return x\n'
    c = b"def f(x):\n    if x < 0:\n        raise KeyError(x)\n    return x\n"
    d = b"def f(x):\n    if x <= 0:\n        raise ValueError(x)\n    return x\n"
    assert digest(a, "f", "a") == digest(b, "f", "b")
    assert digest(a, "f", "a") != digest(c, "f", "c")  # another exception is other behaviour
    assert digest(a, "f", "a") != digest(d, "f", "d")
    # the module-level constants a part reads are part of it; others are not
    e = b"LIMIT = 2\nOTHER = 1\ndef f(x):\n    return min(x, LIMIT)\n"
    assert digest(e, "f", "e") == digest(e.replace(b"OTHER = 1", b"OTHER = 9"), "f", "e")
    assert digest(e, "f", "e") != digest(e.replace(b"LIMIT = 2", b"LIMIT = 3"), "f", "e")


def test_code_digests_do_not_depend_on_the_interpreters_empty_fields():
    """What CPython 3.12 adds (`type_params=[]` on functions and classes) and 3.13 leaves out
    (empty fields) never reaches a digest: the same source, one text on every version."""
    tree = ast.parse("class A:\n    def f(self, x: int = 1) -> int:\n        return x + 1\n")
    text = code.stable_dump(tree)
    fn = tree.body[0].body[0]
    fn.type_params = []  # as 3.12's parser builds it
    fn._fields = (*fn._fields, "type_params")
    assert code.stable_dump(tree) == text
    assert "type_params" not in text and "=[]" not in text and "=None" not in text
    assert text == code.stable_dump(ast.parse(ast.unparse(tree)))  # formatting plays no part


def test_compare_names_a_code_version_change():
    from eaglet.reports.compare import _changed

    old = {"params": {"seed": 0}, "code_key": "a1b2"}  # written before declared versions
    v1 = {"params": {"seed": 0}, "code_version": 1}
    assert _changed(old, v1) == ["code version: a1b2 -> 1"]
    assert _changed(v1, v1 | {"code_version": 2}) == ["code version: 1 -> 2"]
    assert _changed(v1, v1) == []
