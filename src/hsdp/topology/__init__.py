"""Topology: where the ranks run, the (outer, inner[, tp]) mesh and its communicators, and
the ranks' agreement on what to build. Imports only ``hsdp.ft``."""
