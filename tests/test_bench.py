"""The benchmark CLI: a real small run on a CPU world, and clear errors for bad flags."""

from __future__ import annotations

import json

import pytest

from dispatch import bench


def test_cpu_run_writes_results(tmp_path):
    assert bench.main(["--shape", "cpu-small", "--baselines", "none", "--world-size", "2", "--iters", "2", "--warmup", "1", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "roundtrip-cpu-small-w2.json").read_text())
    (row,) = result["rows"]
    assert row["name"] == "ours alltoall" and row["wrong"] == 0 and row["world_size"] == 2
    assert set(row["phases_ms"]) == set(bench.PHASES)
    assert row["bytes_out_per_rank"] > 0
    assert "| ours alltoall | 2 |" in (tmp_path / "roundtrip-cpu-small-w2.md").read_text()


@pytest.mark.parametrize(
    "argv, needle",
    [(["--iters", "0"], "--iters"), (["--warmup", "-1"], "--warmup"), (["--shape", "nope"], "--shape"),
     (["--world-size", "0"], "--world-size")],
)
def test_bad_flags(argv, needle, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.main(argv)
    assert exc.value.code == 2
    assert needle in capsys.readouterr().err


def test_experts_must_split_over_ranks(capsys):
    assert bench.main(["--world-size", "3", "--shape", "cpu-small"]) == 2
    assert "do not split" in capsys.readouterr().err


def test_wrong_rows_catches_a_planted_corruption(worlds):
    import rank_fns

    assert worlds(2).run(rank_fns.bench_wrong_rows, [(None,), ((1, 2),)]) == [1, 1]
    assert worlds(2).run(rank_fns.bench_wrong_rows, [(None,), (None,)]) == [0, 0]
