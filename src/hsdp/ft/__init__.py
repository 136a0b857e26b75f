"""Fault tolerance: the outer axis as torchft replica groups (``init_mesh(...,
fault_tolerance=...)``). ``outer``: the managed outer communicator and each rank's torchft
Manager; ``transport``: how a recovering group receives a live one's state, all or nothing;
``errors``: ``FaultToleranceError``. What it receives: ``checkpoint/replica_state.py``."""
