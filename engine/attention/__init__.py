"""Attention backends behind one interface (engine/attention/base.py), registered by name."""
