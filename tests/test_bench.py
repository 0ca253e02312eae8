"""The benchmark harness: real small runs on CPU worlds, table columns and units,
byte accounting against hand-computed cases, the #wrong check, CLI errors."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest
import torch

from dispatch import bench
from dispatch.bench import a2a, common, roundtrip
from world import bench_world_of

world_of_two = bench_world_of(2)


@world_of_two
def test_dispatch_run_writes_results(tmp_path):
    argv = ["dispatch", "--shapes", "cpu-small", "--routings", "uniform,one-rank", "--variants", "alltoall", "--wires", "native", "--baselines", "none",
            "--transports", "nccl", "--world-size", "2", "--iters", "3", "--warmup", "1", "--out", str(tmp_path)]
    assert bench.main(argv) == 0
    result = json.loads((tmp_path / "dispatch-w2.json").read_text())
    assert [r["routing"] for r in result["rows"]] == ["uniform", "one-rank"]
    for row in result["rows"]:
        assert row["name"] == "ours alltoall" and row["wrong"] == 0 and row["world_size"] == 2
        assert set(row["phases_ms"]) == set(roundtrip.PHASES)
        rt = row["round_trip_ms"]
        assert 0 < rt["p10"] <= rt["median"] <= rt["p90"]
        marked = row["round_trip_marked_ms"]  # (the runs with the phase marks; the round trip: those without)
        parts = row["dispatch_ms"]["median"] + row["combine_ms"]["median"]
        assert parts == pytest.approx(marked["median"], rel=0.5)  # medians of parts, not of the sum
        assert row["dispatch_bytes_out"] > 0 and row["deepep_dispatch_gbps"] > 0
    markdown = (tmp_path / "dispatch-w2.md").read_text()
    assert "| cpu-small | uniform | ours alltoall |" in markdown and "commit" in markdown


@world_of_two
def test_dispatch_runs_under_no_grad(tmp_path):
    """--no-grad: every row under torch.no_grad (inference), said in the results."""
    argv = ["dispatch", "--shapes", "cpu-decode", "--routings", "uniform", "--variants", "alltoall", "--wires",
            "native", "--baselines", "none", "--transports", "nccl", "--world-size", "2", "--iters", "2",
            "--warmup", "1", "--no-grad", "--out", str(tmp_path)]
    assert bench.main(argv) == 0
    result = json.loads((tmp_path / "dispatch-w2.json").read_text())
    assert result["grad"] is False and [r["wrong"] for r in result["rows"]] == [0]
    assert "under torch.no_grad" in (tmp_path / "dispatch-w2.md").read_text().splitlines()[0]


@world_of_two
def test_auto_is_timed_in_turns_against_the_fastest_of_its_wire(tmp_path):
    argv = ["dispatch", "--shapes", "cpu-decode", "--routings", "uniform", "--variants", "alltoall,allgather,auto",
            "--wires", "native", "--baselines", "none", "--transports", "nccl", "--world-size", "2", "--iters", "3",
            "--warmup", "1", "--out", str(tmp_path)]
    assert bench.main(argv) == 0
    rows = json.loads((tmp_path / "dispatch-w2.json").read_text())["rows"]
    auto = [r for r in rows if r["variant"] == "auto"]
    assert len(auto) == 1 and all("in_turns" not in r for r in rows if r["variant"] != "auto")
    turns = auto[0]["in_turns"]
    assert set(turns["median_ms"]) == {r["name"] for r in rows}
    assert turns["fastest"] == min(("ours alltoall", "ours allgather"), key=turns["median_ms"].__getitem__)
    assert turns["ratio"] == pytest.approx(turns["median_ms"][auto[0]["name"]] / turns["median_ms"][turns["fastest"]])
    assert f"{turns['ratio']:.2f}x {turns['fastest'].removeprefix('ours ')}" in roundtrip.summary(rows)


@world_of_two
def test_a2a_run_columns_units_and_bandwidth(tmp_path):
    argv = ["a2a", "--world-size", "2", "--min-bytes", "1K", "--max-bytes", "16K", "--iters", "2",
            "--warmup", "1", "--out", str(tmp_path)]
    assert bench.main(argv) == 0
    result = json.loads((tmp_path / "a2a-w2.json").read_text())
    for transport in ("nccl", "ours"):
        picked = [r for r in result["rows"] if r["transport"] == transport]
        assert [r["size"] for r in picked] == [1024, 2048, 4096, 8192, 16384], transport
    for r in result["rows"]:
        assert r["wrong"] == 0
        assert r["algbw_gbps"] == pytest.approx(r["wire_bytes"] / (r["time_us"] * 1e-6) / 1e9)
        assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"] * (2 - 1) / 2)
    header, units = a2a.table(result["rows"], "ours").splitlines()[:2]
    assert header.split() == ["size", "count", "type", "time", "algbw", "busbw", "effective", "#wrong"]
    assert units.split() == ["(B)", "(elements)", "(us)", "(GB/s)", "(GB/s)", "(GB/s)"]
    assert "Avg bus bandwidth" in a2a.table(result["rows"], "ours")


@world_of_two
def test_main_job_output_has_no_warnings(tmp_path):
    """``dispatch-bench`` with no command (dispatch comparison + a2a sweep), as a
    user runs it, on 2 CPU processes: it succeeds and prints no warning (a
    FutureWarning of a deprecated collective, a UserWarning of a barrier without
    a device, ...), from the parent process or any rank."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    run = subprocess.run(
        [sys.executable, "-m", "dispatch.bench", "--world-size", "2", "--iters", "1", "--warmup", "0",
         "--out", str(tmp_path)],
        cwd=root, capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    output = run.stdout + run.stderr
    assert "Warning" not in output, [line for line in output.splitlines() if "Warning" in line]
    assert (tmp_path / "report.md").stat().st_size > 0


def test_spread_is_nearest_rank():
    stats = common.spread([float(v) for v in range(1, 21)])
    assert (stats["p10"], stats["median"], stats["p90"]) == (2.0, 10.5, 18.0)


@pytest.mark.parametrize("variant", ["alltoall", "hierarchical"])
@pytest.mark.parametrize("local_world_size", [1, 2])
def test_byte_accounting_hand_computed(worlds, variant, local_world_size):
    """W=2, E=4, H=8, fp32 rows of 32 bytes. Rank 0: t0 -> experts {0, 2} (one row to
    rank 1), t1 -> {2, 3} (both on rank 1: one row), t2 -> {1} (local). Rank 1:
    t0 -> {0, 1} (one row to rank 0), t1 -> {3, 2} (local). Rows out: 2 and 1, and
    as many partial sums back: 1 and 2; rows received, own included: 3 and 3.
    One node of two ranks: all of it intra-node; two nodes of one: inter-node."""
    import rank_fns

    idx0 = [[0, 2], [2, 3], [1, -1]]
    idx1 = [[0, 1], [3, 2]]
    config = dict(num_experts=4, variant=variant, local_world_size=local_world_size)
    got = worlds(2).run(rank_fns.bench_traffic, [(idx0, config, 8), (idx1, config, 8)])
    tier, other = ("intra", "inter") if local_world_size == 2 else ("inter", "intra")
    for traffic in got:
        assert traffic["dispatch_bytes_out"] == traffic["combine_bytes_out"] == 1.5 * 32
        assert traffic[f"dispatch_{tier}_bytes"] == traffic[f"combine_{tier}_bytes"] == 1.5 * 32
        assert traffic[f"dispatch_{other}_bytes"] == traffic[f"combine_{other}_bytes"] == 0
        assert traffic[f"dispatch_{tier}_rows"] == 1.5
        assert traffic["dispatch_bytes_received"] == 3 * 32


def test_wrong_rows_catches_a_planted_corruption(worlds):
    import rank_fns

    assert worlds(2).run(rank_fns.bench_wrong_rows, [(None,), ((1, 2),)]) == [1, 1]
    assert worlds(2).run(rank_fns.bench_wrong_rows, [(None,), (None,)]) == [0, 0]
    # a weight on the other slot of its token, and experts that do not tell themselves apart: seen too
    assert worlds(2).run(rank_fns.bench_wrong_rows, [("swapped",), (None,)]) == [1, 1]
    assert worlds(2).run(rank_fns.bench_wrong_rows, [("identity",), (None,)]) == [4, 4]


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--iters", "0"], "--iters"),
        (["--warmup", "-1"], "--warmup"),
        (["--world-size", "0"], "--world-size"),
        (["dispatch", "--shapes", "nope"], "--shapes"),
        (["dispatch", "--routings", "sideways"], "--routings"),
        (["dispatch", "--variants", "carrier-pigeon"], "--variants"),
        (["dispatch", "--wires", "fp4"], "--wires"),
        (["a2a", "--max-bytes", "lots"], "--max-bytes"),
        (["a2a", "--min-bytes", "4K", "--max-bytes", "1K"], "--min-bytes"),
        (["a2a", "--wires", "fp4"], "--wires"),
        (["sideways"], "invalid choice"),
        (["--iters", "0", "overlap"], "--iters"),  # a study parses the global flags before its name
    ],
)
def test_bad_flags(argv, needle, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.main(argv)
    assert exc.value.code == 2
    assert needle in capsys.readouterr().err


def test_experts_must_split_over_ranks(capsys):
    assert bench.main(["dispatch", "--world-size", "3", "--shapes", "cpu-small"]) == 2
    assert "do not split" in capsys.readouterr().err


def test_main_job_defaults_cover_both_benchmarks():
    args = bench.parse_args([])
    assert args.command is None

    on_gpus = torch.cuda.is_available()
    assert args.shapes == list(common.GPU_SHAPES if on_gpus else common.CPU_SHAPES)
    assert args.routings == list(roundtrip.ROUTINGS)
    assert args.max_bytes == (1 << 30 if on_gpus else 4 << 20) and args.iters >= 20


def test_group_dedup_study_counts_what_it_models():
    """bench/group_dedup.py: the modelled rows per group exchange match a sampled
    routing's, one group costs nothing, and more groups cost more."""
    from bench_scripts import load

    study = load("group_dedup")
    assert study.hit(8, 2, 8) == 1.0 and study.hit(8, 2, 0) == 0.0
    for tokens, experts, topk, world in ((4096, 64, 4, 2), (4096, 16, 2, 4)):
        base = study.sampled_rows(tokens, experts, topk, world, 1, seed=3)
        assert abs(base / (tokens * (world - 1) * study.hit(experts, topk, experts // world)) - 1) < 0.03
        for groups in (2, 4):
            modelled = tokens * (world - 1) * groups * study.hit(experts, topk, experts // world // groups)
            assert abs(study.sampled_rows(tokens, experts, topk, world, groups, seed=3) / modelled - 1) < 0.03
    table = study.rows(argparse.Namespace(worlds=[2], groups=[1, 2, 4]))
    deepseek = [r["ratio"] for r in table if r["shape"] == "deepseek-v3"]
    assert deepseek[0] == 1.0 and deepseek[0] < deepseek[1] < deepseek[2]


@world_of_two
@pytest.mark.parametrize("teardown", [True, False])
def test_launch_leaves_with_and_without_teardown(teardown):
    """Every rank runs the job and the launcher returns 0, whether the ranks destroy
    the process group (teardown) or leave without (a job whose NCCL collectives sit in
    CUDA graphs): two gloo processes, each printing its job's argument."""
    code = ("import sys; from dispatch.bench.common import launch; "
            f"sys.exit(launch(print, 'job ran', 2, teardown={teardown}))")
    # buffered output, as a pipe gets it: what the ranks printed must still come out
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "WORLD_SIZE", "RANK", "PYTHONUNBUFFERED")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("job ran") == 2, done.stdout


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="runs the probe itself on 2 or more GPUs")
def test_concurrency_probe_refuses_without_two_gpus(capsys):
    """bench/concurrency_probe.py needs two GPUs: without them it says so and exits 2,
    before it starts a process."""
    from bench_scripts import load

    assert load("concurrency_probe").main(["--shapes", "deepseek-v3"]) == 2
    assert "needs 2 or more GPUs" in capsys.readouterr().err


def test_deepep_rows_sit_beside_their_pair_of_ours():
    """Each DeepEP row goes right after its pair of ours among its shape and
    routing's rows (eager beside our eager engine row, its cached layout beside
    our captured one), both labelled, and the tables gain the pair's column and
    its note; a DeepEP row whose pair did not run goes last, unlabelled."""
    def row(name, routing="uniform"):
        stats = {"median": 1.0, "p10": 0.9, "p90": 1.1}
        return {"name": name, "routing": routing, "shape": {"name": "decode"}, "round_trip_ms": stats,
                "dispatch_ms": stats, "combine_ms": stats, "wrong": 0, "phases_ms": {}}

    rows = [row("ours alltoall/nccl", "zipf"), row("ours alltoall/nccl"), row("ours alltoall/nvlink"),
            row("ours alltoall/nvlink graph"), row("megatron alltoall")]
    start = 1  # the uniform routing's rows: the zipf row before them is another routing's
    roundtrip._beside_its_pair(rows, start, row(roundtrip.DEEPEP_EAGER))
    roundtrip._beside_its_pair(rows, start, row(roundtrip.DEEPEP_CACHED))
    names = [r["name"] for r in rows]
    assert names == ["ours alltoall/nccl", "ours alltoall/nccl", "ours alltoall/nvlink", roundtrip.DEEPEP_EAGER,
                     "ours alltoall/nvlink graph", roundtrip.DEEPEP_CACHED, "megatron alltoall"]
    assert [r.get("pair") for r in rows] == [None, None, "eager", "eager", "captured", "captured", None]
    table = roundtrip.markdown_table(rows)
    assert "| pair |" in table.splitlines()[0]
    assert any("pair: eager" in note for note in roundtrip._notes_on_columns(rows))
    alone = [row("ours alltoall/nccl")]
    roundtrip._beside_its_pair(alone, 0, row(roundtrip.DEEPEP_CACHED))  # our captured row did not run
    assert [r["name"] for r in alone] == ["ours alltoall/nccl", roundtrip.DEEPEP_CACHED]
    assert "pair" not in alone[1] and "| pair |" not in roundtrip.markdown_table(alone)


@pytest.mark.parametrize("deepep", [False, True])
def test_the_captured_engine_row_runs_by_default_where_deepeps_cached_layout_does(monkeypatch, deepep):
    """On GPUs where the engine runs, the default transports are NCCL and the
    engine, and the engine captured too where DeepEP's rows run (the pair of
    its kernels on a cached layout); on CPU, NCCL (gloo) alone."""
    from dispatch import cuda

    monkeypatch.setattr(cuda, "available", lambda: True)
    monkeypatch.setattr(roundtrip, "_deepep_importable", lambda: deepep)
    parser = argparse.ArgumentParser()
    roundtrip.add_arguments(parser)
    args = parser.parse_args([])
    roundtrip.resolve(args, True, parser)
    assert args.transports == ["nccl", "nvlink", *(["nvlink-graph"] if deepep else [])]
    args = parser.parse_args([])
    roundtrip.resolve(args, False, parser)
    assert args.transports == ["nccl"]
    args = parser.parse_args([])
    args.world_size = 1  # one GPU: the engine takes peers (the main job failed there)
    roundtrip.resolve(args, True, parser)
    assert args.transports == ["nccl"]
