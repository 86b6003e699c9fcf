"""The source role of a task: which splits it reads, from where, and their time labels.

Theory of operation. Splits are assigned by ``split % parallelism`` (``runtime.sources``);
a reader keeps one offset per split, which is all a source's state, and reads the splits
round robin, one split per ``read``. With event time every record gets a label
``floor(ts / slack)``, and ``read`` cuts its records into *runs* of one label so the task
can flush between runs (a batch never spans two labels). The time a source can promise is
one below the smallest label a split with records left can still produce (``END_OF_TIME``
once every split is exhausted). By default labels must not decrease within a split; a
source with ``max_out_of_orderness`` instead bounds each split's labels by its newest
timestamp minus that delay, drops records below the bound as late, and leaves idle splits
out of the promise (``runtime.watermarks``). A RecordBatch whose event time is a column
(``Source.timestamp_column``: ``timestamps="col"``, Kafka's ``timestamps="kafka"``) is labelled
with numpy over that column, with the row path's arithmetic, and cut into zero-copy slices
(``_column_runs``); other batches are labelled as rows.

Pure: no actions, no time. ``runtime.task.SourceTask`` pushes the runs into its chain, counts
them, and turns a grown time promise into a watermark or a tracker promise.
"""

from __future__ import annotations

from typing import Any, Callable

from .columns import to_rows
from .errors import EpochStreamError, SourceError, UserFunctionError
from .messages import END_OF_TIME
from .sources import Source
from .watermarks import LateRecord, SplitWatermarks

Run = tuple[int | None, Any, int]
"""(time label, records, offset of the first): records of one label, consecutive in the split
(None: event time is off), a list or a RecordBatch slice; late records dropped between two runs
are why the offset is there."""


def timestamps_of(batch: Any, column: tuple[str, float]) -> Any:
    """Event time in seconds of every row of ``batch`` (a float64 numpy array, NaN where null),
    as the row path computes it: ``column`` is (name, units per second), and a value becomes
    ``value / units`` (Kafka's milliseconds: ``ms / 1000.0``, as ``kafka_event_time`` divides);
    None if the column is missing or not a number."""
    import numpy as np
    import pyarrow as pa

    name, units = column
    if name not in batch.schema.names:
        return None
    col = batch.column(name)
    if not (pa.types.is_integer(col.type) or pa.types.is_floating(col.type)):
        return None
    values = col.cast(pa.float64()).to_numpy(zero_copy_only=False)
    return values if units == 1.0 else values / np.float64(units)


class SplitReader:
    """Offsets and time labels of the splits one source subtask reads."""

    __slots__ = ("source", "uid", "splits", "offsets", "lengths", "_next_split", "timestamp", "slack", "last_read",
                 "_split_label", "time_promised", "watermarks", "_owner", "_known", "_restored", "_restored_max",
                 "late_output", "late_sent", "_seen")

    def __init__(self, source: Source, uid: str, splits: list[int], offsets: dict[int, int],
                 slack: float | None, max_timestamps: dict[int, float] | None = None,
                 owner: tuple[int, int] | None = None) -> None:
        """``offsets``: restored offsets (a split without one starts at 0); ``slack``: seconds
        per time label, or None to read without labels; ``max_timestamps``: restored newest
        timestamp per split (bounded out-of-orderness); ``owner``: (subtask, parallelism), so
        a growing source's new splits ``s`` with ``source.owner(s, parallelism) == subtask`` are
        read here."""
        self.source = source
        self.uid = uid
        self.splits = splits
        self._owner = owner
        #: the source's split count this reader has looked at (growing sources)
        self._known = source.num_splits
        #: the split ids this reader has looked at (growing sources)
        self._seen = set(source.split_ids()) if source.grows else set()
        #: restored offsets of every split (a split added later resumes from its own)
        self._restored = dict(offsets)
        self._restored_max = dict(max_timestamps or {})
        #: next offset to read per split; only grows
        self.offsets: dict[int, int] = {s: self._first_offset(s) for s in splits}
        #: records per split (None: unbounded)
        self.lengths: dict[int, int | None] = {s: source.split_length(s) for s in splits}
        self._next_split = 0
        self.last_read: tuple[int, int] = (-1, -1)
        timestamp: Callable[[Any], Any] | None = source.timestamp if slack is not None else None
        #: the source's timestamp function, when records are labelled
        self.timestamp = timestamp
        self.slack = slack
        #: per split, the label of the last record read (or of the next one, after a restore)
        self._split_label: dict[int, int] = {}
        #: newest time label promised; only grows
        self.time_promised = -1
        delay = getattr(source, "max_out_of_orderness", None)
        #: bounded out-of-orderness: per-split watermarks (None: labels must not decrease)
        self.watermarks: SplitWatermarks | None = None
        #: late records go on as ``LateRecord`` (a side output) instead of being dropped
        self.late_output = source.late_output
        #: late records sent to the side output so far
        self.late_sent = 0
        if timestamp is not None and delay is not None:
            assert slack is not None
            self.watermarks = SplitWatermarks(slack, delay, splits, max_timestamps,
                                              getattr(source, "idleness", None))
        elif timestamp is not None:
            for s in splits:
                first = source.read(s, self.offsets[s], 1)
                if len(first):
                    self._split_label[s] = self._first_label(s, self.offsets[s], first)

    def _first_offset(self, split: int) -> int:
        restored = self._restored
        if split in restored:
            return int(restored[split])
        if restored and self.source.grows:  # a restore, and the split is newer than the checkpoint
            return int(self.source.discovered_start_offset(split))
        return int(self.source.start_offset(split))

    def _grow(self, now: float) -> None:
        """A growing source: take the new splits this subtask owns, from their first offsets."""
        source = self.source
        source.discover(now)
        if source.num_splits == self._known or self._owner is None:
            return
        subtask, parallelism = self._owner
        for s in source.split_ids():
            if s in self._seen:
                continue
            self._seen.add(s)
            if source.owner(s, parallelism) == subtask and s not in self.offsets:
                self.splits.append(s)
                self.offsets[s] = self._first_offset(s)
                self.lengths[s] = source.split_length(s)
                if self.watermarks is not None:
                    self.watermarks.add_split(s, self._restored_max.get(s))
        self._known = source.num_splits

    def has_more(self) -> bool:
        return any(ln is None or self.offsets[s] < ln for s, ln in self.lengths.items())

    @property
    def late_records(self) -> int:
        """Records dropped as late so far (bounded out-of-orderness)."""
        return 0 if self.watermarks is None else self.watermarks.late

    def read(self, budget: int, now: float = 0.0) -> list[Run]:
        """Up to ``budget`` records of the next split that has some, as runs of one label
        (late records left out)."""
        if self.source.grows:
            self._grow(now)
        splits = self.splits
        for _ in range(len(splits)):
            split = splits[self._next_split % len(splits)]
            self._next_split += 1
            offset = self.offsets[split]
            length = self.lengths[split]
            if length is not None and offset >= length:
                continue
            try:
                records, after = self.source.read_next(split, offset, budget)
            except UserFunctionError as exc:  # a generator function: it knows its rows, we add the split
                exc.locate(source=self.uid, split=split, offset=offset)
                raise
            except EpochStreamError:
                raise
            except Exception as exc:
                raise SourceError(f"source {self.uid!r} split {split} failed to read at offset {offset}: "
                                  f"{exc!r}") from exc
            self.offsets[split] = after
            #: where the records just read start (the task names them when a function fails on one)
            self.last_read = (split, offset)
            if len(records):
                if self.timestamp is None:
                    return [(None, records, offset)]
                if type(records) is not list:
                    column = self.source.timestamp_column
                    if column is not None and timestamps_of(records, column) is not None:
                        return self._column_runs(split, offset, records, column, now)
                    records = to_rows(records)  # a timestamp function reads rows
                if self.watermarks is not None:
                    self.watermarks.touched(split, now)
                    return self._bounded_runs(split, offset, records, bool(self.late_output))
                return self._runs(split, offset, records)
        return []

    def next_time_promise(self, now: float = 0.0) -> int | None:
        """The labels no split can send any more, if that grew since the last call. With
        bounded out-of-orderness idle splits do not count; if every split with records left
        is idle, the idle splits that brought records decide (``runtime.watermarks``)."""
        bound = END_OF_TIME
        wm = self.watermarks
        live = 0
        quiet = END_OF_TIME  # the minimum over idle splits that brought records
        for s in self.splits:
            length = self.lengths[s]
            if length is None or self.offsets[s] < length:
                if wm is None:
                    bound = min(bound, self._split_label.get(s, 0) - 1)
                elif wm.idle(s, now):
                    if wm.seen(s):
                        quiet = min(quiet, wm.bound(s) - 1)
                    continue
                else:
                    bound = min(bound, wm.bound(s) - 1)
                live += 1
        if wm is not None and not live and self.has_more():  # every split idle
            if quiet == END_OF_TIME:
                return None  # none brought a record: nothing is known
            bound = quiet
        if bound <= self.time_promised:
            return None
        self.time_promised = bound
        return bound

    def _runs(self, split: int, offset: int, records: list[Any]) -> list[Run]:
        last = self._split_label.get(split, 0)
        runs: list[Run] = []
        start = 0
        run_label = self._label(split, offset, records[0])
        for i, r in enumerate(records):
            label = run_label if i == 0 else self._label(split, offset + i, r)
            if label < last:
                raise EpochStreamError(
                    f"source {self.uid!r} split {split} offset {offset + i}: timestamp {self._timestamp(r)!r} "
                    f"(time label {label}) is before label {last} of an earlier record; event timestamps must not "
                    f"decrease within a split (sort each split by time, use more splits, or give the source "
                    f"max_out_of_orderness=<seconds>)"
                )
            if label != run_label:
                runs.append((run_label, records[start:i], offset + start))
                run_label, start = label, i
            last = label
        runs.append((run_label, records[start:], offset + start))
        self._split_label[split] = last
        return runs

    def _bounded_runs(self, split: int, offset: int, records: list[Any], side: bool = False) -> list[Run]:
        """Runs of one label of the records that are not late (bounded out-of-orderness),
        as slices of ``records`` between label changes and late records. ``side`` (a late
        side output): a late record goes on as a run of its own, wrapped in ``LateRecord``
        and labelled with the lowest label not yet promised for the split (its bound, or one
        above the reader's promise), so no promise is broken; else it is dropped and counted."""
        wm = self.watermarks
        assert wm is not None and self.slack is not None
        slack, promised = self.slack, self.time_promised
        # ``SplitWatermarks.admit`` inlined (the per-record path): a label at or below ``floor``
        # is late; a newer timestamp raises the split's bound
        floor = max(wm.bound(split) - 1, promised)
        newest, delay, late = wm.max_ts[split], wm.max_delay, 0
        runs: list[Run] = []
        start, run_label = 0, None
        for i, r in enumerate(records):
            ts = self._checked_timestamp(split, offset + i, r)
            label = int(ts // slack)
            if label <= floor:
                if run_label is not None and i > start:
                    runs.append((run_label, records[start:i], offset + start))
                if side:
                    runs.append((floor + 1, [LateRecord(r)], offset + i))
                    self.late_sent += 1
                else:
                    late += 1
                start, run_label = i + 1, None
                continue
            if ts > newest:
                newest = ts
                b = int((ts - delay) // slack) - 1
                if b > floor:
                    floor = b
            if label != run_label:
                if run_label is not None and i > start:
                    runs.append((run_label, records[start:i], offset + start))
                run_label, start = label, i
        if run_label is not None and len(records) > start:
            runs.append((run_label, records[start:], offset + start))
        wm.advance(split, newest, late)
        return runs

    def _first_label(self, split: int, offset: int, records: Any) -> int:
        if type(records) is list:
            return self._label(split, offset, records[0])
        column = self.source.timestamp_column
        seconds = None if column is None else timestamps_of(records.slice(0, 1), column)
        if seconds is None:
            return self._label(split, offset, to_rows(records.slice(0, 1))[0])
        self._check_column(split, offset, records, seconds)
        assert self.slack is not None
        return int(seconds[0] // self.slack)

    # ------------------------------------------------------------ Arrow batches
    def _column_runs(self, split: int, offset: int, batch: Any, column: tuple[str, float],
                     now: float) -> list[Run]:
        """``_runs`` / ``_bounded_runs`` of a RecordBatch whose event time is a column: labels,
        late records and run ends computed with numpy over the column, the same arithmetic as
        the row path (Python's float ``//`` is numpy's ``floor_divide``), so a replay and the
        oracle's rows agree; runs are zero-copy slices. Late records and runs so short that
        slices would cost more than rows (out-of-order input at a fine slack) become rows."""
        import numpy as np

        assert self.slack is not None
        slack = self.slack
        ts = timestamps_of(batch, column)
        assert ts is not None
        self._check_column(split, offset, batch, ts)
        labels = np.floor_divide(ts, slack).astype(np.int64)
        n = len(labels)
        wm = self.watermarks
        late = None
        if wm is None:
            last = self._split_label.get(split, 0)
            prev = np.concatenate(([last], labels[:-1]))
            back = np.flatnonzero(labels < prev)
            if back.size:
                i = int(back[0])
                raise EpochStreamError(
                    f"source {self.uid!r} split {split} offset {offset + i}: timestamp {float(ts[i])!r} "
                    f"(time label {int(labels[i])}) is before label {int(prev[i])} of an earlier record; event "
                    f"timestamps must not decrease within a split (sort each split by time, use more splits, or give "
                    f"the source max_out_of_orderness=<seconds>)")
            self._split_label[split] = int(labels[-1])
        else:
            wm.touched(split, now)
            # ``_bounded_runs`` vectorised: the floor before record i is the largest of the split's
            # floor and the bound of every earlier timestamp; a late record's own bound is below
            # its label, so counting it too changes nothing, and the late test needs no loop
            floor0 = max(wm.bound(split) - 1, self.time_promised)
            bounds = np.floor_divide(ts - wm.max_delay, slack).astype(np.int64) - 1
            floors = np.empty(n, np.int64)
            floors[0] = floor0
            if n > 1:
                floors[1:] = np.maximum(np.maximum.accumulate(bounds)[:-1], floor0)
            late = labels <= floors
            kept = ts[~late]
            newest = max(wm.max_ts[split], float(kept.max())) if kept.size else wm.max_ts[split]
            n_late = int(late.sum())
            side = bool(self.late_output)
            wm.advance(split, newest, 0 if side else n_late)
            if side:
                self.late_sent += n_late
            if not n_late:
                late = None
        cut = labels[1:] != labels[:-1]
        if late is not None:
            cut |= late[1:] | late[:-1]
        starts = [0, *(np.flatnonzero(cut) + 1).tolist()]
        ends = [*starts[1:], n]
        rows = to_rows(batch) if len(starts) > max(8, n // 16) else None
        runs: list[Run] = []
        for a, b in zip(starts, ends, strict=True):
            if late is not None and late[a]:
                if self.late_output:
                    row = rows[a] if rows is not None else to_rows(batch.slice(a, 1))[0]
                    runs.append((int(floors[a]) + 1, [LateRecord(row)], offset + a))
                continue
            part = rows[a:b] if rows is not None else batch.slice(a, b - a)
            runs.append((int(labels[a]), part, offset + a))
        return runs

    def _check_column(self, split: int, offset: int, batch: Any, seconds: Any) -> None:
        """Event timestamps must be numbers >= 0 (the row path's check, vectorised)."""
        import numpy as np

        bad = np.flatnonzero(~(seconds >= 0))  # NaN and nulls (NaN here) fail too
        if bad.size:
            i = int(bad[0])
            name = self.source.timestamp_column[0] if self.source.timestamp_column else "timestamp"
            value = batch.column(name)[i].as_py()
            raise EpochStreamError(
                f"source {self.uid!r} split {split} offset {offset + i}: column {name!r} holds {value!r}; event "
                f"timestamps must be numbers >= 0")

    def _timestamp(self, record: Any) -> Any:
        assert self.timestamp is not None
        try:
            return self.timestamp(record)
        except Exception as exc:
            raise UserFunctionError(f"timestamp function of source {self.uid!r} failed", exc, record=record) from exc

    def _label(self, split: int, offset: int, record: Any) -> int:
        assert self.slack is not None
        return int(self._checked_timestamp(split, offset, record) // self.slack)

    def _checked_timestamp(self, split: int, offset: int, record: Any) -> float:
        ts = self._timestamp(record)
        if not isinstance(ts, (int, float)) or ts < 0:
            raise EpochStreamError(
                f"source {self.uid!r} split {split} offset {offset}: the timestamp function returned {ts!r}; "
                f"event timestamps must be numbers >= 0"
            )
        return ts
