"""trAcker mode (paper 000 §3-4): epoch bounds from a central tracking agent, sans-IO.

Pieces, each a plain state machine or pure function (no clocks, threads, I/O, randomness):

- ``segments``: the dataflow graph condensed into segments (SCCs), topologically ordered;
- ``local.LocalTracker``: one per worker; XOR-folds SND/RCV events and flushes them;
- ``agent.TrackingAgent``: central; turns reports and source promises into NEOSS;
- ``gate.FirmBoundGate``: one per task; holds records of later epochs until NEOSS;
- ``traffic.ServiceTraffic``: service-message accounting shared with aligned mode;
- ``messages``: the values exchanged (``Report``, ``Promise``, ``TrackerMessage``, ``NEOSS``);
- ``keys``: per-key substreams (``LocalKeyTracker``, ``KeyTrackingAgent``, ``KeyFree``): when no in-flight
  message references a key, for distributed garbage collection of keyed state.

Data flow: task --snd/rcv--> LocalTracker --TrackerMessage (FIFO link)--> TrackingAgent
--NEOSS (FIFO link per process)--> task's FirmBoundGate. Sources add ``promise``.

Which hops are tracked. Every batch that crosses a channel between two tasks is tracked,
including channels between tasks of the same worker; operators chained inside one task
are one process and need nothing. Skipping a same-worker channel (both its SND and its
RCV) is unsafe when the receiving task runs later than the sender: the agent would see
the sender's segment finished while the batch waits in the receiver's mailbox, bound the
receiver's segment, and then the receiver's outputs (SND after that NEOSS) would reach a
segment already bounded downstream. Tracking them is nearly free: a SND and RCV that fall
between the same two flushes cancel in the fold and are dropped from the message.
"""

from .agent import TrackingAgent
from .gate import FirmBoundGate
from .keys import KeyFree, KeyMessage, KeyReport, KeyTrackingAgent, LocalKeyTracker
from .local import BatchIds, LocalTracker
from .messages import NEOSS, Promise, Report, TrackerMessage
from .segments import Segmentation, SegmentError, build_segments, chain_graph, strongly_connected_components
from .traffic import ServiceTraffic, Tally

__all__ = [
    "NEOSS",
    "BatchIds",
    "FirmBoundGate",
    "KeyFree",
    "KeyMessage",
    "KeyReport",
    "KeyTrackingAgent",
    "LocalKeyTracker",
    "LocalTracker",
    "Promise",
    "Report",
    "SegmentError",
    "Segmentation",
    "ServiceTraffic",
    "Tally",
    "TrackerMessage",
    "TrackingAgent",
    "build_segments",
    "chain_graph",
    "strongly_connected_components",
]
