"""Result tables for the command line: rich when importable, plain text otherwise."""

from __future__ import annotations

from collections.abc import Sequence


def print_table(title: str, headers: Sequence[str], rows: Sequence[Sequence[str]],
                notes: Sequence[str] = ()) -> None:
    """Right-aligned columns, ``notes`` under the table."""
    try:
        from rich.console import Console
        from rich.markup import escape
        from rich.table import Table
    except ImportError:
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
        print(title)
        for line in [headers, *rows]:
            print("  ".join(c.rjust(w) for c, w in zip(line, widths, strict=True)))
        if notes:
            print("\n".join(notes))
        return
    table = Table(title=escape(title), caption=escape("\n".join(notes)) if notes else None)
    for h in headers:
        table.add_column(h, justify="right", no_wrap=True)
    for r in rows:
        table.add_row(*map(escape, r))
    console = Console()
    if not console.is_terminal:  # logs and pipes: rich would cut the table at 80 columns
        console.width = 200
    console.print(table)
