"""The overlap benchmark: a real tiny run on a CPU world, its files, and bad flags."""

from __future__ import annotations

import json

import pytest
import torch

from dispatch.bench import overlap

# The bench's experts are GroupedExperts: on CPU one matmul per expert, whose
# tiling may depend on the chunk's row count, so a chunked layer equals C = 1 up
# to fp32 rounding (dispatch/experts.py); a row routed wrong would be off by O(1).
# The bitwise contract is proven with row-wise experts (tests/test_pipeline.py).
ROUNDING = 1e-5


def test_cpu_smoke_run_writes_results(tmp_path):
    argv = ["--shapes", "cpu-tiny", "--world-size", "2", "--iters", "1", "--warmup", "0", "--chunks", "3",
            "--trace", "--out", str(tmp_path)]
    assert overlap.main(argv) == 0
    result = json.loads((tmp_path / "overlap-cpu-tiny-w2.json").read_text())
    assert [r["passes"] for r in result["rows"]] == ["fwd", "fwd+bwd"]
    for row in result["rows"]:
        assert row["best_chunks"] == 3 and row["max_abs_diff_vs_seq"] <= ROUNDING
        assert row["t_comm_ms"] > 0 and row["t_compute_ms"] > 0 and row["t_seq_ms"] > 0
        short, long = sorted((row["t_comm_ms"], row["t_compute_ms"]))
        assert row["hidden_fraction"] == pytest.approx((row["t_seq_ms"] - row["t_pipe_ms"]) / short)
        assert row["hidden_ceiling"] == pytest.approx((row["t_seq_ms"] - long) / short)
        assert set(row["host_ms"]) == {"seq", "3"} and min(row["host_ms"].values()) > 0
        if not torch.cuda.is_available():
            assert row["peak_mib"] is None  # measured on CUDA only
        elif row["passes"] == "fwd+bwd":
            assert set(row["peak_mib"]) == {"seq", "3"} and min(row["peak_mib"].values()) > 0
    assert (tmp_path / "overlap-trace-cpu-tiny-w2.png").stat().st_size > 0
    assert (tmp_path / "overlap-trace-cpu-tiny-w2-rank1.json").stat().st_size > 0  # every rank's trace
    lanes = (tmp_path / "overlap-trace-cpu-tiny-w2-lanes.txt").read_text()
    assert lanes.startswith("rank 0, ") and "\nrank 1, " in lanes  # threads on CPU, streams on CUDA
    assert "| cpu-tiny | fwd+bwd | 2 |" in (tmp_path / "overlap-cpu-tiny-w2.md").read_text()


def test_peak_memory_column():
    """The peak column lists the sequential layer first, then each candidate, in MiB; '-' where not measured."""
    row = dict(shape="s", passes="fwd+bwd", world_size=4, dispatch_wire="native", comm_max_ctas=None,
               comm_high_priority=False, sm_carveout=None, t_comm_ms=1.0, t_compute_ms=2.0, t_seq_ms=3.0,
               t_pipe_ms=2.5, best_chunks="local2", hidden_fraction=0.5, hidden_ceiling=1.0,
               t_pipe_by_chunks_ms={"2": 2.6, "local2": 2.5}, t_comm_by_transport_ms={"collective": 1.0},
               t_seq_by_transport_ms={"collective": 3.0}, max_abs_diff_vs_seq=0.0,
               peak_mib={"seq": 5120.4, "2": 4990.0, "local2": 6001.7},
               host_ms={"seq": 1.234, "2": 2.5, "local2": 3.0})
    lines = overlap.markdown_table([row, dict(row, passes="fwd", peak_mib=None)]).splitlines()
    assert lines[0].count("|") == lines[1].count("|") == lines[2].count("|") == lines[3].count("|")
    assert lines[2].endswith("| 0 | seq: 5120, 2: 4990, local2: 6002 | seq: 1.23, 2: 2.50, local2: 3.00 |")
    assert lines[3].endswith("| 0 | - | seq: 1.23, 2: 2.50, local2: 3.00 |")


@pytest.mark.parametrize(
    "argv, needle",
    [(["--iters", "0"], "--iters"), (["--chunks", "0"], "--chunks"), (["--dispatch-wire", "fp4"], "--dispatch-wire"),
     (["--shapes", "nope"], "--shapes"), (["--chunks", "2", "--trace", "--trace-candidate", "local2"], "--trace-candidate"),
     (["--trace-candidate", "2"], "needs --trace"), (["--ahead", "0"], "--ahead"), (["--chunks", "1:0"], "--chunks"),
     (["--chunks", "2:x"], "--chunks"), (["--chunks", "1::2"], "--chunks"),
     (["--host-profile", "3"], "--host-profile"), (["--experts-backend", "bmm"], "--experts-backend")],
)
def test_bad_flags(argv, needle, capsys):
    with pytest.raises(SystemExit) as exc:
        overlap.main(argv)
    assert exc.value.code == 2
    assert needle in capsys.readouterr().err


def test_local_first_and_ahead_are_candidates(tmp_path):
    argv = ["--shapes", "cpu-tiny", "--world-size", "2", "--iters", "1", "--warmup", "0", "--chunks", "2",
            "--local-first", "--ahead", "1", "2", "--trace", "--trace-candidate", "local2/1", "--out", str(tmp_path)]
    assert overlap.main(argv) == 0
    result = json.loads((tmp_path / "overlap-cpu-tiny-w2-local-first-ahead1-2.json").read_text())
    for row in result["rows"]:  # "2/2" is "2": only A < C is a candidate of its own
        assert set(row["t_pipe_by_chunks_ms"]) == {"2", "local", "local2", "2/1", "local2/1"}
        assert row["t_pipe_ms"] == min(row["t_pipe_by_chunks_ms"].values())
        assert row["max_abs_diff_vs_seq"] <= ROUNDING
    assert (tmp_path / "overlap-trace-cpu-tiny-w2-local-first-ahead1-2.png").stat().st_size > 0
    assert overlap.layer_options("local4/2") == dict(chunks=4, local_first=True, ahead=2)
    assert overlap.layer_options("3") == dict(chunks=3, local_first=False, ahead=None)
    assert overlap._layer_words("peer:local4/2") == "own rows first, C=4, 2 ahead"
    assert overlap.layer_options("local1:3:1/2") == dict(chunks=(1, 3, 1), local_first=True, ahead=2)
    assert overlap.layer_options("2:1") == dict(chunks=(2, 1), local_first=False, ahead=None)
    assert overlap._layer_words("1:3:1") == "chunk sizes 1:3:1"


def test_chunk_sizes_are_candidates(tmp_path):
    argv = ["--shapes", "cpu-tiny", "--world-size", "2", "--iters", "1", "--warmup", "0", "--chunks", "1:2:1",
            "2", "--local-first", "--ahead", "1", "--host-profile", "local1:2:1", "--out", str(tmp_path)]
    assert overlap.main(argv) == 0
    result = json.loads((tmp_path / "overlap-cpu-tiny-w2-local-first-ahead1.json").read_text())
    for row in result["rows"]:
        assert set(row["t_pipe_by_chunks_ms"]) == {"1:2:1", "2", "local", "local1:2:1", "local2", "1:2:1/1", "2/1",
                                                    "local1:2:1/1", "local2/1"}
        assert row["max_abs_diff_vs_seq"] <= ROUNDING
    host = (tmp_path / "overlap-host-cpu-tiny-w2-local-first-ahead1.txt").read_text()
    assert host.startswith("host profile of 5 forward+backward steps, own rows first, chunk sizes 1:2:1, rank 0")
    assert "local_first_forward" in host  # the candidate's own code is in the profile


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
    from dispatch.bench.timeline import draw_timeline, lanes_summary

    barrier = ("ncclDevKernel_AllReduce_Sum_f32(x)", 7, 0, 100, 1)  # the barrier: left out
    rank0 = _trace_file(tmp_path / "r0.json", [
        barrier, ("cutlass_gemm", 7, 1000, 500, 2), ("cutlass_gemm", 7, 2000, 300, 3),
        ("ncclDevKernel_SendRecv(x)", 9, 1200, 2000, 4)], [(10, 2), (1800, 3), (20, 4)])
    rank1 = _trace_file(tmp_path / "r1.json", [
        barrier, ("cutlass_gemm", 7, 1500, 500, 2), ("elementwise", 7, 2400, 50, 3)], [(10, 2), (30, 3)])
    text = lanes_summary([rank0, rank1])
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
    draw_timeline([rank0, rank1], str(tmp_path / "t.png"), "two ranks")
    assert (tmp_path / "t.png").stat().st_size > 0
    with pytest.raises(ValueError, match="no kernels"):
        lanes_summary([_trace_file(tmp_path / "empty.json", [], [])])


def test_both_transports_side_by_side(tmp_path):
    argv = ["--shapes", "cpu-tiny", "--world-size", "2", "--iters", "1", "--warmup", "0", "--chunks", "2",
            "--local-first", "--transport", "both", "--out", str(tmp_path)]
    assert overlap.main(argv) == 0
    result = json.loads((tmp_path / "overlap-cpu-tiny-w2-both-local-first.json").read_text())
    for row in result["rows"]:
        assert set(row["t_pipe_by_chunks_ms"]) == {"2", "local", "local2", "peer:2", "peer:local", "peer:local2"}
        assert set(row["t_seq_by_transport_ms"]) == set(row["t_comm_by_transport_ms"]) == {"collective", "peer_copy"}
        assert row["t_seq_ms"] == min(row["t_seq_by_transport_ms"].values())
        transport = "peer_copy" if str(row["best_chunks"]).startswith("peer:") else "collective"
        assert row["t_comm_ms"] == row["t_comm_by_transport_ms"][transport]
        assert row["max_abs_diff_vs_seq"] <= ROUNDING
    assert "peer_copy: " in (tmp_path / "overlap-cpu-tiny-w2-both-local-first.md").read_text()

