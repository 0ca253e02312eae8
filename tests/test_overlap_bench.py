"""``dispatch-bench overlap``: a real tiny run on a CPU world, its files, and bad flags."""

from __future__ import annotations

import json

import pytest
import torch

from dispatch import bench
from dispatch.bench import overlap, overlap_mb
from dispatch.experts import GroupedExperts
from world import bench_world_of

# The bench's experts are GroupedExperts: on CPU one matmul per expert, whose
# tiling may depend on the group's row count, so a layer by groups equals G = 1 up
# to fp32 rounding (dispatch/experts.py); a row routed wrong would be off by O(1).
# The bitwise contract is proven with row-wise experts (tests/test_pipeline.py).
ROUNDING = 1e-5


@bench_world_of(2)
def test_cpu_smoke_run_writes_results(tmp_path):
    argv = ["--shapes", "cpu-tiny", "--world-size", "2", "--iters", "1", "--warmup", "0", "--groups", "2,4",
            "--out", str(tmp_path)]
    assert overlap.main(argv) == 0
    result = json.loads((tmp_path / "overlap-cpu-tiny-w2.json").read_text())
    assert [r["passes"] for r in result["rows"]] == ["fwd", "fwd+bwd"]
    for row in result["rows"]:
        assert set(row["t_pipe_by_groups_ms"]) == {"2", "4"} and row["best_groups"] in (2, 4)
        assert row["t_pipe_ms"] == min(row["t_pipe_by_groups_ms"].values())
        assert row["max_abs_diff_vs_seq"] <= ROUNDING
        assert row["t_comm_ms"] > 0 and row["t_compute_ms"] > 0 and row["t_seq_ms"] > 0
        short, long = sorted((row["t_comm_ms"], row["t_compute_ms"]))
        assert row["hidden_fraction"] == pytest.approx((row["t_seq_ms"] - row["t_pipe_ms"]) / short)
        assert row["hidden_ceiling"] == pytest.approx((row["t_seq_ms"] - long) / short)
        assert set(row["host_ms"]) == {"seq", "2", "4"} and min(row["host_ms"].values()) > 0
        # each expert's weights read once a GEMM for every G: once forward, again for the rows' gradients
        once = 1.0 if row["passes"] == "fwd" else 2.0
        assert row["weight_reads"] == {"seq": once, "2": once, "4": once}
        if not torch.cuda.is_available():
            assert row["peak_mib"] is None  # measured on CUDA only
        elif row["passes"] == "fwd+bwd":
            assert set(row["peak_mib"]) == {"seq", "2", "4"} and min(row["peak_mib"].values()) > 0
    assert "| cpu-tiny | fwd+bwd | 2 |" in (tmp_path / "overlap-cpu-tiny-w2.md").read_text()


@bench_world_of(2)
@pytest.mark.parametrize("count, stem", [(None, "mb"), (3, "mb3")])
def test_cpu_micro_batches(tmp_path, count, stem):
    """--micro-batches [M]: M (2 by default) micro-batches through MoEMicroBatches
    give the layer's outputs (to the experts' rounding), overlapped and on one
    stream, with T_mb beside T_mb_serial (on one stream) and T_mb_layer, and
    hidden_mb from T_mb_serial over M exchanges."""
    argv = ["--shapes", "cpu-tiny", "--world-size", "2", "--iters", "1", "--warmup", "0", "--groups", "2",
            "--micro-batches", *([] if count is None else [str(count)]), "--out", str(tmp_path)]
    assert overlap.main(argv) == 0
    result = json.loads((tmp_path / f"overlap-cpu-tiny-w2-{stem}.json").read_text())
    for row in result["rows"]:
        assert row["t_mb_ms"] > 0 and row["t_mb_serial_ms"] > 0 and row["t_mb_layer_ms"] > 0
        assert row["peak_mib_mb"] is None and row["peak_mib_mb_layer"] is None  # (measured on CUDA)
        assert row["max_abs_diff_mb"] <= ROUNDING
        short = min(row["t_comm_ms"], row["t_compute_ms"])
        assert row["hidden_mb"] == pytest.approx((row["t_mb_serial_ms"] - row["t_mb_ms"]) / ((count or 2) * short))
        assert row["t_graph_ms"] is None
    first = result["rows"][0]
    cell = f"| {first['t_mb_layer_ms']:.3f} / {first['t_mb_serial_ms']:.3f} / {first['t_mb_ms']:.3f} ("
    assert cell in (tmp_path / f"overlap-cpu-tiny-w2-{stem}.md").read_text()


@bench_world_of(2)
def test_cpu_micro_batches_with_max_rows(tmp_path):
    """--max-rows: every layer and the micro-batches dispatch with max_rows (the
    most rows a rank receives, plus 10%), the outputs those of the layer without it."""
    argv = ["--shapes", "cpu-tiny", "--world-size", "2", "--iters", "1", "--warmup", "0", "--groups", "1",
            "--micro-batches", "--max-rows", "--out", str(tmp_path)]
    assert overlap.main(argv) == 0
    result = json.loads((tmp_path / "overlap-cpu-tiny-w2-bounded-mb.json").read_text())
    for row in result["rows"]:
        assert row["max_rows"] > 0 and row["t_comm_ms"] > 0 and row["t_mb_ms"] > 0
        assert row["max_abs_diff_mb"] <= ROUNDING
    assert f"max_rows {result['rows'][0]['max_rows']} |" in (tmp_path / "overlap-cpu-tiny-w2-bounded-mb.md").read_text()


def test_groups_above_local_experts_are_capped():
    """cpu-tiny on 2 ranks has 4 local experts: G = 8 is G = 4, counted once."""
    args = overlap.parse_args(["--groups", "1,2,4,8"])
    assert args.groups == [1, 2, 4, 8]
    assert overlap.group_values(args, 4) == [1, 2, 4]


@bench_world_of(2)
def test_global_flags_before_the_command(tmp_path):
    """``dispatch-bench --iters 1 --warmup 0 --out DIR overlap ...`` gives overlap the global flags."""
    argv = ["--iters", "1", "--warmup", "0", "--out", str(tmp_path), "overlap", "--shapes", "cpu-tiny",
            "--world-size", "2", "--groups", "2"]
    assert bench.main(argv) == 0
    assert json.loads((tmp_path / "overlap-cpu-tiny-w2.json").read_text())["iters"] == 1


def test_weights_and_peak_memory_columns():
    """The weights and peak columns list the sequential layer first, then each G (weights
    read in units of all the experts' weights, peak in MiB); '-' where not measured."""
    row = dict(shape="s", passes="fwd+bwd", world_size=4, dispatch_wire="native", comm_max_ctas=None,
               comm_high_priority=False, t_comm_ms=1.0, t_compute_ms=2.0, t_seq_ms=3.0,
               t_pipe_ms=2.5, best_groups=4, hidden_fraction=0.5, hidden_ceiling=1.0,
               t_pipe_by_groups_ms={"2": 2.6, "4": 2.5}, max_abs_diff_vs_seq=0.0,
               weight_reads={"seq": 2.0, "2": 2.0, "4": 2.0},
               peak_mib={"seq": 5120.4, "2": 4990.0, "4": 6001.7}, host_ms={"seq": 1.234, "2": 2.5, "4": 3.0})
    rows = [row, dict(row, passes="fwd", weight_reads=None, peak_mib=None, t_graph_ms=0.75)]
    lines = overlap.markdown_table(rows).splitlines()
    assert lines[0].count("|") == lines[1].count("|") == lines[2].count("|") == lines[3].count("|")
    assert "| T_graph ms |" in lines[0] and "| 2: 2.60, 4: 2.50 | - |" in lines[2] and "| 0.750 |" in lines[3]
    assert lines[2].endswith("| 0 | seq: 2.00, 2: 2.00, 4: 2.00 | seq: 5120, 2: 4990, 4: 6002 | "
                             "seq: 1.23, 2: 2.50, 4: 3.00 |")
    assert lines[3].endswith("| 0 | - | - | seq: 1.23, 2: 2.50, 4: 3.00 |")


def test_the_micro_batches_cell_with_captured_steps():
    """T_mb's cell: the eager times and hidden, the peaks, then with --graph the
    captured serial and overlapped steps and their hidden."""
    row = dict(t_mb_layer_ms=20.0, t_mb_serial_ms=12.345, t_mb_ms=10.0, hidden_mb=0.41, peak_mib_mb_layer=900.2,
               peak_mib_mb=1800.0, t_mb_serial_graph_ms=11.5, t_mb_graph_ms=8.25, hidden_mb_graph=0.55)
    assert overlap_mb.micro_batch_cell(row) == ("20.000 / 12.345 / 10.000 (0.41); peak MiB 900 / 1800; "
                                                "captured T_mb_serial / T_mb 11.500 / 8.250 (0.55)")
    eager = dict(row, t_mb_graph_ms=None, peak_mib_mb=None)
    assert overlap_mb.micro_batch_cell(eager) == "20.000 / 12.345 / 10.000 (0.41)"
    assert overlap_mb.micro_batch_cell({}) == "-"


def test_an_sm_partition_is_refused_in_a_graph(monkeypatch, capsys):
    """--sm-partition with --graph: refused by name (a partition's streams are not captured)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(SystemExit) as exc:
        overlap.parse_args(["--transport", "nvshmem", "--micro-batches", "2", "--sm-partition", "8", "--graph"])
    assert exc.value.code == 2
    assert "--sm-partition: an SM partition's streams are not captured" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, needle",
    [(["--iters", "0"], "--iters"), (["--groups", "0"], "--groups"), (["--dispatch-wire", "fp4"], "--dispatch-wire"),
     (["--shapes", "nope"], "--shapes"), (["--groups", "1:3:1"], "--groups"), (["--groups", "2,x"], "--groups"),
     (["--local-first"], "unrecognized"), (["--sm-carveout", "-1"], "--sm-carveout"), (["--trace"], "unrecognized"),
     (["--graph"], "--graph needs the NVLink engine"), (["--nvshmem-blocks", "8"], "--nvshmem-blocks needs"),
     (["--transport", "nvshmem", "--nvshmem-blocks", "0"], "--nvshmem-blocks needs"),
     (["--micro-batches", "1"], "--micro-batches needs M >= 2"),
     (["--sm-partition", "8"], "--sm-partition needs --micro-batches"),
     (["--micro-batches", "2", "--sm-partition", "0"], "--sm-partition needs")],
)
def test_bad_flags(argv, needle, capsys):
    with pytest.raises(SystemExit) as exc:
        overlap.main(argv)
    assert exc.value.code == 2
    assert needle in capsys.readouterr().err


def test_weight_reads_count_the_products_of_parameter_views():
    """The weights column counts the bytes of the experts' parameters that matrix
    products take, forward and backward, and only products with a result: an
    expert without rows reads nothing, and two groups' calls, each on its own
    expert's rows, read each expert once."""
    torch.manual_seed(0)
    experts = GroupedExperts(4, 8, 16, activation="gelu", backend="loop")
    params = list(experts.parameters())
    one = experts.w_in[0].numel() * 4 + experts.w_out[0].numel() * 4  # fp32: one expert's weights
    tokens = torch.randn(6, 8)
    counts = torch.tensor([3, 0, 3, 0])
    with overlap._WeightReads(params) as reads:
        experts(tokens, counts)
    assert reads.bytes == 2 * one  # experts 0 and 2
    with overlap._WeightReads(params) as reads:
        experts(tokens.requires_grad_(), counts).sum().backward()
    assert reads.bytes == 4 * one  # and again for the rows' gradients (the weights' own take none)
    with overlap._WeightReads(params) as reads:
        for group in ([3, 0, 0, 0], [0, 0, 3, 0]):
            experts(tokens[:3], torch.tensor(group))
    assert reads.bytes == 2 * one
