"""benchmarks/harness.py and benchmarks/report.py: the shared percentile, result files, RESULTS.md's mapping.

No benchmark runs here: the report is built from small files written into a temporary folder.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import report  # noqa: E402
from benchmarks.harness import RESULTS, percentile, read_csv, write_csv  # noqa: E402

#: mapped result files that may not exist yet (their section says "not run yet")
NOT_RUN_YET = {"pyspark_keyed_count.csv"}


def test_percentile_is_the_value_at_index_floor_q_n():
    assert percentile([4, 1, 3, 2], 0.5) == 3  # the upper median
    assert percentile(range(1, 101), 0.99) == 100
    assert percentile(range(1, 201), 0.99) == 199
    assert percentile([5.0, 9.0], 0.99) == 9.0  # fewer than 100 values: the maximum
    assert math.isnan(percentile([], 0.5))


def test_a_result_file_records_its_command_and_reads_back_without_it(tmp_path):
    rows = [{"a": 1, "b": "x"}, {"a": 2, "b": "y"}]
    write_csv(tmp_path / "r.csv", rows, notes=["uptime at start: 1"])
    text = (tmp_path / "r.csv").read_text()
    assert "# command: " in text and text.endswith("# uptime at start: 1\n")
    assert read_csv(tmp_path / "r.csv") == [{"a": "1", "b": "x"}, {"a": "2", "b": "y"}]


def test_every_mapped_result_file_exists():
    missing = {src.file for s in report.SECTIONS for src in s.sources} - {p.name for p in RESULTS.iterdir()}
    assert missing <= NOT_RUN_YET


def test_a_section_without_its_file_says_not_run_yet(tmp_path):
    text = report.render(tmp_path)
    assert "## Kafka JSON -> pandas state -> Kafka" in text
    part = text.split("## Kafka JSON -> pandas state -> Kafka")[1].split("\n## ")[0]
    assert "| not run yet |" in part and "`kafka_json_pandas.csv` (not run yet)" in part


def test_a_files_own_command_line_wins_over_the_mapping(tmp_path):
    write_csv(tmp_path / "json_codec.csv", [{"what": "decode", "way": "from_json", "rows": 1000,
                                            "us_per_record": 0.97}])
    part = report.render(tmp_path).split("## JSON codec")[1].split("\n## ")[0]
    assert "| decode | from_json | 1,000 | 0.97 |" in part
    assert "(not committed" in part and "# command" not in part
    assert "`python benchmarks/kafka/json_codec.py`" not in part  # the file's line (this test's command) is shown


def test_per_epoch_leaves_out_each_runs_first_epoch():
    rows = [{"mode": "aligned", "epoch": str(e), "t": str(t)} for e, t in ((1, 9.0), (2, 1.0), (3, 2.0))]
    (row,) = report.per_epoch(("mode",), "t")(rows)
    assert (row["epochs"], row["p50"], row["p99"]) == (2, 2.0, 2.0)


def test_a_recorded_command_names_the_script_where_it_is_and_the_file_by_its_name():
    cmd = report.current_command("python benchmarks/kafka.py --intervals 0.1 --name kafka_old", "kafka_count_100ms.csv")
    assert cmd == "python benchmarks/kafka/kafka.py --intervals 0.1 --name kafka_count_100ms"
    kept = "python benchmarks/state/state_scale.py --spark --name state_scale_vs_spark"
    assert report.current_command(kept, "state_scale_vs_spark_spark.csv") == kept  # <name>_spark.csv is its file
    same = "python benchmarks/report.py --check"
    assert report.current_command(same, "x.csv") == same
