"""The chunk-cost study: its routing counts against a direct count, a real tiny
run on CPU with its files, and bad flags."""

from __future__ import annotations

import json

import pytest
import torch

from dispatch.bench import chunk_cost
from dispatch.bench.common import SHAPES


@pytest.mark.parametrize("chunks", [1, 3, 4])
def test_chunk_counts_are_the_rows_rank0_gets_per_home_range(chunks):
    """Each chunk's counts are rank 0's experts' (token, slot) pairs from token
    range c of every rank: they add up over the chunks to the C = 1 counts, and
    each equals a count made slot by slot from the same routing."""
    shape, ep = SHAPES["cpu-tiny"], 2
    counts = chunk_cost.chunk_counts(shape, ep, chunks, "cpu", seed=5)
    whole = chunk_cost.chunk_counts(shape, ep, 1, "cpu", seed=5)[0]
    assert torch.equal(sum(counts), whole)
    gen = torch.Generator().manual_seed(5)
    topk = torch.rand(ep, shape.tokens, shape.experts, generator=gen).topk(shape.topk, dim=-1).indices
    local = shape.experts // ep
    for c in range(chunks):
        want = torch.zeros(local, dtype=torch.int64)
        lo, hi = shape.tokens * c // chunks, shape.tokens * (c + 1) // chunks
        for rank in range(ep):
            for token in range(lo, hi):
                for e in topk[rank, token].tolist():
                    if e < local:
                        want[e] += 1
        assert torch.equal(counts[c], want)


def test_cpu_run_writes_results(tmp_path):
    argv = ["--shapes", "cpu-tiny", "--ep", "2", "--chunks", "2", "--backends", "padded", "loop",
            "--iters", "1", "--warmup", "0", "--out", str(tmp_path)]
    assert chunk_cost.main(argv) == 0
    result = json.loads((tmp_path / "chunk-cost-cpu-tiny-ep2.json").read_text())
    rows = result["rows"]
    assert [(r["backend"], r["chunks"]) for r in rows] == [("padded", 1), ("padded", 2), ("loop", 1), ("loop", 2)]
    for r in rows:
        assert r["fwd_ms"] > 0 and r["fwd_bwd_ms"] > 0 and r["fwd_floor_ms"] > 0
        assert r["rows"] == rows[0]["rows"] and r["local_experts"] == 4
        if r["chunks"] == 1:
            assert r["fwd_vs_c1"] == r["fwd_bwd_vs_c1"] == 1.0
    assert result["rates"]["hbm_gbps"] > 0 and "commit" in result["environment"]
    probe = result["rates"]["carveout_probe_ms"]
    if torch.cuda.is_available():  # every kind timed with all SMs and carved
        assert "mm (cuBLAS)" in probe and all(whole > 0 and carved > 0 for whole, carved in probe.values())
    else:
        assert probe == {}
    assert "   padded" in (tmp_path / "chunk-cost-cpu-tiny-ep2.md").read_text()


@pytest.mark.parametrize(
    "argv, needle",
    [(["--ep", "0"], "--ep"), (["--ep", "3"], "--ep 3"), (["--chunks", "0"], "--chunks"),
     (["--backends", "cutlass"], "--backends"), (["--shapes", "nope"], "--shapes"),
     (["--sm-carveout", "-1"], "--sm-carveout"), (["--iters", "0"], "--iters")],
)
def test_bad_flags(argv, needle, capsys):
    with pytest.raises(SystemExit) as exc:
        chunk_cost.main(["--shapes", "cpu-tiny", *argv])
    assert exc.value.code == 2
    assert needle in capsys.readouterr().err


def test_sm_carveout_is_set_inside_and_restored_after():
    """The switch the pipeline and the study share: set inside, the earlier value
    back after, also when the body raises; carveout 0 leaves it alone."""
    from dispatch.pipeline import sm_carveout

    before = torch._C._get_sm_carveout_experimental()
    with pytest.raises(RuntimeError, match="inside"):
        with sm_carveout(8):
            assert torch._C._get_sm_carveout_experimental() == 8
            raise RuntimeError("inside")
    assert torch._C._get_sm_carveout_experimental() == before
    with chunk_cost._carveout(0):
        assert torch._C._get_sm_carveout_experimental() == before
