"""What ``bench`` and ``sim`` share to report a step: metrics, tables, timelines, CLI types."""
