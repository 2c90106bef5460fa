"""Model implementations over a flat token batch; engine/models/registry.py picks one."""
