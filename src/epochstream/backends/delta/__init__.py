"""Delta Lake: committed keyed state and sink output as Delta tables, one transaction per epoch.

Two writers share one way of committing (docs/ARCHITECTURE.md §16):

* ``state``: ``DeltaCheckpointStorage``, the state backend: per stateful operator ONE Delta
  append per epoch, after the manifest, of the epoch's changes (an append-only changelog,
  deletes as tombstones); a restore reads it back by time travel and folds it.
* ``changelog``: folding a changelog to state (``fold``, ``state_at``; ``read_state`` for
  Spark users), and compaction, which folds a table in the background as its own version.
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

from .changelog import STATE_SQL, read_state, state_at
from .sink import DeltaSink
from .state import DeltaCheckpointStorage
from .tables import (
    FORMAT_PROPERTY,
    SINK_FORMAT,
    STAGING,
    STATE_FORMAT,
    STATE_FORMAT_V1,
    DeltaConflictError,
    history,
    version_of_epoch,
)

__all__ = [
    "FORMAT_PROPERTY",
    "SINK_FORMAT",
    "STAGING",
    "STATE_FORMAT",
    "STATE_FORMAT_V1",
    "STATE_SQL",
    "DeltaCheckpointStorage",
    "DeltaConflictError",
    "DeltaSink",
    "history",
    "read_state",
    "state_at",
    "version_of_epoch",
]
