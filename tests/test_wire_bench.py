"""bench/wire.py's CPU smoke mode: a real small run, and clear errors for bad flags."""

from __future__ import annotations

import json

import pytest

from bench_scripts import load
from world import bench_world_of

wire = load("wire")


@bench_world_of(2)
def test_cpu_smoke_run_writes_results(tmp_path):
    argv = ["--shapes", "cpu-small", "--world-size", "2", "--iters", "1", "--warmup", "1", "--out", str(tmp_path)]
    assert wire.main(argv) == 0
    result = json.loads((tmp_path / "wire-w2.json").read_text())
    assert [(r["shape"], r["wire"]) for r in result["rows"]] == [("cpu-small", "bf16"), ("cpu-small", "fp8")]
    for row in result["rows"]:
        assert row["wrong"] == 0 and set(row["times_ms"]) == set(wire.TIMES)
    (summary,) = result["summary"]
    assert summary["bytes_ratio"] <= 0.52
    assert "| cpu-small | fp8 | 2 |" in (tmp_path / "wire-w2.md").read_text()


@pytest.mark.parametrize("argv, needle", [(["--shapes", "nope"], "--shapes"), (["--iters", "0"], "--iters")])
def test_bad_flags(argv, needle, capsys):
    with pytest.raises(SystemExit) as exc:
        wire.main(argv)
    assert exc.value.code == 2 and needle in capsys.readouterr().err
