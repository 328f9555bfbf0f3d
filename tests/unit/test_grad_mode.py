"""`without_grad` (optim/grad_mode.py), the per-step entry points' torch.no_grad(): autograd is off inside and as it
was after (also after an exception), nested calls enter nothing more, and a step through an entry point outside any
no-grad region updates leaves that require grad in place as one inside torch.no_grad() does.
Control: the same function undecorated sees autograd on."""

import pytest
import torch

from deepspeed_bnb.optim.bnb_adapter import BnbAdapter
from deepspeed_bnb.optim.fused.partition import FusedPartition
from deepspeed_bnb.optim.fused.partition_step import PartitionStep
from deepspeed_bnb.optim.grad_mode import without_grad


def seen_grad_mode():
    return torch.is_grad_enabled()


def test_autograd_is_off_inside_and_restored_after():
    assert torch.is_grad_enabled()
    assert seen_grad_mode() is True  # the control
    assert without_grad(seen_grad_mode)() is False
    assert torch.is_grad_enabled()
    with torch.no_grad():
        assert without_grad(seen_grad_mode)() is False
        assert not torch.is_grad_enabled()

    @without_grad
    def fails():
        raise ValueError("planted")
    with pytest.raises(ValueError, match="planted"):
        fails()
    assert torch.is_grad_enabled()


def test_nested_entry_points_enter_once(monkeypatch):
    entered = []
    real = torch.no_grad

    def counting():
        entered.append(1)
        return real()
    monkeypatch.setattr(torch, "no_grad", counting)
    inner = without_grad(seen_grad_mode)
    outer = without_grad(lambda: inner() is False and inner() is False)
    assert outer() and len(entered) == 1


def test_step_entry_points_use_it():
    for method in (PartitionStep.step, FusedPartition.step, BnbAdapter.step):
        assert method.__wrapped__ is not None and method.__code__ is without_grad(seen_grad_mode).__code__


def test_in_place_update_of_a_leaf_that_requires_grad():
    def step(p):
        p.mul_(0.5).add_(1.0)  # what the operators do to the master weights
    leaf = torch.ones(4, requires_grad=True)
    with pytest.raises(RuntimeError):  # the control: autograd refuses it
        step(leaf)
    without_grad(step)(leaf)
    reference = torch.ones(4, requires_grad=True)
    with torch.no_grad():
        step(reference)
    assert torch.equal(leaf.detach(), reference.detach()) and leaf.requires_grad
