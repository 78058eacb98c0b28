from __future__ import annotations

import threading

import cloudpickle
import pytest

from nbddp.capture import check_imports, collect, pack, parse_ranks, split_names
from nbddp.errors import CaptureError


def test_names_split_on_commas_and_spaces():
    assert split_names("a,b  c,,a") == ["a", "b", "c"]
    assert split_names("") == []


def test_a_bad_name_is_an_error():
    with pytest.raises(CaptureError, match="not a Python name: '1x'"):
        split_names("a 1x")


def test_a_missing_name_is_named():
    with pytest.raises(CaptureError, match="name 'nope' is not defined in the notebook"):
        collect(["a", "nope"], {"a": 1})


def test_an_unpicklable_object_is_named_with_the_reason():
    objs = {"fine": 1, "lock": threading.Lock()}
    with pytest.raises(CaptureError, match=r"cannot ship 'lock' \(lock\).*cannot pickle"):
        pack(objs)


def test_pack_round_trips_functions_by_value():
    def f(x):
        return x + 1

    assert cloudpickle.loads(pack({"f": f}))["f"](1) == 2
    assert pack({}) is None


def test_imports_accept_import_statements_only():
    assert check_imports("import os; from math import (pi,\n tau)").startswith("import os")
    with pytest.raises(CaptureError, match="import statements only"):
        check_imports("import os; x = 1")
    with pytest.raises(CaptureError, match="not valid Python"):
        check_imports("import")


def test_ranks_parse_lists_and_ranges():
    assert parse_ranks("0,2-3") == [0, 2, 3]
    assert parse_ranks(None) is None
    with pytest.raises(CaptureError, match="no rank 4 in a pool of 4"):
        parse_ranks("4", 4)
    with pytest.raises(CaptureError, match="ranks like"):
        parse_ranks("a")
