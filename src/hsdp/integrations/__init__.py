"""Adapters that make other training frameworks use hsdp (optional extras)."""
