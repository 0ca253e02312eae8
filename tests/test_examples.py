"""The runnable examples under examples/ run and check themselves."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_cpu_round_trip_example_equals_the_dense_answer():
    """examples/cpu_round_trip.py on 2 gloo ranks: it exits 0 only where every
    token's round trip equals its dense answer."""
    done = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "cpu_round_trip.py"), "--ranks", "2"],
                          cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 ranks: every token's round trip equals the dense answer" in done.stdout, done.stdout
