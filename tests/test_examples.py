"""The runnable examples under examples/ run and check themselves."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _env(drop: tuple[str, ...] = ()) -> dict:
    """This environment with the repository root first on PYTHONPATH (an example then
    imports this tree's ``dispatch``, installed or not), less ``drop``."""
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    return env


def test_the_cpu_round_trip_example_equals_the_dense_answer():
    """examples/cpu_round_trip.py on 2 gloo ranks: it exits 0 only where every
    token's round trip equals its dense answer."""
    done = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "cpu_round_trip.py"), "--ranks", "2"],
                          cwd=ROOT, capture_output=True, text=True, timeout=180, env=_env())
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 ranks: every token's round trip equals the dense answer" in done.stdout, done.stdout


def test_the_two_micro_batches_example_equals_one_at_a_time():
    """examples/two_micro_batches.py on 2 gloo ranks: two micro-batches in flight by
    the async verbs, and through MoEMicroBatches, give the results and gradients
    of one at a time, bitwise."""
    done = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "two_micro_batches.py"), "--ranks", "2"],
                          cwd=ROOT, capture_output=True, text=True, timeout=180, env=_env())
    assert done.returncode == 0, done.stdout + done.stderr
    assert ("2 ranks: two micro-batches in flight equal one at a time, gradients included; so does MoEMicroBatches"
            in done.stdout), done.stdout


def test_the_megatron_example_says_what_it_needs_where_it_cannot_run():
    """examples/megatron_layer.py trains on GPUs under torchrun with megatron-core;
    elsewhere it exits 2 saying which is missing."""
    path = os.path.join(ROOT, "examples", "megatron_layer.py")
    compile(open(path).read(), path, "exec")
    done = subprocess.run([sys.executable, path], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env=_env(drop=("LOCAL_RANK",)))
    assert done.returncode == 2, done.stdout + done.stderr
    assert "megatron-core" in done.stderr or "torchrun" in done.stderr, done.stderr
