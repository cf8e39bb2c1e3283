"""The models: the target as it ships, the EAGLE-3 drafter and its architecture, speculative
decoding, and training memory.
"""
