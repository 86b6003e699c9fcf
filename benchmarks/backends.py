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
run) and ``backends.png``; prints a summary table. Not a test.

    python benchmarks/backends.py [--sizes 10,100,1000] [--backends local,s3,delta] [--epochs 4]

The ``delta`` backend commits each epoch as the job master does (``commit`` writes the manifest,
then ``commit_epoch`` makes the Delta MERGE, so "commit" includes it) and restores as recovery
does (``recover_epoch``: time travel to the recorded version, then the rows); it needs the jars
of ``scripts/setup.sh``. ``--name backends_delta`` keeps its results apart from the S3 run's.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
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

HERE = Path(__file__).resolve().parent

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


@contextlib.contextmanager
def _s3(label: str) -> Iterator[CheckpointStorage]:
    import logging

    import boto3
    from moto.server import ThreadedMotoServer

    if "server" not in _moto:
        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        server.start()
        _moto.update(server=server, url=f"http://127.0.0.1:{port}")
        os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1",
                          AWS_ENDPOINT_URL=_moto["url"])
    bucket = f"bench-{label}".lower().replace("_", "-")[:60]
    client = boto3.client("s3", endpoint_url=_moto["url"])
    client.create_bucket(Bucket=bucket)
    try:
        yield open_storage(f"s3://{bucket}/chk")
    finally:
        keys = [o["Key"] for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket)
                for o in page.get("Contents", [])]
        for i in range(0, len(keys), 1000):
            client.delete_objects(Bucket=bucket, Delete={"Objects": [{"Key": k} for k in keys[i:i + 1000]]})
        client.delete_bucket(Bucket=bucket)


@contextlib.contextmanager
def _delta(label: str) -> Iterator[CheckpointStorage]:
    from epochstream.backends.delta import DeltaCheckpointStorage

    root = Path(tempfile.mkdtemp(prefix=f"bench-{label}-"))
    try:
        yield DeltaCheckpointStorage(str(root))
    finally:
        shutil.rmtree(root, ignore_errors=True)


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
}


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

            def write(s: int) -> None:
                refs[s] = storage.pre_commit(OPERATOR, s, epoch, "bench", per_subtask[s], state.ranges[s], full)

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
            rows_out.append({**base, "epoch": epoch, "phase": "epoch", "full_capture": full,
                             "snapshot_bytes": snap_bytes, "rows_written": sum(len(r) for r in per_subtask),
                             "pre_commit_s": round(pre_commit, 4), "commit_s": round(commit, 4),
                             "restore_s": "", "restore_bytes": ""})
            progress(f"  {backend.name:<6} {size_mb:>5} MB {kind:<11} epoch {epoch}: {snap_bytes / 1e6:9.1f} MB "
                     f"pre-commit {pre_commit:7.3f}s commit {commit:6.3f}s")
            del per_subtask
        del state
        gc.collect()
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
        rows_out.append({**base, "epoch": manifest["epoch"], "phase": "restore", "full_capture": "",
                         "snapshot_bytes": "", "rows_written": "", "pre_commit_s": "", "commit_s": "",
                         "restore_s": round(restore, 4), "restore_bytes": read})
        progress(f"  {backend.name:<6} {size_mb:>5} MB {kind:<11} restore: {read / 1e6:9.1f} MB in {restore:7.3f}s")
    return rows_out


# ---------------------------------------------------------------- report


def summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (backend, size, kind): first (full) epoch, mean of later epochs, restore."""
    out = []
    keys = sorted({(r["backend"], r["state_mb"], r["snapshot"]) for r in rows}, key=lambda k: (k[1], k[0], k[2]))
    for b, mb, kind in keys:
        eps = [r for r in rows if (r["backend"], r["state_mb"], r["snapshot"]) == (b, mb, kind) and r["phase"] == "epoch"]
        rest = [r for r in rows if (r["backend"], r["state_mb"], r["snapshot"]) == (b, mb, kind) and r["phase"] == "restore"]
        later = eps[1:] or eps

        def mean(field: str, xs: list[dict[str, Any]]) -> float:
            return sum(float(x[field]) for x in xs) / len(xs)

        out.append({
            "backend": b, "state_mb": mb, "snapshot": kind,
            "first_epoch_mb": eps[0]["snapshot_bytes"] / 1e6, "later_epoch_mb": mean("snapshot_bytes", later) / 1e6,
            "first_pre_commit_s": float(eps[0]["pre_commit_s"]), "later_pre_commit_s": mean("pre_commit_s", later),
            "commit_s": mean("commit_s", eps), "restore_s": float(rest[0]["restore_s"]) if rest else float("nan"),
            "restore_mb": rest[0]["restore_bytes"] / 1e6 if rest else float("nan"),
        })
    return out


def print_summary(table: list[dict[str, Any]]) -> None:
    print(f"\n{'backend':<7} {'state':>7} {'snapshot':<11} {'epoch-1 MB':>10} {'later MB':>9} {'pre-commit 1':>12} "
          f"{'pre-commit n':>12} {'commit':>8} {'restore':>8} {'read MB':>8}")
    for r in table:
        print(f"{r['backend']:<7} {r['state_mb']:>5}MB {r['snapshot']:<11} {r['first_epoch_mb']:>10.1f} "
              f"{r['later_epoch_mb']:>9.1f} {r['first_pre_commit_s']:>11.3f}s {r['later_pre_commit_s']:>11.3f}s "
              f"{r['commit_s']:>7.3f}s {r['restore_s']:>7.3f}s {r['restore_mb']:>8.1f}")
    by = {(r["backend"], r["state_mb"], r["snapshot"]): r for r in table}
    print()
    for (b, mb, kind), r in sorted(by.items()):
        if kind != "incremental" or (b, mb, "full") not in by:
            continue
        f = by[(b, mb, "full")]
        print(f"{b} {mb} MB: incremental epochs write {f['later_epoch_mb'] / max(r['later_epoch_mb'], 1e-9):.1f}x fewer "
              f"bytes and pre-commit {f['later_pre_commit_s'] / max(r['later_pre_commit_s'], 1e-9):.1f}x faster "
              f"than full ones; restore reads {r['restore_mb'] / max(f['restore_mb'], 1e-9):.2f}x the bytes and takes "
              f"{r['restore_s'] / max(f['restore_s'], 1e-9):.2f}x the time")
    for mb in sorted({k[1] for k in by}):
        for kind in ("full", "incremental"):
            for other in ("s3", "delta"):
                if ("local", mb, kind) in by and (other, mb, kind) in by:
                    l, s = by[("local", mb, kind)], by[(other, mb, kind)]
                    print(f"{other}/local at {mb} MB {kind}: pre-commit (epoch 1) "
                          f"{s['first_pre_commit_s'] / l['first_pre_commit_s']:.1f}x, "
                          f"commit {s['commit_s'] / l['commit_s']:.1f}x, restore {s['restore_s'] / l['restore_s']:.1f}x")


def plot(table: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(19, 4.4))
    series = sorted({(r["backend"], r["snapshot"]) for r in table})
    panels = (("later_epoch_mb", "snapshot MB per epoch (after the first)"),
              ("later_pre_commit_s", "pre-commit s per epoch (after the first)"),
              ("commit_s", "commit s per epoch (manifest + retention; delta: + MERGE)"),
              ("restore_s", "restore s (latest checkpoint)"))
    for ax, (field, title) in zip(axes, panels):
        for b, kind in series:
            pts = sorted((r["state_mb"], r[field]) for r in table if (r["backend"], r["snapshot"]) == (b, kind))
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", linestyle="-" if b == "local" else "--",
                    label=f"{b} {kind}")
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
    ap.add_argument("--dirty", type=float, default=0.1, help="fraction of keys changed per epoch (default 0.1)")
    ap.add_argument("--value-bytes", type=int, default=4096)
    ap.add_argument("--parallelism", type=int, default=2)
    ap.add_argument("--out", default=str(HERE / "results"))
    ap.add_argument("--name", default="backends", help="file name of the CSV and PNG (default backends)")
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s]
    names = [b for b in args.backends.split(",") if b]
    unknown = sorted(set(names) - set(BACKENDS))
    if unknown:
        ap.error(f"unknown backend(s) {unknown}; known: {sorted(BACKENDS)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    encode_state([(0, b"k", "v", b"x")])  # warm-up outside the timings: pyarrow's Parquet writer, zstd
    t_start = time.perf_counter()
    runs = [(mb, b, kind) for mb in sizes for b in names for kind in args.snapshots.split(",")]
    try:
        for i, (mb, b, kind) in enumerate(runs, 1):
            print(f"[{i}/{len(runs)}] {b} {mb} MB {kind} ({time.perf_counter() - t_start:.0f}s so far)", flush=True)
            rows += run_one(BACKENDS[b], mb, kind, args.epochs, args.dirty, args.value_bytes, args.parallelism,
                            lambda s: print(s, flush=True))
    finally:
        shutdown()
    with open(out / f"{args.name}.csv", "w", newline="") as f:
        wr = csv.DictWriter(f, fieldnames=list(rows[0]))
        wr.writeheader()
        wr.writerows(rows)
    table = summary(rows)
    print_summary(table)
    plot(table, out / f"{args.name}.png")
    print(f"\nbackends: " + "; ".join(f"{b}: {BACKENDS[b].note}" for b in names))
    print(f"wrote {out / (args.name + '.csv')} and {out / (args.name + '.png')} in {time.perf_counter() - t_start:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
