"""User function base classes, named as in PyFlink."""

from __future__ import annotations

from typing import Any, Iterable

from ..runtime.context import Context


class KeyedProcessFunction:
    """Per-key logic with keyed state.

    Call order per subtask: ``open(ctx)`` once (declare state there with
    ``ctx.state(descriptor)``), then ``process(value, ctx)`` per record with ``ctx.key`` set,
    then ``close()``. ``process`` returns or yields the records to emit (or None).
    After a failure the subtask is rebuilt, ``open`` runs again, and state is restored.
    """

    def open(self, ctx: "Context") -> None:  # noqa: D401 - hook
        pass

    def process(self, value: Any, ctx: "Context") -> Iterable[Any] | None:
        # PyFlink names this process_element; accept either.
        if type(self).process_element is not KeyedProcessFunction.process_element:
            return self.process_element(value, ctx)
        raise NotImplementedError(f"{type(self).__name__} must implement process(value, ctx)")

    def process_element(self, value: Any, ctx: "Context") -> Iterable[Any] | None:
        raise NotImplementedError

    def on_timer(self, timestamp: float, ctx: "Context") -> Iterable[Any] | None:
        """An event-time timer set with ``ctx.timer_service().register_event_time_timer``
        fired: event time passed ``timestamp`` (``ctx.key`` is the timer's key)."""
        return None

    #: True when the function uses event time (timers or key expiry); set automatically
    #: for subclasses that define ``on_timer``
    uses_event_time = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "on_timer" in cls.__dict__:
            cls.uses_event_time = True

    def close(self) -> None:
        pass


class KeyedBatchFunction:
    """Per-key logic on Arrow batches (``key_by("col").process_batches(fn)``).

    Call order per subtask: ``open(ctx)`` once (declare state with ``ctx.state(descriptor)``),
    then ``process_batch(key, batch, ctx)`` once per distinct key of every batch, with ``key``
    (also ``ctx.key``) current and ``batch`` a ``pyarrow.RecordBatch`` of that key's rows in
    arrival order; it returns a RecordBatch or Table of output rows, or None. Then ``close()``.

    A vectorised running count::

        class Count(KeyedBatchFunction):
            def open(self, ctx):
                self.count = ctx.state(ValueStateDescriptor("count", default=0))

            def process_batch(self, key, batch, ctx):
                c = self.count.value()
                self.count.update(c + batch.num_rows)
                return pa.record_batch({"k": [key] * batch.num_rows,
                                        "n": pa.array(range(c + 1, c + batch.num_rows + 1))})
    """

    def open(self, ctx: "Context") -> None:
        pass

    def process_batch(self, key: Any, batch: Any, ctx: "Context") -> Any:
        raise NotImplementedError(f"{type(self).__name__} must implement process_batch(key, batch, ctx)")

    def close(self) -> None:
        pass
