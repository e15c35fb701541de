"""The unit tier's guard (tests/unit/conftest.py) refuses every way of starting a process."""

from __future__ import annotations

import importlib
import multiprocessing
import os
import subprocess
import threading

import pytest

from conftest import RULE, TRAINING_ENTRY_POINTS, ProcessStartRefused

# The refusals are expected here: without the mark the guard fails the test after it ran.
REFUSALS_EXPECTED = pytest.mark.guard_selftest


@REFUSALS_EXPECTED
def test_a_subprocess_is_refused_naming_the_rule():
    with pytest.raises(ProcessStartRefused, match="tests/unit starts no process"):
        subprocess.run(["true"])


@REFUSALS_EXPECTED
def test_fork_and_multiprocessing_are_refused():
    with pytest.raises(ProcessStartRefused):
        os.fork()
    with pytest.raises(ProcessStartRefused):
        multiprocessing.get_context("spawn").Process(target=print).start()


@REFUSALS_EXPECTED
def test_training_entry_points_are_refused_and_still_exist():
    for spec in TRAINING_ENTRY_POINTS:
        module, attr = spec.split(":")
        with pytest.raises(ProcessStartRefused, match=RULE[:20]):
            getattr(importlib.import_module(module), attr)()


def test_threads_are_allowed():
    seen = []
    thread = threading.Thread(target=seen.append, args=(1,))
    thread.start()
    thread.join()
    assert seen == [1]
