"""The terminal's live status line (``ui.progress``) of ``epochstream run`` and ``chaos``.

Fast: the line's text and when it is wanted. Slow: the CLI on a real pseudo-terminal shows
a line rewritten in place (carriage returns) with records/s, epochs, last epoch, restarts
and kills; through a pipe, or with ``--json``, not a byte of it.
"""

from __future__ import annotations

import io
import os
import pty
import select
import subprocess
import sys
import textwrap

import pytest

from epochstream.ui.progress import status_text, wanted

JOB = textwrap.dedent('''
    from epochstream import CheckpointConfig, FileSink, KeyedProcessFunction, Pipeline, ValueStateDescriptor


    class Count(KeyedProcessFunction):
        def open(self, ctx):
            self.count = ctx.state(ValueStateDescriptor("count", default=0))

        def process(self, value, ctx):
            n = self.count.value() + 1
            self.count.update(n)
            return ((ctx.key, n),)


    def job():
        p = Pipeline("progress", parallelism=2, checkpoint=CheckpointConfig(interval=0.1), batch_size=8)
        (p.from_collection([(f"k{i % 7}", i) for i in range(40_000)], uid="src")
          .key_by(lambda r: r[0]).process(Count(), uid="count").sink(FileSink("out"), uid="counts"))
        return p
''')


def test_status_text():
    job = {"state": "RUNNING", "records_per_second": 12345.6, "completed_epochs": 4, "last_epoch_seconds": 0.123,
           "restarts": 1, "kills": 2}
    assert status_text("run", job) == \
        "run RUNNING: 12,346 records/s | 4 epochs | last epoch 0.12s | 1 restarts | 2 kills"
    assert status_text("run", {}) == "run : - records/s | 0 epochs | last epoch - | 0 restarts | 0 kills"


def test_wanted_only_on_a_terminal_without_json():
    assert not wanted(False, io.StringIO())
    assert not wanted(True, io.StringIO())

    class Tty(io.StringIO):
        def isatty(self):
            return True

    assert wanted(False, Tty()) and not wanted(True, Tty())


def run_cli(tmp_path, *args, tty: bool) -> tuple[int, str]:
    (tmp_path / "job.py").write_text(JOB)
    cmd = [sys.executable, "-m", "epochstream.cli", "run", "job.py:job", "--deployment", "local",
           "--checkpoint-dir", str(tmp_path / f"chk-{tty}-{len(args)}"), *args]
    env = {**os.environ, "EPOCHSTREAM_HOME": str(tmp_path / "home"), "COLUMNS": "160"}
    if not tty:
        proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
        return proc.returncode, proc.stdout + proc.stderr
    master, slave = pty.openpty()
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=slave, stderr=slave, stdin=subprocess.DEVNULL, env=env)
    os.close(slave)
    out = b""
    while True:
        ready, _, _ = select.select([master], [], [], 1.0)
        if ready:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # the terminal closed: the process is gone
                break
            if not chunk:
                break
            out += chunk
        elif proc.poll() is not None:
            break
    os.close(master)
    return proc.wait(timeout=60), out.decode(errors="replace")


@pytest.mark.slow
def test_run_shows_a_live_status_line_on_a_terminal_only(tmp_path):
    code, out = run_cli(tmp_path, tty=True)
    assert code == 0, out
    lines = [seg for seg in out.replace("\n", "\r").split("\r") if "records/s" in seg]
    assert lines, out[-2000:]
    assert any(" epochs | last epoch " in seg and "restarts" in seg and "kills" in seg for seg in lines)
    epochs = [int(seg.split(" epochs")[0].rsplit("| ", 1)[-1]) for seg in lines if " epochs" in seg]
    assert max(epochs) >= 1 and epochs == sorted(epochs)  # updated in place as epochs complete
    assert "\r" in out
    code, out = run_cli(tmp_path, tty=False)
    assert code == 0 and "records/s" not in out and "\r" not in out
    code, out = run_cli(tmp_path, "--json", tty=True)
    assert code == 0 and "records/s" not in out
