"""The suite's bit-for-bit state comparison (support/bnb_state.py: differing_keys, same_state, assert_same), on which
the equality tests of the kernels, the checkpoint tools and the hpZ scenarios rest: a parameter's real bnb AdamW8bit
state equals its deep copy, and each kind of difference those tests must catch is named by its key: one code, one
absmax bit, a dtype, a key missing, a step count. Control: the copy compared must be equal before the change."""

import copy

import bitsandbytes as bnb
import pytest
import torch

from support.bnb_state import assert_same, differing_keys, same_state


@pytest.fixture(scope="module")
def state():
    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(4096))  # above bnb's min_8bit_size: 8-bit codes, maps and absmax
    optimizer = bnb.optim.AdamW8bit([param], lr=1e-3)
    for _ in range(2):
        param.grad = torch.randn(4096)
        optimizer.step()
    out = optimizer.state[param]
    assert out["state1"].dtype == torch.uint8 and "absmax2" in out
    return out


def changed(state, key, change):
    other = copy.deepcopy(state)
    assert same_state(state, other)  # the control: the copy alone is equal
    change(other, key)
    return other


def flip_low_bit(s, key):
    s[key].view(torch.int32 if s[key].dtype == torch.float32 else torch.uint8).view(-1)[7] ^= 1


CHANGES = {
    "one code": ("state1", flip_low_bit),
    "one absmax bit": ("absmax2", flip_low_bit),
    "a dtype": ("qmap1", lambda s, k: s.__setitem__(k, s[k].double())),
    "a step count": ("step", lambda s, k: s.__setitem__(k, s[k] + 1)),
}


@pytest.mark.parametrize("kind", sorted(CHANGES))
def test_each_difference_is_named_by_its_key(state, kind):
    key, change = CHANGES[kind]
    other = changed(state, key, change)
    assert differing_keys(state, other) == [key]
    assert not same_state(state, other)
    with pytest.raises(AssertionError, match=key):
        assert_same(state, other, "parameter 0")


def test_a_missing_key_differs(state):
    other = changed(state, "absmax1", lambda s, k: s.pop(k))
    assert "absmax1" in differing_keys(state, other) and not same_state(other, state)


def test_equal_states_pass(state):
    assert differing_keys(state, copy.deepcopy(state)) == []
    assert_same(state, copy.deepcopy(state), "parameter 0")
