"""hsdp command line: ``python -m hsdp <command> ...`` (benchmarks, simulator, demo).

The commands are tools beside the library; ``python -m hsdp`` and the ``hsdp`` console
script both run :func:`main`."""

from __future__ import annotations

import argparse
import importlib
import sys

# Registration point: one line per subcommand, its words -> the module implementing it.
# That module defines ``add_arguments(parser)`` and ``run(args) -> int``; the first line
# of its docstring is the help text. To add ``bench step`` or ``demo``, write the module
# and add ``("bench", "step"): "hsdp_tools.bench.step"`` or ``("demo",): "hsdp_tools.demo"`` here.
# Options are never abbreviated (allow_abbrev=False in every parser): a prefix that is
# one option today (``--out``) becomes ambiguous, or another option, once one is added.
COMMANDS: dict[tuple[str, ...], str] = {
    ("advise",): "hsdp_tools.advisor",
    ("bench", "ckpt"): "hsdp_tools.bench.ckpt",
    ("bench", "collectives"): "hsdp_tools.bench.collectives",
    ("bench", "diloco"): "hsdp_tools.bench.diloco",
    ("bench", "quant"): "hsdp_tools.bench.quant",
    ("bench", "step"): "hsdp_tools.bench.step",
    ("bench", "suite"): "hsdp_tools.bench.suite",
    ("demo",): "hsdp_tools.demo",
    ("sim",): "hsdp_tools.sim.cli",
}


def build_parser(commands: dict[tuple[str, ...], str] = COMMANDS) -> argparse.ArgumentParser:
    """The ``hsdp`` parser, with one (nested) subcommand per entry of ``commands``."""
    parser = argparse.ArgumentParser(prog="hsdp", description=__doc__, allow_abbrev=False)
    groups = {(): parser.add_subparsers(dest="command", metavar="COMMAND", required=True)}

    def group(words: tuple[str, ...]) -> argparse._SubParsersAction:
        if words not in groups:
            p = group(words[:-1]).add_parser(words[-1], help=f"{' '.join(words)} commands",
                                             allow_abbrev=False)
            groups[words] = p.add_subparsers(dest=" ".join(words), metavar="COMMAND",
                                             required=True)
        return groups[words]

    for words, module_name in commands.items():
        module = importlib.import_module(module_name)
        doc = module.__doc__ or ""
        p = group(words[:-1]).add_parser(
            words[-1], help=doc.strip().split("\n")[0], description=doc,
            formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
        module.add_arguments(p)
        p.set_defaults(run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
