"""Serving engines eaglet drives as separate processes (vLLM), started and always stopped here."""
