"""Side outputs: records an operator wraps on their way (``watermarks.LateRecord``,
``jsoncodec.DeadLetter``), split from its main output by two operators the API chains behind it.

Both operators take records as they come (``takes_any_records``, ``ChainRuntime``): a
RecordBatch holds no wrapped record, so the main output passes it on whole and the side output
skips it; only lists are looked at record by record. A source with a late-record side output
or a ``from_json`` therefore keeps its batches columnar. The wrapped records are ordinary
records of the epoch they were made in, so a side output is as exactly-once as the main one.
"""

from __future__ import annotations

from typing import Any


class MainOutput:
    """The records that are not wrapped in ``wrapper``: RecordBatches whole, rows filtered."""

    takes_any_records = True
    counter: str | None = None

    def __init__(self, wrapper: type) -> None:
        self.wrapper = wrapper

    def __call__(self, records: Any) -> Any:
        if type(records) is not list:
            return records
        w = self.wrapper
        out = [r for r in records if type(r) is not w]
        return out or None


class SideOutput:
    """The records wrapped in ``wrapper``, unwrapped (``counter``: the chain counts them under
    that name, a task metric)."""

    takes_any_records = True

    def __init__(self, wrapper: type, counter: str | None = None) -> None:
        self.wrapper = wrapper
        self.counter = counter

    def __call__(self, records: Any) -> Any:
        if type(records) is not list:
            return None
        w = self.wrapper
        out = [r.record for r in records if type(r) is w]  # type: ignore[attr-defined]
        return out or None
