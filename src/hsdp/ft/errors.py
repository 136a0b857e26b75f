"""The error of hsdp's fault tolerance (imports nothing: the runtime lets it through)."""


class FaultToleranceError(RuntimeError):
    """Fault tolerance cannot be set up or used as asked, or a recovery cannot be trusted."""
