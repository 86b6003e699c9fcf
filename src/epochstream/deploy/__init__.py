"""Drivers: where the sans-IO core meets threads, processes, clocks and storage."""

from __future__ import annotations

import logging
import secrets
import tempfile
import time
from typing import TYPE_CHECKING, Any

from ..snapshot.manifest import CheckpointError
from .lease import DEFAULT_TTL, Lease, LeaseKeeper

if TYPE_CHECKING:
    from .driver import Driver

log = logging.getLogger("epochstream")


def make_storage(checkpoint_dir: Any, state_backend: str = "files", compact_every: int = 10,
                 compact_in_background: bool = True):
    """Checkpoint storage for a path, ``s3://bucket/prefix``, or a storage object (None: a temporary folder);
    ``state_backend="delta"`` adds a Delta table of committed state per operator (a changelog compacted
    every ``compact_every`` epochs, on a thread of the job master or inline)."""
    from ..backends import open_storage

    if checkpoint_dir is None:
        checkpoint_dir = tempfile.mkdtemp(prefix="epochstream-chk-")
    if state_backend == "delta":
        from ..backends.delta import DeltaCheckpointStorage

        return checkpoint_dir if isinstance(checkpoint_dir, DeltaCheckpointStorage) else DeltaCheckpointStorage(
            checkpoint_dir, compact_every=compact_every, compact_in_background=compact_in_background)
    return open_storage(checkpoint_dir)


def _refuse_models(pipeline, deployment: str) -> None:
    """The in-memory Kafka model (``memory://``) lives in this process; other drivers' workers
    are other processes and would each see an empty cluster."""
    from ..runtime.errors import ConfigurationError

    for what, items in (("source", pipeline.sources), ("sink", pipeline.sinks)):
        for uid, obj in items.items():
            servers = getattr(obj, "bootstrap_servers", None)
            if isinstance(servers, str) and servers.startswith("memory://"):
                raise ConfigurationError(f"{what} {uid!r} uses the in-memory Kafka model {servers!r}, which only the "
                                         f"simulator runs (deployment='sim'); deployment={deployment!r} needs a real "
                                         f"cluster")


def run_pipeline(
    pipeline,
    deployment: str,
    checkpoint_dir: Any,
    restore: str | None,
    seed: int,
    allow_non_restored_state: bool,
    duration: float | None,
    parallelism: int | None = None,
    sim: Any = None,
    failures: Any = None,
    savepoint_dir: str | None = None,
    stop_with_savepoint: bool = False,
    **options: Any,
):
    if deployment != "sim":
        _refuse_models(pipeline, deployment)
    # the simulator is one deterministic thread: it compacts inline, where its fail points reach
    storage = make_storage(checkpoint_dir, pipeline.checkpoint.state_backend,
                           pipeline.checkpoint.delta_compact_every, compact_in_background=deployment != "sim")
    _place_checkpoint_sinks(pipeline, storage)
    lease_ttl = options.pop("lease_ttl", DEFAULT_TTL)
    allow_sources_from_start = bool(options.pop("allow_sources_from_start", False))
    # the job id is the lease holder's: chosen here, before the driver, so a refusal changes nothing
    job_id = secrets.token_hex(16)
    lease: Lease | None = None
    keeper: LeaseKeeper | None = None
    if getattr(storage, "store", None) is not None:  # every built-in backend; a custom one may keep no store
        lease = Lease(storage, pipeline.name, job_id, ttl=lease_ttl).acquire(
            "restore into it" if restore else "run a job in it")
        keeper = LeaseKeeper(lease).start()
    else:
        log.warning("%r keeps no object store: the run holds no lease on it (nothing stops a second run)", storage)
    try:
        if restore is None and storage.list_checkpoints():
            raise CheckpointError(
                f"checkpoint dir {storage.root} already holds checkpoints {storage.list_checkpoints()[-3:]}; "
                f"pass restore='latest' (--restore latest) to resume, or use an empty directory"
            )
        t0 = time.perf_counter()
        run = {"job_id": job_id, "lease": lease, "allow_sources_from_start": allow_sources_from_start}
        driver = _new_driver(pipeline, deployment, storage, seed, parallelism, sim, failures, savepoint_dir,
                             stop_with_savepoint, options, run)
        driver.run(restore, allow_non_restored_state, duration)
        return _result(pipeline, deployment, storage, driver, time.perf_counter() - t0)
    finally:
        _release_clients(pipeline)
        close = getattr(storage, "close", None)
        if close is not None:  # the Delta backend's compactor thread
            close()
        if keeper is not None:
            keeper.stop()
        if lease is not None:
            lease.release()


def _place_checkpoint_sinks(pipeline, storage) -> None:
    """Sinks that live under the job's checkpoint dir (``from_json``'s default dead letters,
    ``backends.sinks.DeadLetterFiles``) learn where it is, before any worker takes them."""
    from ..runtime.errors import ConfigurationError

    for uid, sink in pipeline.sinks.items():
        bind = getattr(sink, "bind_checkpoint_root", None)
        if bind is None:
            continue
        root = getattr(storage, "root", None)
        if root is None:
            raise ConfigurationError(f"sink {uid!r} writes under the checkpoint dir, and {storage!r} has no folder; "
                                     f"give from_json a dead_letter= sink")
        bind(root)


def _release_clients(pipeline) -> None:
    """Close the network clients the job's sources and sinks opened in this process (Kafka's
    consumers and producers open again on next use): a notebook or service that runs many jobs
    keeps no client threads, and none reconnects forever to a broker that has gone away."""
    for obj in (*pipeline.sources.values(), *pipeline.sinks.values()):
        release = getattr(obj, "release", None)
        if release is None:
            continue
        try:
            release()
        except Exception as exc:  # the job's outcome stands; a client that would not close is only logged
            log.warning("closing the clients of %r failed: %s", obj, exc)


def _new_driver(pipeline, deployment: str, storage, seed: int, parallelism: int | None, sim: Any, failures: Any,
                savepoint_dir: str | None, stop_with_savepoint: bool, options: dict[str, Any],
                run: dict[str, Any]) -> Driver:
    """The deployment's driver; ``run``: the job id, the lease and ``allow_sources_from_start``."""
    driver: Driver
    if deployment == "sim":
        from .sim import SimDriver

        if options:
            raise TypeError(f"unknown option(s) for the sim driver: {sorted(options)}")
        driver = SimDriver(pipeline, storage, seed=seed, config=sim, failures=failures, parallelism=parallelism,
                           savepoint_dir=savepoint_dir, stop_with_savepoint=stop_with_savepoint, **run)
    elif deployment == "local":
        from .local import LocalDriver

        driver = LocalDriver(pipeline, storage, seed=seed, failures=failures, parallelism=parallelism,
                             savepoint_dir=savepoint_dir, stop_with_savepoint=stop_with_savepoint, **options, **run)
    elif deployment == "spark":
        from .spark import SparkDriver

        driver = SparkDriver(pipeline, storage, seed=seed, failures=failures, parallelism=parallelism,
                             savepoint_dir=savepoint_dir, stop_with_savepoint=stop_with_savepoint, **options, **run)
    else:
        raise ValueError(f"unknown deployment {deployment!r}")
    return driver


def _result(pipeline, deployment: str, storage, driver: Driver, seconds: float):
    latest = storage.list_checkpoints()
    return driver.record.result(
        job=pipeline.name, checkpoint_dir=str(storage.root),
        latest_checkpoint=str(storage.checkpoint_dir(latest[-1])) if latest else None, seconds=seconds,
        run_seconds=driver.clock(), virtual_seconds=driver.clock() if deployment == "sim" else None,
        about={"deployment": deployment, "parallelism": driver.plan.parallelism, "mode": pipeline.mode,
               "batch_rows": pipeline.batch_rows, "batch_linger": pipeline.batch_linger, "job_id": driver.job_id},
    )
