"""Torch-free model metadata: where a model lives, its config, tokenizer and chat template.

Layer 1 beside protocol/: both the router (no torch) and the engine use it.
"""
