"""Shared vocabulary of kvserve: ids, token-block hashing, KV layout, wire messages.

Layer 1: imports nothing of the project and never imports torch, so the router can use it.
"""
