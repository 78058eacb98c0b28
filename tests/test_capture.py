from __future__ import annotations

import threading

import pytest

from nbddp import payload
from nbddp.capture import (
    check_imports,
    collect,
    human,
    import_statements,
    names_imported,
    names_read,
    pack,
    parse_ranks,
    parse_size,
    select_auto,
    split_names,
)
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

    shipment = pack({"f": f})
    assert payload.loads(shipment.data)["f"](1) == 2
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


def test_names_read_are_those_the_cell_uses_but_never_binds():
    code = (
        "x = data + 1\n"
        "def f(a):\n    return a * scale\n"
        "for i in range(3):\n    y = f(i)\n"
        "import os\n"
        "print(os, model(x), [k for k in keys])"
    )
    assert names_read(code) == ["data", "range", "print", "scale", "model", "keys"]
    assert names_read("x = (") == []


def test_import_statements_of_notebook_code():
    code = "import numpy as np\nfrom a.b import (c,\n d)\nx = 1\nfrom __future__ import annotations"
    assert import_statements(code) == ["import numpy as np", "from a.b import c, d"]
    assert names_imported(["import numpy as np", "from a.b import c, d", "import os.path"]) == {
        "np",
        "c",
        "d",
        "os",
    }


def test_sizes_parse_and_print():
    assert parse_size("100MB") == 100 * 2**20 and parse_size("1.5GB") == int(1.5 * 2**30)
    assert parse_size("512kb") == 512 * 2**10 and parse_size("3") == 3 * 2**20
    with pytest.raises(CaptureError, match="not a size"):
        parse_size("lots")
    assert human(512) == "512 B" and human(3 * 2**20) == "3.0 MB"


def test_auto_selection_rules():
    import torch

    ns = {
        "data": 1,
        "mine": 2,
        "big": torch.zeros(2**20),
        "lock": threading.Lock(),
        "_private": 3,
        "np": 4,
        "given": 5,
    }
    code = "data, mine, big, lock, _private, np, given, missing, print"
    chosen, sizes, notes = select_auto(
        code,
        ns,
        frozenset({"mine"}),
        ["given"],
        limit=2**20,
        imported={"np"},
        already_sent=lambda name, obj: name == "lock",  # never even sized, so no note
    )
    assert list(chosen) == ["data"] and sizes == {"data": sizes["data"]} and sizes["data"] > 0
    assert notes == [
        "big not shipped automatically: 4.0 MB is over the 1.0 MB limit (name it with --need big)",
    ]
    _, _, notes = select_auto("lock", ns, frozenset(), [], limit=2**20)
    assert notes == [
        "lock not shipped: cannot pickle it (TypeError: cannot pickle '_thread.lock' object)",
    ]
