"""The ``python -m hsdp`` dispatcher: nested subcommands from one registration line each."""

import sys
import types

import pytest

from hsdp.__main__ import COMMANDS, build_parser, main


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
