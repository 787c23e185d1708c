"""The AutoFit state ranks go on from after a resume: what each rank read from the checkpoint, agreed on by all."""

from __future__ import annotations

import logging

import pytest

from lightning_efficient.autofit import fit_inputs

STATE = {"settings": {"budget": [1 << 30]}, "plan": {"micro_batch": 4}, "measured": None}


@pytest.fixture
def ranks_read(monkeypatch):
    """Stand in for the gather across ranks (a process group of one has nothing to gather): each rank's reading."""

    def read(*states):
        monkeypatch.setattr(fit_inputs, "gather_objects", lambda mine: [mine, *states[1:]])
        return states[0]

    return read


def test_ranks_that_read_the_same_state_go_on_with_it(ranks_read):
    assert fit_inputs.agreed_restored_state(ranks_read(STATE, dict(STATE))) == STATE


def test_a_rank_that_read_nothing_takes_the_state_the_others_read(ranks_read, caplog):
    with caplog.at_level(logging.INFO):
        assert fit_inputs.agreed_restored_state(ranks_read(None, STATE, STATE)) == STATE
    assert "rank(s) [0] read no AutoFit state from the checkpoint; the state the other ranks read" in caplog.text


def test_ranks_that_read_different_states_all_plan_again(ranks_read, caplog):
    other = dict(STATE, plan={"micro_batch": 2})
    with caplog.at_level(logging.INFO):
        assert fit_inputs.agreed_restored_state(ranks_read(STATE, other)) is None
        assert fit_inputs.agreed_restored_state(ranks_read(other, None, STATE)) is None
    assert "the ranks read different AutoFit states from the checkpoint; planning again on every rank" in caplog.text


def test_no_rank_reading_a_state_plans_as_a_fresh_fit(ranks_read):
    assert fit_inputs.agreed_restored_state(ranks_read(None, None)) is None


def test_without_a_process_group_the_state_read_is_the_one_used():
    assert fit_inputs.agreed_restored_state(STATE) == STATE
    assert fit_inputs.agreed_restored_state(None) is None
