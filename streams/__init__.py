"""Ingest: open, decode, reconnect and pace live sources, hand frames to the pool."""
