"""Simulate hsdp training steps without a GPU: the runtime's own schedule on virtual
streams (``engine``), priced by a cost model (``costs``)."""
