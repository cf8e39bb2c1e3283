"""The build graph's keys: every artifact's content key and keyed path (what made it: the
stage's resolved inputs, its code, its upstream keys), the artifacts on disk, and what a target
weighs (a key input: where evaluation runs).
"""
