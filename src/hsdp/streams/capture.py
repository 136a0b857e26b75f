"""CUDA graph capture of hsdp's streams (docs/design.md, "CUDA graphs").

A capture records hsdp's side-stream work into the graph only if those streams join the
capture, and CUDA ends a capture only once every joined stream's work has been joined
back into the stream that began it. ``CaptureScope`` (one per CUDA stream set) says which
capture is under way, so that:

- an event is marked with the capture it was recorded in (its ``epoch``; None: eager);
- inside a capture, a wait on an event recorded outside it is dropped: that work is
  complete, because a capture begins with the device idle (``torch.cuda.graph``
  synchronizes first), and CUDA refuses a dependency across the capture's boundary;
- outside a capture, a wait on an event recorded inside one becomes a wait on the
  compute stream: the graph's work runs where it is replayed, as one launch on that
  stream, whose order a fresh compute event carries;
- a side stream joins a capture at its first op in it (a wait on a compute event), and
  ``Streams.join`` makes compute wait for every joined side stream at the end of each of
  hsdp's captured regions (a backward, a forward without backward, an optimizer step);
- a host wait on an hsdp stream inside a capture raises ``CaptureError`` naming it.
"""

from __future__ import annotations


class CaptureError(RuntimeError):
    """Something hsdp cannot record into a CUDA graph; the message names it."""


def capture_refusal(what: str, instead: str) -> CaptureError:
    """The error for ``what``, which cannot run inside a CUDA graph capture."""
    return CaptureError(
        f"hsdp: {what} cannot be captured in a CUDA graph; {instead} (docs/guide/cuda_graphs.md)")


class CaptureScope:
    """Which capture hsdp's streams of one device are recorded into: ``epoch`` counts the
    captures hsdp has seen; ``active``: one is under way (as of the last ``sync``)."""

    def __init__(self) -> None:
        self.epoch = 0
        self.active = False
        self.origin: int | None = None  # the stream id that began the current capture

    @property
    def current(self) -> int | None:
        """The epoch events recorded now belong to (None: eager)."""
        return self.epoch if self.active else None

    def sync(self, capturing: bool, origin: int, still_joined: bool) -> bool:
        """Update from the compute stream's status (``origin``: its stream id;
        ``still_joined``: a side stream that joined the current capture is still in one,
        True if none joined yet). A capture on another stream, or one whose joined side
        streams left it, is a new capture. Returns ``capturing``."""
        if not capturing:
            self.active = False
        elif not self.active or origin != self.origin or not still_joined:
            self.epoch += 1
            self.active = True
            self.origin = origin
        return capturing
