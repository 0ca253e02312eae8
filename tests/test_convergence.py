"""A short convergence check: the same small MoE model trained with a bf16 wire and
an fp8 wire (fp8 dispatch, e5m2 gradients to the experts, bf16 sums) on a gloo
world of 2 ranks ends within 2 percent. The long version is
``python3 bench/convergence.py`` (plot under bench/results/cpu/)."""

from __future__ import annotations

import math

from bench_scripts import load

convergence = load("convergence")


def test_fp8_wire_trains_like_bf16():
    args = convergence.parse_args(["--steps", "120", "--batch", "64", "--tail", "20", "--world-size", "2"])
    result = convergence.run(args)
    chance = math.log(convergence.CLASSES)  # cross-entropy of guessing uniformly
    for wire in ("bf16", "fp8"):
        assert result["final"][wire] < 0.8 * chance, f"{wire}: the model did not learn"
    assert result["relative_gap"]["fp8"] <= 0.02, result["final"]
    assert result["losses"]["bf16"] != result["losses"]["fp8"], "the fp8 run should not be the bf16 run"


def test_bad_flags_are_refused(capsys):
    import pytest

    for argv, needle in [(["--wires", "fp4"], "--wires"), (["--experts", "6", "--world-size", "4"], "--experts")]:
        with pytest.raises(SystemExit):
            convergence.parse_args(argv)
        assert needle in capsys.readouterr().err
