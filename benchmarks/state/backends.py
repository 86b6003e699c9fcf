"""Checkpoint backends: snapshot bytes, pre-commit and commit time per epoch, restore time.

For each backend of ``BACKENDS`` (one entry per backend: how to open a fresh storage), each
keyed-state size (``--sizes``, MB) and each snapshot kind (full, incremental), a keyed
operator with ``--parallelism`` subtasks goes through ``--epochs`` epochs of the epoch
commit, through the backend's own verbs and the job master's own manifest code:

* **pre-commit**: every subtask writes its capture (``CheckpointStorage.pre_commit``), the
  subtasks in parallel threads as workers would. A full capture holds every key; an
  incremental one the keys changed since the last epoch (``--dirty`` of them; the first
  epoch is full).
* **commit**: ``ManifestBuilder`` assembles the manifest from the acks (file chains), the
  backend commits it (``commit``: the commit point), then retention and garbage collection
  run as after every job-master commit (``num_retained`` 1).
* **restore**: the newest checkpoint is found (``latest``) and every subtask reads its key
  groups' rows (``read_operator_rows``, sha256-verified) into ``HeapKeyedState``, the
  restore path of ``build_tasks``.

State values are random bytes (``--value-bytes`` each), so Parquet/zstd cannot shrink them
and the snapshot bytes track the state size. The S3 backend runs against moto's HTTP
server started in this process (``ThreadedMotoServer``): the numbers are the client's
costs plus a local in-memory server, not AWS's latency or bandwidth.

Writes ``benchmarks/results/backends.csv`` (one row per epoch, plus one ``restore`` row per
run; rewritten after every run, so an interrupted run keeps what it measured) and
``backends.png``; prints a progress line per epoch (with the elapsed time) and a summary table.
Each row carries the 1-minute load average when it was measured (``load1``): the machine is
shared, so read the numbers with it. Not a test.

    python benchmarks/state/backends.py [--sizes 10,100,1000] [--backends local,s3,delta,delta-s3] [--epochs 4]

The ``delta`` and ``delta-s3`` backends commit each epoch as the job master does (``commit``
writes the manifest, then ``commit_epoch`` makes the Delta MERGE through delta-rs, so "commit"
includes it) and restore as recovery does (``recover_epoch``: time travel to the recorded version
by delta-rs, then the rows); no Spark is involved any more (``--spark-driver-memory`` is kept for
older runs). ``delta-s3`` keeps checkpoints (boto3) and the Delta tables (delta-rs) in one bucket
of the moto server, which runs in this process: delta-rs keeps the GIL in some calls
(``alter.set_table_properties`` at table creation) and then stalls an in-process server, so
``delta-s3`` needs moto in another process to run now (not done here; tests/s3server.py has
``MotoS3Process``). Where a Delta commit's time goes is measured by timers around the backend's
steps (the ``delta_*_s`` columns): ``fold`` (read the epoch's state files and fold them to one row
per key), ``merge`` (the delta-rs MERGE transaction), ``history`` (reads of the Delta log) and,
on restore, ``time_travel`` (the table at the recorded version, as Arrow).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import pickle
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ContextManager, Iterator

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.harness import RESULTS, pyplot, write_csv  # noqa: E402
from epochstream.backends import CheckpointStorage, open_storage  # noqa: E402
from epochstream.backends.objects import encode_state  # noqa: E402
from epochstream.graph.keygroups import key_group_range  # noqa: E402
from epochstream.runtime.state import HeapKeyedState  # noqa: E402
from epochstream.snapshot.manifest import AckInfo, ManifestBuilder  # noqa: E402

MAX_PARALLELISM = 128
OPERATOR = "state"
KINDS = {"v": "value"}


# ---------------------------------------------------------------- the backends


@contextlib.contextmanager
def _local(label: str) -> Iterator[CheckpointStorage]:
    root = Path(tempfile.mkdtemp(prefix=f"bench-{label}-"))
    try:
        yield open_storage(str(root))
    finally:
        shutil.rmtree(root, ignore_errors=True)


_moto: dict[str, Any] = {}


def start_moto() -> str:
    """moto's S3 server in this process (once), and AWS_* pointed at it for boto3 and, if
    called before the Spark session starts, for S3A."""
    if "server" not in _moto:
        import logging
        import socket

        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        server.start()
        _moto.update(server=server, url=f"http://127.0.0.1:{port}")
        os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1",
                          AWS_ENDPOINT_URL=_moto["url"])
        for k in ("AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_SESSION_TOKEN"):
            os.environ.pop(k, None)
    return str(_moto["url"])


@contextlib.contextmanager
def _bucket(label: str) -> Iterator[str]:
    """A fresh bucket on the moto server, emptied and removed afterwards."""
    import boto3

    url = start_moto()
    bucket = f"bench-{label}".lower().replace("_", "-")[:60]
    client = boto3.client("s3", endpoint_url=url)
    client.create_bucket(Bucket=bucket)
    try:
        yield bucket
    finally:
        keys = [o["Key"] for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket)
                for o in page.get("Contents", [])]
        for i in range(0, len(keys), 1000):
            client.delete_objects(Bucket=bucket, Delete={"Objects": [{"Key": k} for k in keys[i:i + 1000]]})
        client.delete_bucket(Bucket=bucket)


@contextlib.contextmanager
def _s3(label: str) -> Iterator[CheckpointStorage]:
    with _bucket(label) as bucket:
        yield open_storage(f"s3://{bucket}/chk")


@contextlib.contextmanager
def _delta(label: str) -> Iterator[CheckpointStorage]:
    from epochstream.backends.delta import DeltaCheckpointStorage

    root = Path(tempfile.mkdtemp(prefix=f"bench-{label}-"))
    try:
        yield DeltaCheckpointStorage(str(root))
    finally:
        shutil.rmtree(root, ignore_errors=True)


@contextlib.contextmanager
def _delta_s3(label: str) -> Iterator[CheckpointStorage]:
    from epochstream.backends.delta import DeltaCheckpointStorage

    with _bucket(label) as bucket:
        yield DeltaCheckpointStorage(f"s3://{bucket}/chk")


@dataclass(frozen=True)
class Backend:
    """One row of the comparison: ``open(label)`` yields a fresh, empty checkpoint storage."""

    name: str
    open: Callable[[str], ContextManager[CheckpointStorage]]
    note: str


#: the backends compared; another backend is one more entry
BACKENDS: dict[str, Backend] = {
    "local": Backend("local", _local, "local filesystem (temporary folder), fsync on"),
    "s3": Backend("s3", _s3, "S3 API on moto's ThreadedMotoServer in this process"),
    "delta": Backend("delta", _delta, "local folder plus a Delta table of committed state (one MERGE per epoch, "
                                      "local Spark session local[2]; restore by time travel)"),
    "delta-s3": Backend("delta-s3", _delta_s3, "the delta backend with checkpoints and Delta table in one bucket of "
                                               "the moto server (Spark through S3A, single-driver log store)"),
}
#: backends that commit through Spark (the session is configured before it starts)
SPARK_BACKENDS = {"delta", "delta-s3"}
#: backends on the moto server (started before Spark, so S3A picks up its endpoint)
MOTO_BACKENDS = {"s3", "delta-s3"}


class DeltaTimers:
    """Seconds spent in the steps of a Delta commit and restore, accumulated between ``take``s.

    Wraps delta.py's steps (and the two Spark calls it makes) with timers; the wrapped code
    runs unchanged. Installed only when a Delta backend is measured.
    """

    STEPS = ("fold", "merge", "history", "time_travel")

    def __init__(self) -> None:
        self.acc = dict.fromkeys(self.STEPS, 0.0)
        self.installed = False

    def _timed(self, step: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.acc[step] += time.perf_counter() - t0

        return wrapper

    def install(self) -> None:
        if self.installed:
            return
        from epochstream.backends import delta

        cls = delta.DeltaCheckpointStorage
        cls._changes = self._timed("fold", cls._changes)  # type: ignore[method-assign]
        cls._read_table = staticmethod(self._timed("time_travel", cls._read_table))  # type: ignore[method-assign]
        # the state backend and the sink call tables.history: time it where they look it up
        delta.tables.history = self._timed("history", delta.tables.history)
        cls._merge = staticmethod(self._timed("merge", cls._merge))  # type: ignore[method-assign]
        self.installed = True

    def take(self) -> dict[str, Any]:
        """The step times since the last call (empty cells when no Delta backend ran)."""
        out = {f"delta_{k}_s": (round(v, 4) if self.installed else "") for k, v in self.acc.items()}
        self.acc = dict.fromkeys(self.STEPS, 0.0)
        return out


TIMERS = DeltaTimers()


def shutdown() -> None:
    if "server" in _moto:
        _moto.pop("server").stop()
    if "pyspark" in sys.modules:
        from epochstream.backends import spark_session

        spark_session.stop()


# ---------------------------------------------------------------- the workload


class State:
    """Keyed state of one operator: ``n`` keys, each a ``value_bytes`` random value, spread
    over key groups by subtask (key group ``i % MAX_PARALLELISM``)."""

    def __init__(self, n: int, value_bytes: int, parallelism: int) -> None:
        self.value_bytes = value_bytes
        self.parallelism = parallelism
        self.ranges = [key_group_range(MAX_PARALLELISM, parallelism, s) for s in range(parallelism)]
        self.keys = [pickle.dumps(f"key-{i}", protocol=4) for i in range(n)]
        self.kgs = [i % MAX_PARALLELISM for i in range(n)]
        self.subtask = [next(s for s, (lo, hi) in enumerate(self.ranges) if lo <= kg <= hi) for kg in self.kgs]
        self.values = [os.urandom(value_bytes) for _ in range(n)]

    def change(self, fraction: float, epoch: int) -> list[int]:
        """New values for a ``fraction`` of the keys (a different slice each epoch)."""
        n = len(self.keys)
        count = max(1, int(n * fraction))
        start = (epoch * count) % n
        idx = [(start + j) % n for j in range(count)]
        for i in idx:
            self.values[i] = os.urandom(self.value_bytes)
        return idx

    def rows(self, indices: Iterator[int] | list[int]) -> list[list[tuple[int, bytes, str, bytes]]]:
        """Rows per subtask for the given keys, as a capture produces them."""
        out: list[list[tuple[int, bytes, str, bytes]]] = [[] for _ in range(self.parallelism)]
        for i in indices:
            out[self.subtask[i]].append((self.kgs[i], self.keys[i], "v", pickle.dumps(self.values[i], protocol=4)))
        return out


def run_one(backend: Backend, size_mb: int, kind: str, epochs: int, dirty: float, value_bytes: int,
            parallelism: int, progress: Callable[[str], None]) -> list[dict[str, Any]]:
    n = max(parallelism, size_mb * 1_000_000 // value_bytes)
    state = State(n, value_bytes, parallelism)
    label = f"{backend.name}-{size_mb}-{kind}-{os.getpid()}"
    TIMERS.take()  # drop what set-up spent
    rows_out: list[dict[str, Any]] = []
    base = {"backend": backend.name, "state_mb": size_mb, "snapshot": kind, "keys": n, "parallelism": parallelism}
    job = {"job": "bench", "parallelism": parallelism, "max_parallelism": MAX_PARALLELISM, "mode": "aligned",
           "deployment": "bench"}
    with backend.open(label) as storage:
        storage.exists()  # warm-up outside the timings: a client, a connection
        builder = ManifestBuilder(job)
        chains: list[tuple[int, ...]] = [() for _ in range(parallelism)]
        retained: list[dict[str, Any]] = []
        for epoch in range(1, epochs + 1):
            full = kind == "full" or epoch == 1
            changed = range(n) if epoch == 1 else state.change(dirty, epoch)
            per_subtask = state.rows(range(n) if full else changed)
            refs: list[Any] = [None] * parallelism

            def write(s: int, refs=refs, epoch=epoch, rows=per_subtask, ranges=state.ranges, full=full) -> None:
                refs[s] = storage.pre_commit(OPERATOR, s, epoch, "bench", rows[s], ranges[s], full)

            gc.collect()
            t0 = time.perf_counter()
            threads = [threading.Thread(target=write, args=(s,)) for s in range(parallelism)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            pre_commit = time.perf_counter() - t0
            if any(r is None for r in refs):
                raise RuntimeError(f"{backend.name}: a pre-commit failed at epoch {epoch}")
            acks = {}
            for s in range(parallelism):
                chains[s] = (epoch,) if full else chains[s] + (epoch,)
                info = AckInfo((0, s), epoch, files=(refs[s],), chains={OPERATOR: chains[s]}, kinds={OPERATOR: KINDS},
                               bytes=refs[s].bytes)
                builder.record(info)
                acks[(0, s)] = info
            t0 = time.perf_counter()
            manifest = builder.build(epoch, "checkpoint", acks, {"created_at": "bench"})
            storage.commit(manifest)
            commit_state = getattr(storage, "commit_epoch", None)
            if commit_state is not None:  # Delta: the epoch's transaction, as the job master makes it
                commit_state(manifest)
            builder.completed(epoch, manifest)
            retained.append(manifest)
            while len(retained) > 1:
                storage.discard(int(retained.pop(0)["epoch"]))
            storage.collect_garbage(retained, keep_after=epoch)
            commit = time.perf_counter() - t0
            snap_bytes = sum(r.bytes for r in refs)
            steps = TIMERS.take()
            rows_out.append({**base, "epoch": epoch, "phase": "epoch", "full_capture": full,
                             "snapshot_bytes": snap_bytes, "rows_written": sum(len(r) for r in per_subtask),
                             "pre_commit_s": round(pre_commit, 4), "commit_s": round(commit, 4),
                             "restore_s": "", "restore_bytes": "", **steps, "load1": round(os.getloadavg()[0], 2)})
            progress(f"  {backend.name:<8} {size_mb:>5} MB {kind:<11} epoch {epoch}: {snap_bytes / 1e6:9.1f} MB "
                     f"pre-commit {pre_commit:7.3f}s commit {commit:7.3f}s{_steps_text(steps)}")
            del per_subtask
        del state
        gc.collect()
        TIMERS.take()
        t0 = time.perf_counter()
        manifest, root = storage.latest()
        recover_state = getattr(storage, "recover_epoch", None)
        if recover_state is not None:  # Delta: re-issue (a no-op) and read the state back by time travel
            recover_state(manifest, root)
        restored_keys = 0
        for s in range(parallelism):
            heap = HeapKeyedState(OPERATOR, lambda k: 0, key_group_range(MAX_PARALLELISM, parallelism, s))
            heap.restore_rows(storage.read_operator_rows(manifest, root, OPERATOR, heap.key_group_range), KINDS)
            restored_keys += sum(len(t.data) for t in heap.tables.values())
            del heap
        restore = time.perf_counter() - t0
        read = sum(f["bytes"] for f in manifest["operators"][OPERATOR]["files"])
        if restored_keys != n:
            raise RuntimeError(f"{backend.name}: restored {restored_keys} keys, expected {n}")
        steps = TIMERS.take()
        rows_out.append({**base, "epoch": manifest["epoch"], "phase": "restore", "full_capture": "",
                         "snapshot_bytes": "", "rows_written": "", "pre_commit_s": "", "commit_s": "",
                         "restore_s": round(restore, 4), "restore_bytes": read, **steps,
                         "load1": round(os.getloadavg()[0], 2)})
        progress(f"  {backend.name:<8} {size_mb:>5} MB {kind:<11} restore: {read / 1e6:9.1f} MB in {restore:7.3f}s"
                 f"{_steps_text(steps)}")
    return rows_out


def _steps_text(steps: dict[str, Any]) -> str:
    parts = [f"{k[6:-2]} {v:.1f}s" for k, v in steps.items() if v not in ("", 0.0)]
    return f" ({', '.join(parts)})" if parts else ""


# ---------------------------------------------------------------- report


def summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (backend, size, kind): first (full) epoch, mean of later epochs, restore."""
    out = []
    keys = sorted({(r["backend"], r["state_mb"], r["snapshot"]) for r in rows}, key=lambda k: (k[1], k[0], k[2]))
    for b, mb, kind in keys:
        mine = [r for r in rows if (r["backend"], r["state_mb"], r["snapshot"]) == (b, mb, kind)]
        eps = [r for r in mine if r["phase"] == "epoch"]
        rest = [r for r in mine if r["phase"] == "restore"]
        later = eps[1:] or eps

        def mean(field: str, xs: list[dict[str, Any]]) -> float:
            return sum(float(x[field]) for x in xs) / len(xs)

        entry = {
            "backend": b, "state_mb": mb, "snapshot": kind, "epochs": len(eps),
            "first_epoch_mb": eps[0]["snapshot_bytes"] / 1e6, "later_epoch_mb": mean("snapshot_bytes", later) / 1e6,
            "first_pre_commit_s": float(eps[0]["pre_commit_s"]), "later_pre_commit_s": mean("pre_commit_s", later),
            "commit_s": mean("commit_s", eps), "later_commit_s": mean("commit_s", later),
            "restore_s": float(rest[0]["restore_s"]) if rest else float("nan"),
            "restore_mb": rest[0]["restore_bytes"] / 1e6 if rest else float("nan"),
        }
        if b in SPARK_BACKENDS and eps[0].get("delta_merge_s", "") != "":  # where a Delta commit's time goes
            for step in DeltaTimers.STEPS:
                entry[f"{step}_s"] = mean(f"delta_{step}_s", later)
            entry["restore_time_travel_s"] = float(rest[0]["delta_time_travel_s"]) if rest else float("nan")
        out.append(entry)
    return out


def print_summary(table: list[dict[str, Any]]) -> None:
    print(f"\n{'backend':<8} {'state':>7} {'snapshot':<11} {'epochs':>6} {'epoch-1 MB':>10} {'later MB':>9} "
          f"{'pre-commit 1':>12} {'pre-commit n':>12} {'commit':>8} {'commit n':>8} {'restore':>8} {'read MB':>8}")
    for r in table:
        print(f"{r['backend']:<8} {r['state_mb']:>5}MB {r['snapshot']:<11} {r['epochs']:>6} "
              f"{r['first_epoch_mb']:>10.1f} "
              f"{r['later_epoch_mb']:>9.1f} {r['first_pre_commit_s']:>11.3f}s {r['later_pre_commit_s']:>11.3f}s "
              f"{r['commit_s']:>7.3f}s {r['later_commit_s']:>7.3f}s {r['restore_s']:>7.3f}s {r['restore_mb']:>8.1f}")
    delta_rows = [r for r in table if "merge_s" in r]
    if delta_rows:
        print(f"\nDelta commits, epochs after the first (mean s): {'commit':>8} {'fold':>7} "
              f"{'merge':>7} {'history':>7} | restore {'total':>7} {'time travel':>11}")
        for r in delta_rows:
            print(f"  {r['backend']:<8} {r['state_mb']:>5}MB {r['snapshot']:<11}{'':>17}{r['later_commit_s']:>8.2f} "
                  f"{r['fold_s']:>7.2f} {r['merge_s']:>7.2f} {r['history_s']:>7.2f} |"
                  f"{'':>8} {r['restore_s']:>7.2f} {r['restore_time_travel_s']:>11.2f}")
    by = {(r["backend"], r["state_mb"], r["snapshot"]): r for r in table}
    print()
    for (b, mb, kind), r in sorted(by.items()):
        if kind != "incremental" or (b, mb, "full") not in by:
            continue
        f = by[(b, mb, "full")]
        fewer = f['later_epoch_mb'] / max(r['later_epoch_mb'], 1e-9)
        print(f"{b} {mb} MB: incremental epochs write {fewer:.1f}x fewer "
              f"bytes and pre-commit {f['later_pre_commit_s'] / max(r['later_pre_commit_s'], 1e-9):.1f}x faster "
              f"than full ones; restore reads {r['restore_mb'] / max(f['restore_mb'], 1e-9):.2f}x the bytes and takes "
              f"{r['restore_s'] / max(f['restore_s'], 1e-9):.2f}x the time")
    for mb in sorted({k[1] for k in by}):
        for kind in ("full", "incremental"):
            for other in ("s3", "delta", "delta-s3"):
                if ("local", mb, kind) in by and (other, mb, kind) in by:
                    lo, s = by[("local", mb, kind)], by[(other, mb, kind)]
                    print(f"{other}/local at {mb} MB {kind}: pre-commit (epoch 1) "
                          f"{s['first_pre_commit_s'] / lo['first_pre_commit_s']:.1f}x, "
                          f"commit (epochs after the first) {s['later_commit_s'] / lo['later_commit_s']:.0f}x, "
                          f"restore {s['restore_s'] / lo['restore_s']:.1f}x")


COLORS = {"local": "tab:blue", "s3": "tab:orange", "delta": "tab:green", "delta-s3": "tab:red"}


def plot(table: list[dict[str, Any]], path: Path) -> None:
    plt = pyplot()

    fig, axes = plt.subplots(1, 4, figsize=(19, 4.4))
    series = sorted({(r["backend"], r["snapshot"]) for r in table})
    panels = (("later_epoch_mb", "snapshot MB per epoch (after the first)"),
              ("later_pre_commit_s", "pre-commit s per epoch (after the first)"),
              ("later_commit_s", "commit s per epoch after the first\n(manifest + retention; delta: + MERGE)"),
              ("restore_s", "restore s (latest checkpoint)"))
    for ax, (field, title) in zip(axes, panels, strict=True):
        for b, kind in series:
            pts = sorted((r["state_mb"], r[field]) for r in table if (r["backend"], r["snapshot"]) == (b, kind))
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o" if kind == "full" else "s",
                    linestyle="-" if kind == "full" else "--", color=COLORS.get(b), label=f"{b} {kind}")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("keyed state (MB)")
        ax.set_title(title, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("Checkpoint backends: epoch commit and restore by state size", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="10,100,1000", help="keyed state sizes in MB, comma-separated")
    ap.add_argument("--backends", default=",".join(BACKENDS), help=f"comma-separated, from {sorted(BACKENDS)}")
    ap.add_argument("--snapshots", default="full,incremental")
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--epochs-large", type=int, default=None,
                    help="epochs for states of --large-mb and more (default: --epochs), to fit a time budget")
    ap.add_argument("--large-mb", type=int, default=1000)
    ap.add_argument("--spark-driver-memory", default="6g",
                    help="spark.driver.memory of the local Spark session of the Delta backends (default 6g)")
    ap.add_argument("--dirty", type=float, default=0.1, help="fraction of keys changed per epoch (default 0.1)")
    ap.add_argument("--value-bytes", type=int, default=4096)
    ap.add_argument("--parallelism", type=int, default=2)
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--name", default="backends", help="file name of the CSV and PNG (default backends)")
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s]
    names = [b for b in args.backends.split(",") if b]
    unknown = sorted(set(names) - set(BACKENDS))
    if unknown:
        ap.error(f"unknown backend(s) {unknown}; known: {sorted(BACKENDS)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    csv_path = out / f"{args.name}.csv"
    rows: list[dict[str, Any]] = []
    load_start = _uptime()
    print(f"load at start: {load_start}", flush=True)
    encode_state([(0, b"k", "v", b"x")])  # warm-up outside the timings: pyarrow's Parquet writer, zstd
    if MOTO_BACKENDS & set(names):
        start_moto()  # before Spark: S3A reads the endpoint when the session starts
    if SPARK_BACKENDS & set(names):
        from epochstream.backends import spark_session

        spark_session.configure({"spark.driver.memory": args.spark_driver_memory, "spark.driver.maxResultSize": "0"})
        TIMERS.install()
    t_start = time.perf_counter()
    runs = [(mb, b, kind) for mb in sizes for b in names for kind in args.snapshots.split(",")]

    def progress(line: str) -> None:
        print(f"[{time.perf_counter() - t_start:6.0f}s] {line}", flush=True)

    try:
        for i, (mb, b, kind) in enumerate(runs, 1):
            epochs = args.epochs if args.epochs_large is None or mb < args.large_mb else args.epochs_large
            progress(f"[{i}/{len(runs)}] {b} {mb} MB {kind}, {epochs} epochs (load {os.getloadavg()[0]:.2f})")
            rows += run_one(BACKENDS[b], mb, kind, epochs, args.dirty, args.value_bytes, args.parallelism, progress)
            write_csv(csv_path, rows)  # after every run: an interrupted run keeps its rows
    finally:
        shutdown()
    table = summary(rows)
    print_summary(table)
    plot(table, out / f"{args.name}.png")
    print("\nbackends: " + "; ".join(f"{b}: {BACKENDS[b].note}" for b in names))
    print(f"load at start: {load_start}\nload at end:   {_uptime()}")
    print(f"wrote {csv_path} and {out / (args.name + '.png')} in {time.perf_counter() - t_start:.0f}s")
    return 0


def _uptime() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{time.strftime('%H:%M:%S', time.gmtime())} UTC load average {one:.2f}, {five:.2f}, {fifteen:.2f}"


if __name__ == "__main__":
    sys.exit(main())
