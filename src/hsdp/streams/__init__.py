"""Streams: the named-stream contract, its CUDA and CPU-thread backends, the op table (the
stream and communicator of every op) and teardown. Below ``sharding``."""
