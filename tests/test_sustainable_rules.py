"""The rules by which ``benchmarks/paper/sustainable_throughput.py`` calls a rate sustained (Figure 13b).

Only the verdict on a run's row is tested here (no run: the benchmark's numbers are measured by the
benchmark). The drain rule matters most: a simulated job ends when its last epoch commits, so a job
whose epochs fall behind its input runs longer than its input and must not pass.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.paper import sustainable_throughput as st  # noqa: E402

ARGS = argparse.Namespace(growth=1.5, read_rate=0.9, saturated=10.0, drain=1.2)


def _row(**kw) -> dict:
    row = {"overloaded": False, "growth": 1.0, "read_ratio": 1.0, "p50_ms": 1.6, "bound_growth": 1.0,
           "drain_ratio": 1.01}
    row.update(kw)
    return row


def test_a_steady_run_is_sustained():
    assert st.is_sustained(_row(), "tracker", 1.5, ARGS)
    assert st.is_sustained(_row(), "aligned", 1.5, ARGS)


def test_a_job_that_drains_after_its_input_is_not_sustained():
    """Session 29's trAcker at 2,000/s: every growth rule passed, but the job ran 2x its input."""
    assert not st.is_sustained(_row(drain_ratio=2.0), "tracker", 1.5, ARGS)
    assert not st.is_sustained(_row(drain_ratio=1.21), "no tracking", 1.5, ARGS)
    assert st.is_sustained(_row(drain_ratio=1.2), "tracker", 1.5, ARGS)


def test_the_local_driver_has_no_virtual_time():
    """Its rows carry no drain ratio (wall time is the input time there): the rule does not apply."""
    assert st.is_sustained(_row(drain_ratio=""), "tracker", 1.5, ARGS)


def test_each_other_rule_still_refuses():
    for bad in (dict(overloaded=True), dict(growth=1.6), dict(read_ratio=0.8), dict(p50_ms=16.0),
                dict(bound_growth=1.6)):
        assert not st.is_sustained(_row(**bad), "tracker", 1.5, ARGS), bad
    assert st.is_sustained(_row(bound_growth=1.6), "aligned", 1.5, ARGS)  # the epochs' growth is the trAcker's rule
