"""The ``epochstream`` command line: run jobs, inspect checkpoints, run chaos checks.

Pipelines are named as ``FILE.py:FUNCTION``: a Python file and a function in it that
returns a ``Pipeline``; flags override the pipeline's own settings. ``--json`` prints one
JSON document on stdout (logs go to stderr).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import random
import sys
import tempfile
import time
from enum import StrEnum
from pathlib import Path
from typing import Any, Callable

from .chaos.kills import KillMoment, KillTarget
from .runtime.modes import SnapshotMode

EXIT_OK, EXIT_VIOLATION, EXIT_USAGE, EXIT_FAILED = 0, 1, 2, 3
#: chaos: the oracle found nothing, but failures asked for did not land or caused no failover
EXIT_NOT_INJECTED = 4


def _kill_window(text: str) -> tuple[float, float]:
    """``--kill-window START,END``: two fractions, 0 <= START < END."""
    try:
        start, end = (float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected START,END (two numbers), got {text!r}") from None
    if not 0 <= start < end:
        raise argparse.ArgumentTypeError(f"needs 0 <= START < END, got {text!r}")
    return start, end


class UsageError(ValueError):
    """Bad command-line input (exit code 2)."""


#: Flink's upper bound of max parallelism (key groups): ``KeyGroupRangeAssignment.UPPER_BOUND_MAX_PARALLELISM``
MAX_PARALLELISM_BOUND = 32768


def _choice_list(choices: type[StrEnum], what: str) -> Callable[[str], list[StrEnum]]:
    """An argparse ``type``: a comma-separated list of ``choices``' values, checked at parse time
    (usage error, exit 2), as ``choices=`` checks one value."""
    values = [c.value for c in choices]

    def parse(text: str) -> list[StrEnum]:
        words = [w for w in text.split(",") if w]
        bad = [w for w in words if w not in values]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown {what} {bad[0]!r} (one of {', '.join(values)})")
        return [choices(w) for w in words]

    parse.__name__ = f"{what} list"  # argparse names the type in its messages
    return parse


def _number(kind: type, low: float, high: float | None = None, low_open: bool = False) -> Callable[[str], Any]:
    """An argparse ``type`` that parses ``kind`` and checks its range at parse time (usage error, exit 2)."""
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        if value != value or value in (float("inf"), float("-inf")):
            raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
        if value < low or (low_open and value == low) or (high is not None and value > high):
            bound = f"> {low:g}" if low_open else f">= {low:g}"
            raise argparse.ArgumentTypeError(
                f"{text!r} is out of range: must be {bound}" + (f" and <= {high:g}" if high is not None else ""))
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its messages
    return parse


def load_pipeline_factory(spec: str) -> Callable[[], Any]:
    """``path/to/file.py:function`` -> the function (called to build a fresh Pipeline)."""
    if ":" not in spec:
        raise UsageError(f"expected FILE.py:FUNCTION, got {spec!r}")
    path, func = spec.rsplit(":", 1)
    file = Path(path)
    if not file.is_file():
        raise UsageError(f"no such file: {path}")
    mod_spec = importlib.util.spec_from_file_location(f"_epochstream_job_{file.stem}", file)
    if mod_spec is None or mod_spec.loader is None:  # e.g. a suffix Python does not import
        raise UsageError(f"{path} cannot be imported as a Python module")
    module = importlib.util.module_from_spec(mod_spec)
    sys.path.insert(0, str(file.parent.resolve()))
    mod_spec.loader.exec_module(module)
    factory = getattr(module, func, None)
    if not callable(factory):
        raise UsageError(f"{path} has no function {func!r}")
    return factory


def _configured(factory: Callable[[], Any], args) -> Callable[[], Any]:
    """Wrap a factory so every pipeline it builds carries the command-line overrides."""
    from dataclasses import replace

    from .api.pipeline import Pipeline
    from .graph.keygroups import check_parallelism, default_max_parallelism

    def build():
        p = factory()
        if not isinstance(p, Pipeline):
            shown = repr(p)
            shown = shown if len(shown) <= 80 else shown[:77] + "..."
            raise UsageError(f"{args.pipeline} returned {type(p).__name__} {shown}, not a Pipeline "
                             f"(the function must build and return an epochstream Pipeline)")
        if args.mode:  # one of SnapshotMode's values (argparse checks the choice)
            p.mode = args.mode
        if args.parallelism is not None:
            p.parallelism = args.parallelism
        if args.max_parallelism is not None:
            p.max_parallelism = args.max_parallelism
        check_parallelism(p.parallelism, p.max_parallelism or default_max_parallelism(p.parallelism))
        if args.interval is not None:
            p.checkpoint = replace(p.checkpoint, interval=args.interval if args.interval > 0 else None)
        if getattr(args, "restart_strategy", None):
            from .deploy.restart import parse_restart_strategy

            p.restart_strategy = parse_restart_strategy(args.restart_strategy)
        if getattr(args, "state_backend", None):
            p.checkpoint = replace(p.checkpoint, state_backend=args.state_backend)
        if getattr(args, "delta_compact_every", None) is not None:
            p.checkpoint = replace(p.checkpoint, delta_compact_every=args.delta_compact_every)
        if getattr(args, "state_backend_type", None):
            p.checkpoint = replace(p.checkpoint, state_backend_type=args.state_backend_type)
        if getattr(args, "rocksdb_dir", None):
            p.checkpoint = replace(p.checkpoint, rocksdb_dir=args.rocksdb_dir)
        if getattr(args, "rocksdb_memory_mb", None) is not None:
            p.checkpoint = replace(p.checkpoint, rocksdb_memory_mb=args.rocksdb_memory_mb)
        if getattr(args, "incremental", None) is not None:
            p.checkpoint = replace(p.checkpoint, incremental=args.incremental)
        if getattr(args, "batch_rows", None) is not None:
            p.batch_rows = args.batch_rows
        if getattr(args, "batch_linger", None) is not None:
            p.batch_linger = args.batch_linger
        if getattr(args, "slot_wait_timeout", None) is not None:
            p.slot_wait_timeout = args.slot_wait_timeout
        if getattr(args, "buffer_debloat_target", None) is not None:
            p.buffer_debloat_target = args.buffer_debloat_target or None
        if getattr(args, "aligned_timeout", None) is not None:
            if not p.mode.implies.times_out_alignment:
                raise UsageError(f"--aligned-timeout needs --mode aligned or unaligned, not '{p.mode}'")
            p.aligned_timeout = args.aligned_timeout
        if (getattr(args, "heartbeat_interval", None) or getattr(args, "heartbeat_timeout", None)
                or getattr(args, "heartbeat_step_timeout", None)):
            from .deploy.liveness import HeartbeatConfig
            from .runtime.errors import ConfigurationError

            try:
                p.heartbeat = HeartbeatConfig(args.heartbeat_interval or p.heartbeat.interval,
                                              args.heartbeat_timeout or p.heartbeat.timeout,
                                              p.heartbeat.startup_timeout,
                                              getattr(args, "heartbeat_step_timeout", None) or p.heartbeat.step_timeout)
            except ConfigurationError as exc:
                raise UsageError(f"--heartbeat-interval/--heartbeat-timeout/--heartbeat-step-timeout: {exc}") from None
        return p

    return build


def _batch_rows(text: str) -> int:
    """``--batch-rows``: an integer >= 1 (argparse reports anything else as a usage error)."""
    try:
        rows = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number of rows >= 1, got {text!r}") from None
    if rows < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1 row, got {rows}")
    return rows


def _batch_linger(text: str) -> float:
    """``--batch-linger``: seconds >= 0 (``0.005`` is 5 ms)."""
    try:
        seconds = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds (e.g. 0.005), got {text!r}") from None
    if not (seconds >= 0 and seconds != float("inf")):
        raise argparse.ArgumentTypeError(f"must be >= 0 seconds and finite, got {text}")
    return seconds


def _add_run_flags(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("pipeline", metavar="FILE.py:FUNCTION", help="a function that returns a Pipeline")
    ap.add_argument("--deployment", choices=["sim", "local", "spark"], default="local",
                    help="where to run (default: local; spark: one barrier task per worker)")
    ap.add_argument("--heartbeat-interval", type=float, metavar="SECONDS",
                    help="local/spark: seconds between worker heartbeats (heartbeat.interval, default 1)")
    ap.add_argument("--heartbeat-timeout", type=float, metavar="SECONDS",
                    help="local/spark: a worker silent this long is declared failed and the job fails over "
                         "(heartbeat.timeout, default 10)")
    ap.add_argument("--heartbeat-step-timeout", type=float, metavar="SECONDS",
                    help="local/spark: a worker whose loop has been inside one task step this long (a user function "
                         "that does not return) is declared failed (default 120)")
    ap.add_argument("--master", help="spark: the Spark master, e.g. local[4,3], local-cluster[2,1,1024], "
                                     "spark://host:7077 (default local[*])")
    ap.add_argument("--spark-conf", action="append", default=[], metavar="KEY=VALUE",
                    help="spark: a Spark setting for the session (repeatable)")
    ap.add_argument("--slot-wait-timeout", type=_number(float, 0), metavar="SECONDS",
                    help="spark: seconds an attempt waits, with the status WAITING_FOR_SLOTS, for the cluster to "
                         "offer its parallelism in barrier task slots before the job fails (0: fail at once; "
                         "like Flink's slot.request.timeout; default 300)")
    ap.add_argument("--aligned-timeout", type=_number(float, 0), metavar="SECONDS",
                    help="epochs start aligned; a task whose epoch waits longer (from the first marker it sees "
                         "queued) switches to unaligned for that epoch (Flink's "
                         "execution.checkpointing.aligned-checkpoint-timeout; --mode aligned or unaligned)")
    ap.add_argument("--mode", metavar="MODE", choices=[m.value for m in SnapshotMode],
                    help="one of: aligned, tracker, unaligned, at-least-once (aligned: barrier alignment, the "
                         "default; tracker: trAcker firm bounds; unaligned: markers overtake queued records, "
                         "stored as channel state; all three exactly-once)")
    ap.add_argument("--parallelism", "-p", type=_number(int, 1), help="number of workers (>= 1)")
    ap.add_argument("--max-parallelism", type=_number(int, 1, MAX_PARALLELISM_BOUND),
                    help=f"number of key groups, >= parallelism and <= {MAX_PARALLELISM_BOUND} (fixed once state "
                         f"exists)")
    ap.add_argument("--checkpoint-dir", help="where checkpoints go (default: a new temporary directory)")
    ap.add_argument("--interval", type=_number(float, 0), help="seconds between epochs (0: only the final epoch)")
    ap.add_argument("--batch-rows", type=_batch_rows, metavar="N",
                    help="rows a source reads at once and a full output batch holds (default 1024)")
    ap.add_argument("--batch-linger", type=_batch_linger, metavar="SECONDS",
                    help="seconds output may wait to fill up to --batch-rows rows before it is sent (default 0: "
                         "sent at every step); an epoch bound always sends it")
    ap.add_argument("--buffer-debloat-target", type=_number(float, 0), metavar="SECONDS",
                    help="local/spark: sources pause while a worker holds more rows than its operators get "
                         "through in this many seconds (buffer debloating; default 1; 0: off, only message counts "
                         "bound the data in flight)")
    ap.add_argument("--state-backend", choices=["files", "delta"],
                    help="committed keyed state: snapshot files only (default) or also a Delta table per operator")
    ap.add_argument("--delta-compact-every", type=_number(int, 0), metavar="N",
                    help="with --state-backend delta: compact a state table (its changelog) in the background once "
                         "it holds N epochs since the last compaction (default 10, 0: never)")
    ap.add_argument("--state-backend-type", choices=["hashmap", "rocksdb"],
                    help="where the running job keeps keyed state (Flink's state.backend.type): Python dicts "
                         "(hashmap, default) or a local RocksDB per keyed operator subtask (rocksdb: larger "
                         "than memory)")
    ap.add_argument("--rocksdb-dir", metavar="DIR",
                    help="with --state-backend-type rocksdb: local directory of the DBs (default: the temp dir)")
    ap.add_argument("--rocksdb-memory-mb", type=_number(int, 8), metavar="MB",
                    help="with --state-backend-type rocksdb: memory bound of each keyed operator subtask's DB "
                         "(block cache + write buffers; default 64)")
    ap.add_argument("--incremental", action=argparse.BooleanOptionalAction, default=None,
                    help="incremental checkpoints (default on): hashmap writes the keys changed since the last "
                         "capture, rocksdb uploads only new SST files and shares the rest between checkpoints; "
                         "--no-incremental writes every capture in full")
    ap.add_argument("--seed", type=int, default=0, help="seed of the simulator's schedule and of chaos")
    ap.add_argument("--duration", type=_number(float, 0, low_open=True),
                    help="stop after this many seconds with a final epoch (> 0)")
    ap.add_argument("--json", action="store_true", help="print a JSON document instead of text")


def _spark_options(args) -> dict[str, Any]:
    """Driver options of --deployment spark (nothing for the other deployments)."""
    if args.deployment != "spark":
        if args.master or args.spark_conf or getattr(args, "slot_wait_timeout", None) is not None:
            raise UsageError("--master, --spark-conf and --slot-wait-timeout need --deployment spark")
        return {}
    conf = {}
    for item in args.spark_conf:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UsageError(f"--spark-conf expects KEY=VALUE, got {item!r}")
        conf[key] = value
    from .deploy.spark import spark_session

    if getattr(args, "state_backend", None) == "delta":  # the job master commits through this session
        from .backends.spark_session import delta_conf

        conf = {**delta_conf(), **conf}
    session = spark_session(args.master or "local[*]", conf)
    _SESSIONS.append(session)
    return {"spark": session}


#: SparkSessions this command started; stopped before it exits
_SESSIONS: list[Any] = []


def cmd_run(args) -> int:
    from .runtime.errors import EpochStreamError
    from .snapshot.manifest import CheckpointError

    if args.restore and args.from_savepoint:
        raise UsageError("give --restore or --from-savepoint, not both")
    if args.stop_with_savepoint and not args.savepoint_dir:
        raise UsageError("--stop-with-savepoint needs --savepoint-dir")
    build = _configured(load_pipeline_factory(args.pipeline), args)
    options = _spark_options(args)
    p = build()
    extra: dict[str, Any] = {"savepoint_dir": args.savepoint_dir, "stop_with_savepoint": args.stop_with_savepoint,
                             "allow_sources_from_start": args.allow_sources_from_start}
    status_line = _status_line("run", args)
    if args.deployment in ("local", "spark"):
        def started(info: dict[str, Any]) -> None:
            print(f"epochstream: job {info['name']!r} is running as {info['id']}; REST API and dashboard at "
                  f"{info['endpoint']}", file=sys.stderr, flush=True)
            if status_line is not None:
                status_line.on_start(info)

        extra.update(rest_port=args.rest_port or 0, on_start=started)
    try:
        result = p.run(
            deployment=args.deployment,
            checkpoint_dir=args.checkpoint_dir,
            restore=args.restore or args.from_savepoint,
            seed=args.seed,
            allow_non_restored_state=args.allow_non_restored_state,
            duration=args.duration,
            **extra,
            **options,
        )
    except CheckpointError as exc:  # a checkpoint that cannot be used is bad input
        _close(status_line)
        print(f"epochstream: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except EpochStreamError as exc:  # JobFailedError included: the restart strategy gave up
        _close(status_line)
        print(f"epochstream: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except BaseException:
        _close(status_line)
        raise
    _close(status_line, result)
    doc = result.to_json()
    doc["sinks"] = {uid: str(getattr(s, "path", s)) for uid, s in p.sinks.items()}
    if args.json:
        print(json.dumps(doc, indent=1))
    else:
        print(f"job {result.job!r} finished in {result.seconds:.2f}s: {result.records_in} records read, "
              f"{len(result.completed_epochs)} epochs completed, {result.restarts} restarts")
        print(f"  committed output: {', '.join(doc['sinks'].values()) or '(no sinks)'}")
        print(f"  checkpoints:      {result.checkpoint_dir} (latest: {result.latest_checkpoint})")
        for sp in result.savepoints:
            print(f"  savepoint:        {sp}")
    return EXIT_OK


def _status_line(label: str, args):
    """The live status line (``ui.progress``) on a terminal, None with ``--json`` or off one
    (and for the simulator, which has no HTTP server to read)."""
    if args.deployment not in ("local", "spark"):
        return None
    from .ui.progress import StatusLine, wanted

    return StatusLine(label) if wanted(args.json) else None


def _close(line, result=None) -> None:
    """End a status line, with a finished job's own counts (it may end between two polls)."""
    if line is None:
        return
    from .ui.progress import finished

    line.close(finished(result) if result is not None else None)


def cmd_checkpoints_list(args) -> int:
    from .backends import open_storage
    from .snapshot.manifest import CheckpointError
    from .snapshot.manifest_view import ManifestView

    storage = open_storage(args.checkpoint_dir)
    if not storage.exists():
        print(f"epochstream: checkpoint dir {storage.root} does not exist", file=sys.stderr)
        return EXIT_USAGE
    rows = []
    for epoch in storage.list_checkpoints():
        try:
            m = ManifestView.of(storage.load_manifest(epoch)[0])
        except CheckpointError as exc:
            rows.append({"epoch": epoch, "path": str(storage.checkpoint_dir(epoch)), "status": "damaged",
                         "error": str(exc)})
            continue
        files = m.state_files
        rows.append({
            "epoch": epoch,
            "path": str(storage.checkpoint_dir(epoch)),
            "status": "completed",
            "kind": m.kind,
            "job": m.job,
            "created_at": m.created_at,
            "parallelism": m.parallelism,
            "max_parallelism": m.max_parallelism,
            "mode": m.mode,
            "state_files": len(files),
            # what the checkpoint refers to (shared SST files included), and what its epoch uploaded
            "state_bytes": sum(f.bytes + sum(s.bytes for s in f.shared) for f in files),
            "uploaded_bytes": sum(f.written for f in files),
            "shared_sst_files": sum(len(f.shared) for f in files),
            "incremental_files": sum(1 for f in files if not f.full),
            "staged_outputs": sum(len(s) for s in m.staged.values()),
            "sources": {u: {str(k): v for k, v in s.offsets.items()} for u, s in m.sources.items()},
            "metrics": dict(m.metrics),
        })
    if args.json:
        print(json.dumps({"checkpoint_dir": str(storage.root), "checkpoints": rows}, indent=1))
        return EXIT_OK
    if not rows:
        print(f"no checkpoints in {storage.root}")
        return EXIT_OK
    print(f"{'epoch':>6}  {'status':<9} {'kind':<10} {'files':>5} {'bytes':>10}  created")
    for r in rows:
        print(f"{r['epoch']:>6}  {r['status']:<9} {r.get('kind') or '-':<10} {r.get('state_files', 0):>5} "
              f"{r.get('state_bytes', 0):>10}  {r.get('created_at') or r.get('error', '')}")
    return EXIT_OK


def cmd_list(args) -> int:
    """``list [--prune]``: jobs in the registry, running or dead (pid and lease check)."""
    from .deploy import jobs

    pruned = jobs.prune() if args.prune else []
    rows = jobs.listed()
    if args.json:
        print(json.dumps({"jobs": rows, "pruned": [j["id"] for j in pruned]}, indent=1))
        return EXIT_OK
    for j in pruned:
        print(f"pruned dead job {j.get('name')!r} ({j['id']}, pid {j.get('pid')})")
    if not rows:
        print(f"no jobs registered in {jobs.home() / 'jobs'}")
    for j in rows:
        print(f"{j['id']}  {j['status']:<8} {j.get('name')!r:<24} pid {j.get('pid')}  {j.get('endpoint', '-')}  "
              f"{j.get('checkpoint_dir') or ''}")
    dead = sum(1 for j in rows if j["status"] == "dead")
    if dead:
        print(f"{dead} dead job(s): their processes are gone; epochstream list --prune removes them")
    return EXIT_OK


def _client(target: str):
    from .deploy.jobs import JobNotFoundError, resolve, token_for
    from .deploy.rest import RestClient, RestError

    try:
        endpoint, job_id = resolve(target)
        client = RestClient(endpoint, token=token_for(endpoint))
        return client, job_id or client.job_id()
    except (JobNotFoundError, RestError) as exc:
        raise UsageError(str(exc)) from None


def _savepoint_outcome(doc: dict[str, Any], args, verb: str) -> int:
    ok = doc["status"]["id"] == "COMPLETED"
    if args.json:
        print(json.dumps(doc, indent=1))
    elif ok:
        print(f"{verb}: {doc['operation'].get('location')}")
    else:
        print(f"epochstream: {verb} failed: {doc['operation'].get('failure-cause', {}).get('stack-trace')}",
              file=sys.stderr)
    return EXIT_OK if ok else EXIT_FAILED


def cmd_savepoint(args) -> int:
    """``savepoint JOB_OR_ENDPOINT [DIR]``, ``savepoint dispose PATH``, ``savepoint list [DIR]``."""
    from .backends import location
    from .backends.savepoint import dispose_savepoint, list_savepoints
    from .deploy.rest import RestError

    words = args.words
    if words[0] == "dispose":
        if len(words) != 2:
            raise UsageError("usage: epochstream savepoint dispose PATH")
        folder = dispose_savepoint(words[1])
        print(json.dumps({"disposed": str(folder)}) if args.json else f"disposed savepoint {folder}")
        return EXIT_OK
    if words[0] == "list":
        if len(words) > 2:
            raise UsageError("usage: epochstream savepoint list [DIR]")
        folder = words[1] if len(words) == 2 else args.savepoint_dir or os.environ.get("EPOCHSTREAM_SAVEPOINT_DIR")
        if not folder:
            raise UsageError("savepoint list needs a directory: DIR, --savepoint-dir or EPOCHSTREAM_SAVEPOINT_DIR")
        rows = list_savepoints(folder)
        if args.json:
            print(json.dumps({"savepoint_dir": str(location(folder)), "savepoints": rows}, indent=1))
            return EXIT_OK
        if not rows:
            print(f"no savepoints in {folder}")
        for r in rows:
            if r["status"] != "completed":
                print(f"{r['path']}  DAMAGED: {r['error']}")
                continue
            print(f"{r['path']}  job={r['job']} epoch={r['epoch']} p={r['parallelism']}/{r['max_parallelism']} "
                  f"files={r['state_files']} bytes={r['state_bytes']} created={r['created_at']}")
        return EXIT_OK
    if len(words) > 2:
        raise UsageError("usage: epochstream savepoint JOB_OR_ENDPOINT [DIR]")
    client, job_id = _client(words[0])
    target = str(location(words[1])) if len(words) == 2 else None
    try:
        doc = client.savepoint(job_id, target, wait=args.timeout)
    except RestError as exc:  # 4xx: the request was wrong (exit 2); else the job failed it or is gone (exit 3)
        print(f"epochstream: {exc}", file=sys.stderr)
        return EXIT_USAGE if exc.status is not None and 400 <= exc.status < 500 else EXIT_FAILED
    return _savepoint_outcome(doc, args, "savepoint")


def cmd_stop(args) -> int:
    """``stop [--savepoint [DIR]] JOB``: a final epoch (a savepoint with --savepoint), then the job ends."""
    from .backends import location
    from .deploy.rest import RestError

    job, savepoint = args.job, args.savepoint
    if job is None:
        if not isinstance(savepoint, str):
            raise UsageError("usage: epochstream stop [--savepoint [DIR]] JOB_OR_ENDPOINT")
        job, savepoint = savepoint, True  # "stop --savepoint JOB": no DIR given
    client, job_id = _client(job)
    target = str(location(savepoint)) if isinstance(savepoint, str) else None
    try:
        doc = client.savepoint(job_id, target, stop=True, savepoint=savepoint is not None, wait=args.timeout)
    except RestError as exc:  # 4xx: the request was wrong (exit 2); else the job failed it or is gone (exit 3)
        print(f"epochstream: {exc}", file=sys.stderr)
        return EXIT_USAGE if exc.status is not None and 400 <= exc.status < 500 else EXIT_FAILED
    return _savepoint_outcome(doc, args, "stopped with savepoint" if savepoint is not None else "stopped")


def _parse_key(text: str) -> Any:
    """``--key``: JSON if it parses (5, "5", [1, "a"] -> a tuple), else the text itself."""
    try:
        value = json.loads(text)
    except ValueError:
        return text

    def tup(v):
        return tuple(tup(x) for x in v) if isinstance(v, list) else v

    return tup(value)


def cmd_state_query(args) -> int:
    from . import state as state_api
    from .backends import location

    key = state_api.ALL if args.key is None else _parse_key(args.key)
    table = state_api.query(args.checkpoint_dir, args.operator, key=key, epoch=args.epoch, state=args.state)
    rows = table.drop_columns(["key_pickle", "value_pickle"]).to_pylist()
    epoch = rows[0]["epoch"] if rows else None
    if args.json:
        print(json.dumps({"checkpoint_dir": str(location(args.checkpoint_dir)), "operator": args.operator,
                          "epoch": epoch if epoch is not None else args.epoch, "rows": rows},
                         indent=1, default=repr))
        return EXIT_OK
    if not rows:
        print("no committed state" + (f" for key {key!r}" if args.key is not None else ""))
        return EXIT_OK
    print(f"{'state':<12} {'key':<24} {'value':<30} {'key_group':>9} {'subtask':>7}  (epoch {epoch})")
    for r in rows:
        print(f"{r['state']:<12} {json.dumps(r['key'], default=repr):<24} {json.dumps(r['value'], default=repr):<30} "
              f"{r['key_group']:>9} {r['subtask']:>7}")
    return EXIT_OK


def _writes_kafka(build) -> bool:
    """The job's sinks are Kafka topics (then chaos compares the topics); mixed sinks are refused."""
    try:
        from .backends.kafka.chaos import kafka_sinks
    except ImportError:  # no confluent-kafka: no Kafka sink either
        return False
    p = build()
    kafka = kafka_sinks(p)
    if kafka and len(kafka) != len(p.sinks):
        others = sorted(set(p.sinks) - set(kafka))
        raise UsageError(f"chaos checks a job whose sinks are all Kafka topics or all other sinks; this one mixes "
                         f"Kafka sinks {sorted(kafka)} with {others}")
    return bool(kafka)


def _chaos_verdict(results: dict[str, Any], args):
    """Whether the chaos run's failures happened (``chaos.verdict``): each requested one landed
    and each landed kill or crash caused a failover."""
    from .chaos.verdict import judge

    chaos, schedule = results.get("chaos"), results.get("schedule")
    requested = schedule.requested(moments=args.deployment != "sim") if schedule is not None else []
    landed = chaos.metrics.get("failures_landed", []) if chaos else []
    return judge(requested, landed, failovers=len(chaos.metrics.get("failovers", [])) if chaos else 0)


def _chaos_fields(chaos, args, work) -> dict[str, Any]:
    """What both chaos reports (Kafka topics or the oracle) say about the chaos run itself."""
    return {
        "kills_requested": args.kills,
        "failures_injected": chaos.metrics.get("failures_injected") if chaos else None,
        "recovery_seconds": chaos.metrics.get("recovery_seconds", []) if chaos else [],
        "completed_epochs": len(chaos.completed_epochs) if chaos else 0,
        "deployment": args.deployment,
        "seed": args.seed,
        "workdir": str(work),
        "failovers": [f["reason"].splitlines()[0] for f in chaos.metrics.get("failovers", [])] if chaos else [],
    }


def _chaos_kafka(build, run, work, results: dict[str, Any], args) -> int:
    """``epochstream chaos`` of a Kafka job: both runs into fresh topics, read at read_committed."""
    from .backends.kafka.chaos import check_kafka_exactly_once
    from .deploy.failures import JobFailedError

    if args.duration is not None:
        raise UsageError("chaos of a Kafka job compares whole output topics: give it a bounded input "
                         "(from_kafka(end='latest')) and no --duration")
    try:
        report = check_kafka_exactly_once(build, run, work)
    except JobFailedError as exc:
        print(f"epochstream: {exc}", file=sys.stderr)
        return EXIT_FAILED
    chaos = results.get("chaos")
    verdict = _chaos_verdict(results, args)
    doc = report.to_json()
    doc.update({
        "restarts": chaos.restarts if chaos else 0,
        **_chaos_fields(chaos, args, work),
        "exactly_once": report.ok, "failures": verdict.as_dict(), "ok": report.ok and verdict.ok,
    })
    if args.json:
        print(json.dumps(doc, indent=1))
    else:
        print(f"chaos {'PASS' if doc['ok'] else 'FAIL'} (Kafka output at read_committed): {doc['restarts']} restarts "
              f"after {doc['failures_injected']} injected failures")
        print(f"  lost={report.lost} duplicated={report.duplicated} (committed {report.records_committed} of "
              f"{report.records_expected} expected records; {report.aborted_visible} aborted records visible at "
              f"read_uncommitted)")
        for ex in report.examples[:5]:
            print(f"  {ex}")
        _print_failures(verdict)
    return _chaos_exit(report.ok, verdict)


def _chaos_exit(exactly_once: bool, verdict) -> int:
    """A violation first; then a run whose failures did not happen proves nothing, and says so."""
    if not exactly_once:
        return EXIT_VIOLATION
    if not verdict.ok:
        for problem in verdict.problems:
            print(f"epochstream: chaos: {problem}", file=sys.stderr)
        return EXIT_NOT_INJECTED
    return EXIT_OK


def _print_failures(verdict) -> None:
    """Requested and landed failures per kind, and what did not happen."""
    kinds = ", ".join(f"{k.kind} {k.landed}/{k.requested}" for k in verdict.kinds) or "none"
    print(f"  failures landed/requested: {kinds}; {verdict.failovers} failovers for {verdict.due_failovers} due")
    for problem in verdict.problems:
        print(f"  NOT INJECTED: {problem}")


def _chaos_failures(args, rng: random.Random, reference):
    """The chaos run's failures, kills within ``--kill-window`` of the failure-free run's length."""
    from .deploy.failures import FailureSchedule

    span = reference.metrics.get("virtual_seconds") or reference.metrics.get("run_seconds") or reference.seconds
    sim = args.deployment == "sim"
    start, end = args.kill_window or ((0.0, 1.0) if sim else (0.1, 0.9))
    if sim:
        return FailureSchedule.random(rng, args.kills, end * span, start=start * span,
                                      epochs=len(reference.completed_epochs),
                                      captures=reference.metrics.get("state_captures"))
    # one kill per attempt: a kill whose time has passed waits for the next attempt. A kill is due at
    # its fraction of the reference's seconds or of its epochs, whichever comes first: a chaos run
    # faster than the reference (no cold start) still takes its kills before it ends
    moments, targets = args.kill_moments or [], args.kill_targets or []
    fractions = sorted(rng.uniform(start, end) for _ in range(args.kills))
    epochs = len(reference.completed_epochs)
    return FailureSchedule(
        kill_times=[f * span for f in fractions],
        kill_epochs=[max(1, int(f * epochs)) for f in fractions],
        kill_moments=[rng.choice(moments) for _ in range(args.kills)] if moments else [],
        kill_targets=[rng.choice(targets) for _ in range(args.kills)] if targets else [])


def _chaos_doc(report, chaos, args, work: str) -> dict[str, Any]:
    """``chaos``'s report: the oracle's verdict, each kill with its recovery, the chaos run's fields."""
    doc = report.to_json()
    doc.update({
        # kill i caused failover i (one kill per attempt); its recovery is failure -> all workers ready.
        # Padded with None: the last kill may have no recovery (run ended or failed first), so not strict
        "kills": [dict(k, recovery_seconds=rec) for k, rec in zip(
            chaos.metrics.get("kills", []), chaos.metrics.get("recovery_seconds", []) + [None] * args.kills,
            strict=False)]
        if chaos else [],
        **_chaos_fields(chaos, args, work),
    })
    return doc


def _print_chaos(report, doc: dict[str, Any], work: str) -> None:
    """The text form of ``chaos``'s report (``--json`` prints ``doc``)."""
    verdict = "PASS" if doc["ok"] else "FAIL"
    print(f"chaos {verdict}: {doc['restarts']} restarts after {doc['failures_injected']} injected failures, "
          f"{doc['epochs_checked']} epochs checked")
    print(f"  lost={report.lost} duplicated={report.duplicated} mismatched_state={report.mismatched_state} "
          f"mismatched_epoch_output={report.mismatched_epoch_output} "
          f"(committed {report.records_committed} of {report.records_expected} expected records)")
    if report.compare == "recorded":
        print(f"  inputs_lost={report.inputs_lost} inputs_duplicated={report.inputs_duplicated} "
              f"order_differs={report.order_differs} (a different order than the failure-free run: allowed)")
    for ex in report.examples[:10]:
        print(f"  - {ex}")
    for k in doc["kills"]:
        rec = "-" if k["recovery_seconds"] is None else f"{k['recovery_seconds']:.2f}s"
        print(f"  kill at {k['time']:.2f}s: worker {k['worker']} ({k['target']}, {k['moment']}), "
              f"recovered in {rec}")
    print(f"  work dir: {work}")


def cmd_chaos(args) -> int:
    from .deploy.failures import JobFailedError
    from .deploy.restart import FixedDelayRestart
    from .oracle import check_exactly_once

    build = _configured(load_pipeline_factory(args.pipeline), args)
    if args.deployment == "sim" and (args.kill_moments or args.kill_targets):
        raise UsageError("--kill-moments and --kill-targets need --deployment local or spark")
    options = _spark_options(args)
    rng = random.Random(args.seed)
    results: dict[str, Any] = {}

    def run(p, chk: str, failing: bool):
        # every injected failure must be survivable: chaos checks recovery, not the strategy's limit
        delay = p.restart_delay or 0.0
        if args.deployment != "sim":
            delay = min(delay, 0.2)
        p.restart_strategy = FixedDelayRestart(max(p.restart_attempts or 0, 2 * args.kills + 5), delay)
        failures = _chaos_failures(args, rng, results["reference"]) if failing else None
        results["schedule"] = failures if failing else results.get("schedule")
        line = _status_line("chaos run" if failing else "failure-free run", args)
        live = {"on_start": line.on_start} if line is not None else {}
        try:
            r = p.run(deployment=args.deployment, checkpoint_dir=chk, seed=args.seed, failures=failures,
                      duration=args.duration, **options, **live)
        except BaseException:
            _close(line)
            raise
        _close(line, r)
        results["chaos" if failing else "reference"] = r
        return r

    work = args.workdir or args.checkpoint_dir or tempfile.mkdtemp(prefix="epochstream-chaos-")
    from .backends import open_storage
    from .deploy.lease import check_not_held

    check_not_held(open_storage(work), "run chaos in it")  # its runs would clear the holder's state
    if _writes_kafka(build):
        return _chaos_kafka(build, run, work, results, args)
    try:
        # runs cut by --duration stop at different points: compare per epoch, not whole outputs
        report = check_exactly_once(build, run, work, whole_output=args.duration is None, compare=args.compare)
    except JobFailedError as exc:
        print(f"epochstream: {exc}", file=sys.stderr)
        return EXIT_FAILED
    verdict = _chaos_verdict(results, args)
    doc = _chaos_doc(report, results.get("chaos"), args, work)
    doc.update({"exactly_once": report.ok, "failures": verdict.as_dict(), "ok": report.ok and verdict.ok})
    if args.json:
        print(json.dumps(doc, indent=1))
    else:
        _print_chaos(report, doc, work)
        _print_failures(verdict)
    return _chaos_exit(report.ok, verdict)


def cmd_ui(args) -> int:
    """``ui --checkpoint-dir DIR``: a finished job's dashboard, served until interrupted."""
    from .deploy.rest import offline_server

    server = offline_server(args.checkpoint_dir, args.port or 0)
    url = f"{server.endpoint}/"
    if args.json:
        print(json.dumps({"url": url, "metrics": f"{server.endpoint}/metrics", "checkpoint_dir": args.checkpoint_dir}),
              flush=True)
    else:
        print(f"epochstream: dashboard of the job in {args.checkpoint_dir} at {url} (Ctrl-C to stop)", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        return EXIT_OK
    finally:
        server.close()


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="epochstream", description=__doc__.split("\n")[0])
    ap.add_argument("-v", "--verbose", action="store_true", help="log progress to stderr")
    sub = ap.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run a pipeline until its bounded input is done (or --duration)")
    _add_run_flags(run)
    run.add_argument("--restore", help="'latest' or the path of a checkpoint (chk-N folder or its _metadata.json)")
    run.add_argument("--restart-strategy", metavar="SPEC",
                     help="none | fixed-delay:ATTEMPTS:DELAY | exponential-delay:INITIAL:MAX[:MULTIPLIER[:ATTEMPTS]] "
                          "| failure-rate:MAX_FAILURES:INTERVAL:DELAY (seconds; default fixed-delay:10:0.5)")
    run.add_argument("--from-savepoint", "-s", metavar="PATH",
                     help="start from a savepoint (or checkpoint) folder, at any parallelism up to max parallelism")
    run.add_argument("--allow-non-restored-state", "-n", action="store_true",
                     help="drop state of operators that are no longer in the pipeline")
    run.add_argument("--allow-sources-from-start", action="store_true",
                     help="on a restore, let a source with no offsets in the checkpoint (a new or renamed uid) start "
                          "from the beginning although the sinks already hold committed output")
    run.add_argument("--savepoint-dir", help="default target of savepoints triggered on this job")
    run.add_argument("--stop-with-savepoint", action="store_true",
                     help="end the run (bounded input done or --duration over) with a savepoint in --savepoint-dir")
    run.add_argument("--rest-port", type=_number(int, 0, 65535),
                     help="port of the job's HTTP API on 127.0.0.1 (default: any free one)")
    run.set_defaults(func=cmd_run)

    sp = sub.add_parser(
        "savepoint", help="trigger a savepoint on a running job, or dispose/list savepoints",
        description="epochstream savepoint JOB_OR_ENDPOINT [DIR] | savepoint dispose PATH | savepoint list [DIR]")
    sp.add_argument("words", nargs="+", metavar="JOB_OR_ENDPOINT [DIR] | dispose PATH | list [DIR]")
    sp.add_argument("--savepoint-dir", help="for list: the directory (default EPOCHSTREAM_SAVEPOINT_DIR)")
    sp.add_argument("--timeout", type=_number(float, 0, low_open=True), default=300.0,
                    help="seconds to wait for the savepoint (default 300)")
    sp.add_argument("--json", action="store_true")
    sp.set_defaults(func=cmd_savepoint)

    stop = sub.add_parser("stop", help="stop a running job with a final epoch (a savepoint with --savepoint)")
    stop.add_argument("--savepoint", nargs="?", const=True, metavar="DIR",
                      help="take a savepoint as the final epoch (into DIR, or the job's --savepoint-dir)")
    stop.add_argument("job", nargs="?", metavar="JOB_OR_ENDPOINT", help="job id, id prefix, name or http://host:port")
    stop.add_argument("--timeout", type=_number(float, 0, low_open=True), default=300.0)
    stop.add_argument("--json", action="store_true")
    stop.set_defaults(func=cmd_stop)

    st = sub.add_parser("state", help="query committed state")
    st_sub = st.add_subparsers(dest="state_command", required=True)
    q = st_sub.add_parser("query", help="read-committed keyed state of one operator as of a completed epoch")
    q.add_argument("--checkpoint-dir", required=True, help="a checkpoint dir, or one chk-N or savepoint folder")
    q.add_argument("--operator", required=True, metavar="UID")
    q.add_argument("--key", help="one key; parsed as JSON when it parses (5, '\"5\"', [1,2]), else taken as text")
    q.add_argument("--epoch", type=_number(int, 1), help="a retained epoch (default: the newest completed)")
    q.add_argument("--state", help="one state name")
    q.add_argument("--json", action="store_true")
    q.set_defaults(func=cmd_state_query)

    ls = sub.add_parser("list", help="jobs in the registry: running, dead (process gone) or orphaned (lease lost)")
    ls.add_argument("--prune", action="store_true", help="remove the registry entries of dead jobs")
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(func=cmd_list)

    chk = sub.add_parser("checkpoints", help="inspect checkpoints")
    chk_sub = chk.add_subparsers(dest="checkpoints_command", required=True)
    lst = chk_sub.add_parser("list", help="list the checkpoints in a checkpoint dir")
    lst.add_argument("--checkpoint-dir", required=True)
    lst.add_argument("--json", action="store_true")
    lst.set_defaults(func=cmd_checkpoints_list)

    chaos = sub.add_parser("chaos", help="run with injected failures and check exactly-once against a failure-free run")
    _add_run_flags(chaos)
    chaos.add_argument("--kills", type=_number(int, 0), default=3, help="failures to inject (default 3)")
    chaos.add_argument("--kill-moments", metavar="LIST", type=_choice_list(KillMoment, "moment"),
                       help="local/spark: comma-separated protocol moments kills wait for, chosen at random per "
                            "kill: now, alignment, snapshot_write, sink_commit (a completed epoch reached the worker, "
                            "its sinks have not committed it), commit (default: now)")
    chaos.add_argument("--kill-targets", metavar="LIST", type=_choice_list(KillTarget, "target"),
                       help="local/spark: what a kill hits, chosen at random per kill: worker (its Python "
                            "process), executor (spark on local-cluster: the executor JVM), freeze (SIGSTOP the "
                            "worker: heartbeats time out) (default: worker)")
    chaos.add_argument("--kill-window", metavar="START,END", type=_kill_window,
                       help="kill times drawn in [START, END) of the failure-free run's length (default 0.1,0.9; "
                            "sim 0,1); a kill due after the chaos run has ended does not land, and chaos then "
                            "exits 4")
    chaos.add_argument("--workdir", help="keep both runs' output and checkpoints here (--checkpoint-dir is the same)")
    chaos.add_argument("--compare", choices=("recorded", "strict"), default="recorded",
                       help="recorded (default): replay the reference in the order the committed epochs processed "
                            "each key (pipelines that merge streams); strict: the output must equal the "
                            "failure-free run's (deterministic pipelines only)")
    chaos.set_defaults(func=cmd_chaos, restore=None, allow_non_restored_state=False)

    ui = sub.add_parser("ui", help="serve the dashboard of a finished job from its checkpoint folder (offline)")
    ui.add_argument("--checkpoint-dir", required=True)
    ui.add_argument("--port", type=int, help="port on 127.0.0.1 (default: any free one)")
    ui.add_argument("--json", action="store_true", help="print the URL as JSON")
    ui.set_defaults(func=cmd_ui)
    return ap


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    p, maxp = getattr(args, "parallelism", None), getattr(args, "max_parallelism", None)
    if p is not None and maxp is not None and maxp < p:
        parser.error(f"argument --max-parallelism: {maxp} is below --parallelism {p} (each worker needs a key group)")
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from .runtime.errors import EpochStreamError

    try:
        return args.func(args)
    except (EpochStreamError, ValueError, TypeError) as exc:  # bad input: say what, exit 2
        print(f"epochstream: {exc}", file=sys.stderr)
        return EXIT_USAGE
    finally:
        while _SESSIONS:
            _SESSIONS.pop().stop()


def entry() -> None:
    """Console-script entry point: exit right after the result is out.

    pyarrow can abort during interpreter teardown after worker processes were forked
    (apache/arrow#34314); once the command has printed its result there is nothing left to
    tear down that matters, so flush and leave with the command's exit code."""
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    entry()
