"""Checkpoints: state dicts, distributed save and load, their directories and integrity."""
