"""bench/overlap_trace.py: profiler timelines and the host profile of the overlap
layer, on a CPU world; the lanes summary against hand-made traces."""

from __future__ import annotations

import json

import pytest

from bench_scripts import load
from world import bench_world_of

overlap_trace = load("overlap_trace")
timeline = load("timeline")


@bench_world_of(2)
def test_cpu_run_writes_traces_timeline_and_host_profile(tmp_path):
    argv = ["--shapes", "cpu-tiny", "--world-size", "2", "--groups", "2", "--host-profile", "--out", str(tmp_path)]
    assert overlap_trace.main(argv) == 0
    stem = "overlap-trace-cpu-tiny-w2-g2"
    assert (tmp_path / f"{stem}.png").stat().st_size > 0
    assert (tmp_path / f"{stem}.json").stat().st_size > 0
    assert (tmp_path / f"{stem}-rank1.json").stat().st_size > 0  # every rank's trace
    first, lanes = (tmp_path / f"{stem}-lanes.txt").read_text().split("\n", 1)
    assert first.startswith("the step timed with CUDA events around it (slowest rank): ") and first.endswith(" ms")
    assert float(first.split(": ")[1][:-3]) > 0
    assert lanes.startswith("rank 0, ") and "\nrank 1, " in lanes  # threads on CPU, streams on CUDA
    host = (tmp_path / "overlap-host-cpu-tiny-w2-g2.txt").read_text()
    assert host.startswith("host profile of 5 forward+backward steps, cpu-tiny, G=2, rank 0")
    assert "function calls" in host  # pstats' header: the steps were profiled


@bench_world_of(2)
def test_cpu_run_traces_two_micro_batches(tmp_path):
    """--micro-batches --max-rows: one forward+backward of the two micro-batches
    through MoEMicroBatches, bounded, traced in place of the layer by groups,
    and its two baselines (the same call on one stream, MoEExchange on each)."""
    argv = ["--shapes", "cpu-tiny", "--world-size", "2", "--groups", "1", "--micro-batches", "--max-rows",
            "--host-profile", "--out", str(tmp_path)]
    assert overlap_trace.main(argv) == 0
    for stem in ("overlap-trace-cpu-tiny-w2-bounded-mb" + tail for tail in ("", "-serial", "-layer")):
        assert (tmp_path / f"{stem}.png").stat().st_size > 0 and (tmp_path / f"{stem}-rank1.json").stat().st_size > 0
        assert (tmp_path / f"{stem}-lanes.txt").stat().st_size > 0
    assert not list(tmp_path.glob("*-g1*"))  # the layer by groups is not traced
    host = (tmp_path / "overlap-host-cpu-tiny-w2-bounded-mb.txt").read_text()  # the micro-batches' host profile
    assert host.startswith("host profile of 5 forward+backward steps, cpu-tiny: 2 micro-batches through "
                           "MoEMicroBatches, rank 0")
    assert "micro_batches.py" in host


@pytest.mark.parametrize("argv, needle", [(["--groups", "0"], "--groups"), (["--max-rows"], "--max-rows"),
                                          (["--micro-batches", "--graph"], "--micro-batches")])
def test_bad_flags(argv, needle, capsys):
    with pytest.raises(SystemExit) as exc:
        overlap_trace.main(argv)
    assert exc.value.code == 2 and needle in capsys.readouterr().err


def _trace_file(path, kernels, launches):
    """A chrome trace of (stream, start, duration, correlation) kernels and (start, correlation) launches, in µs."""
    events = [dict(ph="X", cat="kernel", name=name, ts=ts, dur=dur, args=dict(stream=stream, correlation=corr))
              for name, stream, ts, dur, corr in kernels]
    events += [dict(ph="X", cat="cuda_runtime", name="cudaLaunchKernel", ts=ts, dur=5, args=dict(correlation=corr))
               for ts, corr in launches]
    path.write_text(json.dumps({"traceEvents": events}))
    return str(path)


def test_lanes_summary_and_timeline(tmp_path):
    """Every rank's lanes on one clock: idle time and the part of it spent waiting for a launch."""
    barrier = ("ncclDevKernel_AllReduce_Sum_f32(x)", 7, 0, 100, 1)  # the barrier: left out
    rank0 = _trace_file(tmp_path / "r0.json", [
        barrier, ("cutlass_gemm", 7, 1000, 500, 2), ("cutlass_gemm", 7, 2000, 300, 3),
        ("ncclDevKernel_SendRecv(x)", 9, 1200, 2000, 4)], [(10, 2), (1800, 3), (20, 4)])
    rank1 = _trace_file(tmp_path / "r1.json", [
        barrier, ("cutlass_gemm", 7, 1500, 500, 2), ("elementwise", 7, 2400, 50, 3)], [(10, 2), (30, 3)])
    text = timeline.lanes_summary([rank0, rank1])
    assert text.splitlines() == [
        # stream 7 of rank 0: 0.5 ms idle between its GEMMs, 0.3 of it before the second's launch at 1.8 ms
        "rank 0, stream 7: 0.00-1.30 ms, idle 0.50 ms, of it waiting for the host 0.30 ms",
        "      0.00+0.50  GEMM",
        "      1.00+0.30  GEMM",
        "rank 0, stream 9: 0.20-2.20 ms, idle 0.00 ms, of it waiting for the host 0.00 ms",
        "      0.20+2.00  nccl SendRecv",
        "rank 1, stream 7: 0.50-1.45 ms, idle 0.40 ms, of it waiting for the host 0.00 ms",
        "      0.50+0.50  GEMM",
    ]
    timeline.draw_timeline([rank0, rank1], str(tmp_path / "t.png"), "two ranks")
    assert (tmp_path / "t.png").stat().st_size > 0
    with pytest.raises(ValueError, match="no kernels"):
        timeline.lanes_summary([_trace_file(tmp_path / "empty.json", [], [])])


def test_the_engines_peer_kernels_draw_as_communication():
    """The timeline colours NCCL's kernels and the NVLink engine's kernels that touch a
    peer's memory as communication; its local sums and layout as compute."""
    for name in ("ncclDevKernel_SendRecv(x)", "exchange_counts(unsigned long long const*)",
                 "void pull_rows<__nv_bfloat16, 0>(x)", "void push_partials<float>(x)", "void push_slots<float>(x)"):
        assert timeline.is_comm(name), name
    for name in ("void home_sum<__nv_bfloat16>(x)", "route_layout(x)", "void stage_rows<float>(x)", "cutlass_gemm"):
        assert not timeline.is_comm(name), name
