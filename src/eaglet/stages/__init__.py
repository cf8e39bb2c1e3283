"""The pipeline's stages, one package each (prompts, responses, hidden, vocab, train, evaluate,
export), the same four files in every one: `__init__` (CODE: the version and the kernel),
`spec.py` (the typed spec, torch-free), `kernel.py` (what decides the bytes), `run.py` (set-up,
engines, progress); other files are named for what they are.
"""
