"""DeepSpeed before 0.19.8 waits on the last of the asynchronous all-gathers of a coalesced ZeRO-3 gather only; on
gloo each runs on its own, so parameters could be used half-gathered (runtime/zero/partition_parameters.py). Where
that applies, deepspeed_bnb's wrapper of `Init._allgather_params_coalesced` makes each all-gather finish before the
next is launched.

The wrapper is exercised around a stand-in for the unfixed DeepSpeed function (it launches one all-gather per
parameter through partition_parameters' `dist` and waits on the last handle only), with a spy for `dist` that logs
each launch and each wait: fixed, every launch is followed by its own wait; control: the unfixed function alone, and
the wrapper where the release already waits on every handle, leave the launches unwaited but the last.
"""

import importlib

import pytest

from deepspeed_bnb import installer
from deepspeed_bnb.runtime.zero import partition_parameters as ours

ds_partition = importlib.import_module("deepspeed.runtime.zero.partition_parameters")


class Spy:
    """A stand-in for deepspeed.comm that logs each all-gather's launch and each wait on its handle."""

    def __init__(self, events):
        self.events = events

    def all_gather_into_tensor(self, *args, **kwargs):
        number = sum(1 for e in self.events if e[0] == "launch")
        self.events.append(("launch", number))
        events = self.events

        class Handle:
            def wait(self):
                events.append(("wait", number))

        return Handle()


def unfixed_gather(self, param_list, hierarchy=0, quantize=False):
    """What DeepSpeed 0.16.4-0.19.7 does: launch every all-gather, wait on the last handle only."""
    handles = [ds_partition.dist.all_gather_into_tensor(None, None, async_op=True) for _ in param_list]
    handles[-1].wait()


def events_of(monkeypatch, release_waits_on_every_handle: bool, wrapped: bool = True) -> list:
    events = []
    monkeypatch.setattr(ds_partition, "dist", Spy(events))
    monkeypatch.setitem(installer._STOCK, "Init._allgather_params_coalesced", unfixed_gather)
    monkeypatch.setattr(ours, "waits_every_gather_handle", lambda: release_waits_on_every_handle)
    (ours._allgather_params_coalesced if wrapped else unfixed_gather)(None, ["a", "b", "c"])
    return events


def waited(events) -> list:
    return sorted(number for kind, number in events if kind == "wait")


def test_each_gather_finishes_before_the_next(one_rank, monkeypatch):
    events = events_of(monkeypatch, release_waits_on_every_handle=False)
    assert events == [("launch", 0), ("wait", 0), ("launch", 1), ("wait", 1), ("launch", 2), ("wait", 2)]


@pytest.mark.parametrize("wrapped", [False, True], ids=["unfixed function", "release with the fix"])
def test_control_otherwise_only_the_last_is_waited(one_rank, monkeypatch, wrapped):
    events = events_of(monkeypatch, release_waits_on_every_handle=True, wrapped=wrapped)
    assert waited(events) == [2] and len(events) == 4
