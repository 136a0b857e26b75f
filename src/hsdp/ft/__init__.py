"""Fault tolerance: the outer axis as torchft replica groups (``init_mesh(...,
fault_tolerance=...)``). ``outer``: the managed outer communicator and each rank's torchft
Manager (imports nothing of hsdp); ``replica_state``: what a recovering group receives."""
