"""The bytes eaglet reads and writes: dataset adapters and readers, records, chat rendering,
the response store, the hidden-states format, canonical JSON and atomic writes.
"""
