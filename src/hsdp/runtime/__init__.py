"""The runtime: streams, hooks, the overlap schedule, recovery and optimizer integration."""
