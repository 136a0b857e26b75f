"""The ``python -m hsdp`` dispatcher: nested subcommands from one registration line each."""

import argparse
import sys
import types

import pytest

from hsdp_tools.cli import COMMANDS, build_parser, main


def test_bench_collectives_is_registered():
    assert ("bench", "collectives") in COMMANDS
    args = build_parser().parse_args(["bench", "collectives", "--mesh", "2x2",
                                      "--sizes", "64KiB,1MiB"])
    assert args.mesh == (2, 2) and args.sizes == [64 << 10, 1 << 20]


def test_adding_a_command_is_one_entry(monkeypatch):
    demo = types.ModuleType("fake_demo")
    demo.__doc__ = "A fake demo.\n\nMore text."
    demo.add_arguments = lambda p: p.add_argument("--steps", type=int, default=1)
    demo.run = lambda args: 40 + args.steps
    monkeypatch.setitem(sys.modules, "fake_demo", demo)
    commands = {**COMMANDS, ("demo",): "fake_demo", ("bench", "step"): "fake_demo"}
    parser = build_parser(commands)
    for argv in (["demo", "--steps", "2"], ["bench", "step", "--steps", "2"]):
        args = parser.parse_args(argv)
        assert args.run(args) == 42


def test_missing_subcommand_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench"])
    assert e.value.code == 2


def _parsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """``parser`` and every subcommand parser below it."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return [parser, *(q for a in subs for p in dict.fromkeys(a.choices.values())
                      for q in _parsers(p))]


def test_no_parser_takes_abbreviated_options():
    """Every parser of ``python -m hsdp`` refuses option prefixes (``--out`` once matched
    three ``--outer-*`` options of ``hsdp sim`` and failed ``sim calibrate ... --out``)."""
    parsers = _parsers(build_parser())
    assert len(parsers) > len(COMMANDS), len(parsers)
    assert [p.prog for p in parsers if p.allow_abbrev] == []


def test_sim_calibrate_takes_its_documented_options():
    """docs/guide/tools.md: ``sim calibrate s.json --collectives c.json --machine h200x2
    --out p.json``."""
    args = build_parser().parse_args(["sim", "calibrate", "s.json", "--collectives", "c.json",
                                      "--machine", "h200x2", "--out", "p.json"])
    assert (args.step, args.collectives, args.machine, args.out) == (
        "s.json", ["c.json"], "h200x2", "p.json")
