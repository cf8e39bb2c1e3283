"""The bytes eaglet reads and writes: dataset adapters and readers, records, chat rendering,
the response store, the hidden-states format, the drafters' and the serving folders, canonical
JSON. Every write goes through eaglet.atomic.
"""
