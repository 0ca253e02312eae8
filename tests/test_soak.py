"""bench/soak.py on a CPU world: every row of every call checked, none wrong."""

from __future__ import annotations

import json

from bench_scripts import load
from world import bench_world_of


@bench_world_of(2)
def test_soak_checks_every_call(tmp_path):
    soak = load("soak")
    assert soak.main(["--calls", "12", "--world-size", "2", "--max-tokens", "40", "--hidden", "136",
                      "--transports", "nccl", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "soak-w2.json").read_text())
    (row,) = result["rows"]
    assert row["transport"] == "nccl" and row["calls"] == 12
    assert row["rows_checked"] > 0 and row["wrong_rows"] == 0


def test_soak_draws_every_routing_and_wire():
    soak = load("soak")
    args = soak.parse_args(["--calls", "60", "--world-size", "2"])
    plans = [soak.draw(call, args, 2) for call in range(60)]
    assert {p["routing"] for p in plans} == set(soak.ROUTINGS)
    assert {p["wire"] for p in plans} == set(soak.WIRES)
    assert any(0 in p["tokens"] for p in plans)
