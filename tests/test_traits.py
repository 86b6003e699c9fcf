"""``OperatorTraits``: an operator's capabilities, read once, agree with the protocols."""

from __future__ import annotations

from epochstream.api.builtin import ReduceFunction
from epochstream.graph.plan import ColumnKey
from epochstream.recorded_order import Recording
from epochstream.runtime.columns import KeyedBatches
from epochstream.runtime.sideoutput import SideOutput
from epochstream.runtime.traits import AppliesBatches, ColumnarKeyed, DrainsInput, EndsEpochs, OperatorTraits


class _Batches:
    takes_record_batches = True
    uses_event_time = True

    def apply_batch(self, records, keys, ctx):
        return records

    def drain_input(self, ctx):
        return None

    def on_epoch_end(self, epoch, ctx):
        return None

    def process(self, value, ctx):
        return (value,)


def test_a_plain_keyed_function_has_no_optional_capability():
    assert OperatorTraits.of(ReduceFunction(lambda a, b: a + b)) == OperatorTraits()


def test_every_capability_is_read_and_matches_its_protocol():
    fn = _Batches()
    assert OperatorTraits.of(fn) == OperatorTraits(uses_event_time=True, ends_epochs=True, applies_batches=True,
                                                   takes_record_batches=True, drains_input=True)
    assert isinstance(fn, AppliesBatches) and isinstance(fn, DrainsInput) and isinstance(fn, EndsEpochs)
    columnar = KeyedBatches(lambda key, batch, ctx: batch, ColumnKey(("k",)))
    assert isinstance(columnar, ColumnarKeyed) and OperatorTraits.of(columnar).columnar_keyed
    assert OperatorTraits.of(SideOutput(int)).takes_any_records


def test_a_wrapper_that_forwards_attributes_has_the_wrapped_capabilities():
    assert OperatorTraits.of(Recording(_Batches())) == OperatorTraits.of(_Batches())


def test_a_flag_set_to_false_is_not_a_capability():
    class Off(_Batches):
        uses_event_time = False
        takes_record_batches = False

    traits = OperatorTraits.of(Off())
    assert not traits.uses_event_time and not traits.takes_record_batches and traits.applies_batches
