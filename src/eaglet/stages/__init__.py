"""The pipeline's stages, one module each (prompts, generate = responses, hidden, vocab,
train, evaluate, export), with the helpers only their stage uses beside them.
"""
