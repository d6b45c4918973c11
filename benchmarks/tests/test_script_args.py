"""The standalone benchmark scripts' shared ``--scale``, ``--repeats``, ``--norm-type`` and
``--workload`` checks."""

from __future__ import annotations

import argparse

import pytest

from clipbench.benchmarks.script_args import (add_norm_type, add_scale_and_repeats,
                                               add_workloads_and_scale, check_norm_type,
                                               check_scale_and_repeats, checked_workloads)


def _parse(argv):
  parser = argparse.ArgumentParser(prog="script")
  add_scale_and_repeats(parser, scale=0.5, repeats=3, scale_help="scale", repeats_help="calls")
  args = parser.parse_args(argv)
  check_scale_and_repeats(parser, args)
  return args


def test_defaults_and_valid_values_pass():
  args = _parse([])
  assert (args.scale, args.repeats) == (0.5, 3)
  args = _parse(["--scale", "1", "--repeats", "1"])
  assert (args.scale, args.repeats) == (1.0, 1)


@pytest.mark.parametrize("argv,message", [
    (["--scale", "0"], "--scale: expected a fraction in (0, 1], got 0.0"),
    (["--scale", "1.5"], "--scale: expected a fraction in (0, 1], got 1.5"),
    (["--scale", "nan"], "--scale: expected a fraction in (0, 1], got nan"),
    (["--repeats", "0"], "--repeats: expected at least 1, got 0")])
def test_bad_values_exit_naming_the_argument(capsys, argv, message):
  with pytest.raises(SystemExit) as exited:
    _parse(argv)
  assert exited.value.code == 2
  assert message in capsys.readouterr().err


def _parse_norm_type(argv, default):
  parser = argparse.ArgumentParser(prog="script")
  add_norm_type(parser, default, "default: the workload's")
  args = parser.parse_args(argv)
  check_norm_type(parser, args)
  return args.norm_type


@pytest.mark.parametrize("argv,default,want", [
    ([], None, None), ([], 2.0, 2.0), (["--norm-type", "2.5"], None, 2.5),
    (["--norm-type", "1"], 2.0, 1.0), (["--norm-type=-inf"], None, float("-inf")),
    (["--norm-type", "inf"], None, float("inf"))])
def test_norms_pass(argv, default, want):
  assert _parse_norm_type(argv, default) == want


@pytest.mark.parametrize("value", ["0.5", "-2", "nan"])
def test_what_is_not_a_norm_exits_naming_the_argument(capsys, value):
  with pytest.raises(SystemExit) as exited:
    _parse_norm_type(["--norm-type", value], 2.0)
  assert exited.value.code == 2
  assert f"--norm-type: expected at least 1, inf or -inf, got {float(value)}" in (
      capsys.readouterr().err)


def _workloads(argv):
  parser = argparse.ArgumentParser(prog="script")
  add_workloads_and_scale(parser, ("W2-relax", "W1-model"))
  args = parser.parse_args(argv)
  return checked_workloads(parser, args, ("W2-relax", "W1-model")), args.scale


def test_workloads_default_or_as_asked():
  assert _workloads([]) == (["W2-relax", "W1-model"], 1.0)
  assert _workloads(["--workload", "W4-many-small", "--scale", "0.5"]) == (["W4-many-small"], 0.5)


@pytest.mark.parametrize("argv,message", [
    (["--workload", "W9"], "unknown workload 'W9'"),
    (["--scale", "2"], "--scale: expected a fraction in (0, 1], got 2.0")])
def test_an_unknown_workload_or_a_bad_scale_exits_naming_it(capsys, argv, message):
  with pytest.raises(SystemExit) as exited:
    _workloads(argv)
  assert exited.value.code == 2
  assert message in capsys.readouterr().err

