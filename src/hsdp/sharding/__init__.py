"""Sharding: flat layouts, parameter groups, their DTensor pieces and the real collectives."""
