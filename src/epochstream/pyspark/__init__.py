"""Run PySpark's own stateful operators on epochstream, unchanged.

``Stream.transform_with_state`` runs a ``pyspark.sql.streaming.StatefulProcessor``
(``transformWithStateInPandas`` / ``transformWithState``) and
``Stream.apply_in_pandas_with_state`` an ``applyInPandasWithState`` function with PySpark's
``GroupState``. Their state is epochstream keyed state: snapshotted per epoch, restored,
rescaled and stored like native state. This package imports pyspark and pandas, so the
core never imports it; ``Stream``'s methods import it when called. See docs/PYSPARK.md.
"""

from .operators import ApplyInPandasWithState, TransformWithState

__all__ = ["ApplyInPandasWithState", "TransformWithState"]
