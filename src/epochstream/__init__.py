"""epochstream: exactly-once stateful stream operators through asynchronous epoch snapshots."""

from .api.builtin import TumblingEventTimeWindows
from .api.functions import KeyedBatchFunction, KeyedProcessFunction
from .api.pipeline import CheckpointConfig, IterativeStream, KeyedStream, OutputTag, Pipeline, Stream, TrackerConfig
from .backends.kafka import KafkaSink, KafkaSource
from .backends.sinks import DiscardingSink, FileSink
from .deploy.failures import JobFailedError
from .deploy.result import JobResult
from .graph.keygroups import ParallelismError
from .runtime.context import Context
from .runtime.errors import EpochStreamError, SchemaError, StateSerializationError, UserFunctionError
from .runtime.sources import CollectionSource, GeneratorSource, Source
from .runtime.state import ListStateDescriptor, MapStateDescriptor, ValueStateDescriptor
from .runtime.types import TypeInformation, Types
from .snapshot.manifest import CheckpointError

__version__ = "0.1.0"

__all__ = [
    "CheckpointConfig", "CheckpointError", "CollectionSource", "Context", "DiscardingSink", "EpochStreamError",
    "FileSink", "GeneratorSource", "IterativeStream", "JobFailedError", "JobResult", "KafkaSink", "KafkaSource",
    "KeyedBatchFunction",
    "KeyedProcessFunction", "KeyedStream", "ListStateDescriptor", "MapStateDescriptor", "OutputTag", "ParallelismError",
    "Pipeline", "SchemaError", "Source", "StateSerializationError", "Stream", "TrackerConfig",
    "TumblingEventTimeWindows", "TypeInformation", "Types", "UserFunctionError", "ValueStateDescriptor",
]
