"""Delta Lake: committed keyed state and sink output as Delta tables, one transaction per epoch.

Two writers share one way of committing (docs/ARCHITECTURE.md §16):

* ``state``: ``DeltaCheckpointStorage``, the state backend: per stateful operator ONE Delta
  MERGE per epoch, after the manifest, that makes the table equal the operator's committed
  state; a restore reads it back by time travel.
* ``sink``: ``DeltaSink``: per sink ONE append per epoch of the output staged by the workers.
* ``tables``: what both need: paths, the commit log (``history``, ``version_of_epoch``),
  transactions that Delta skips when re-issued (``txnAppId`` = job and operator or sink,
  ``txnVersion`` = epoch), conflicts, and the check that a table at a target path is ours.
* ``schema``: the fixed columns of a state table, defined once.

Who else writes a table is checked before anything is written: a table at the target path
that epochstream did not create (other schema, no ``epochstream.*`` properties, other job or
operator) is refused with a CheckpointError; a commit by another writer between two epochs
is reported as ``DeltaConflictError`` (the committed state would no longer be what the
checkpoints say).

This module only re-exports the public names.
"""

from .sink import DeltaSink
from .state import DeltaCheckpointStorage
from .tables import (
    FORMAT_PROPERTY,
    SINK_FORMAT,
    STAGING,
    STATE_FORMAT,
    DeltaConflictError,
    history,
    version_of_epoch,
)

__all__ = [
    "FORMAT_PROPERTY",
    "SINK_FORMAT",
    "STAGING",
    "STATE_FORMAT",
    "DeltaCheckpointStorage",
    "DeltaConflictError",
    "DeltaSink",
    "history",
    "version_of_epoch",
]
