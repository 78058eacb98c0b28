from __future__ import annotations

import contextlib
import copy
import dataclasses
import io
import threading
import types

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
    # in the order they are first used when the cell runs (f's body counts at its def)
    assert names_read(code) == ["data", "scale", "range", "print", "model", "keys"]
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
    assert parse_size("100MB") == 100 * 2**20
    assert parse_size("1.5GB") == int(1.5 * 2**30)
    assert parse_size("512kb") == 512 * 2**10
    assert parse_size("3") == 3 * 2**20
    with pytest.raises(CaptureError, match="not a size"):
        parse_size("lots")
    assert human(512) == "512 B"
    assert human(3 * 2**20) == "3.0 MB"


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
    assert list(chosen) == ["data"]
    assert sizes == {"data": sizes["data"]}
    assert sizes["data"] > 0
    assert notes == [
        "big not shipped automatically: 4.0 MB is over the 1.0 MB limit (name it with --need big)",
    ]
    _, _, notes = select_auto("lock", ns, frozenset(), [], limit=2**20)
    assert notes == [
        "lock not shipped: cannot pickle it (TypeError: cannot pickle '_thread.lock' object)",
    ]


# ---------------------------------------------------------------- names_read against Python


@dataclasses.dataclass
class Point:
    x: int = 0


NOTEBOOK = {
    "x": 21,
    "lr": 0.1,
    "n_items": 7,
    "data": [1, 2, 3],
    "scale": 2,
    "limit": 1,
    "counter": 0,
    "i": 0,
    "rank": 0,
    "prev": 0,
    "late": 0,
    "keys": [1],
    "Point": Point,
    "point": Point(3),
    "risky": lambda: None,
    "wraps_with": lambda f: f,
    "Number": int,
    "open_thing": lambda: contextlib.nullcontext(5),
    "model": types.SimpleNamespace(),
    "get_ipython": lambda: types.SimpleNamespace(run_line_magic=lambda *args: None),
}

# (cell, the names it must ship, in order of first use)
CELLS = [
    ("def f(x):\n    return x * 2\nprint(f(x))", ["print", "x"]),
    ("print(lr); lr = 0.5", ["print", "lr"]),
    ("class A:\n    n_items = 1\nprint(n_items)", ["print", "n_items"]),
    (
        "def outer():\n    a = 1\n    def inner():\n        return a + scale\n    return inner\n"
        "outer()()",
        ["scale"],
    ),
    ("def bump():\n    global counter\n    counter += 1\nbump()", ["counter"]),
    ("g = lambda v: v * scale\nprint(g(2))", ["scale", "print"]),
    ("[i * scale for i in data]\nprint(i)", ["scale", "data", "print", "i"]),
    ("total = sum(v for v in data if v > limit)", ["sum", "data", "limit"]),
    ("squares = {v: v * v for v in data}\nodd = {v for v in data if v % 2}", ["data"]),
    ("class Cfg:\n    size = n_items * 2\nprint(Cfg.size)", ["n_items", "print"]),
    ("del x", ["x"]),
    ("if (n := len(data)) > 2:\n    print(n)", ["len", "data", "print"]),
    ("ys = [y := v * 2 for v in data]\nprint(y)", ["data", "print"]),
    (
        "match x:\n    case 21:\n        print('yes')\n    case other:\n        print(other)",
        ["x", "print"],
    ),
    ("match point:\n    case Point(x=px):\n        print(px)", ["point", "Point", "print"]),
    (
        "try:\n    risky()\nexcept ValueError as err:\n    print(err)",
        ["risky", "ValueError", "print"],
    ),
    ("from math import *\nprint(pi)", ["print", "pi"]),
    ("@wraps_with\ndef h():\n    return 1", ["wraps_with"]),
    ("z: Number = 5", ["Number"]),
    ("def k(a: Number = lr):\n    return a\nk()", ["Number", "lr"]),
    (
        "for step in range(2):\n    if step:\n        print(prev)\n    prev = step",
        ["range", "print", "prev"],
    ),
    ("if rank == 0:\n    x = 1\nprint(x)", ["rank", "print", "x"]),
    ("lr *= 2", ["lr"]),
    ("x = x + 1", ["x"]),
    ("with open_thing() as fh:\n    pass\nprint(fh)", ["open_thing", "print"]),
    ("def later():\n    return late\nlate = 1\nprint(later())", ["late", "print"]),
    ("import os\nprint(os.sep)", ["print"]),
    ("def m():\n    return [a for a in data if a > limit]\nm()", ["data", "limit"]),
    ("class Net:\n    def forward(self):\n        return scale\nNet().forward()", ["scale"]),
    ("model.lr = lr", ["model", "lr"]),
    ("first, *rest = data\nprint(rest)", ["data", "print"]),
    ("for k in keys:\n    last = k\nprint(last)", ["keys", "print", "last"]),
    ("while counter < 2:\n    counter += 1", ["counter"]),
    ("get_ipython().run_line_magic('time', 'y = 1')", ["get_ipython"]),
]


def needed(code: str, notebook: dict) -> list[str]:
    """What running ``code`` in a fresh namespace asks of the notebook: each NameError
    names one more, until it runs."""
    names: list[str] = []
    while True:
        namespace = {n: copy.copy(notebook[n]) for n in names}
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                exec(compile(code, "<cell>", "exec"), namespace)
            return names
        except NameError as exc:
            missing = exc.name
        assert missing in notebook, missing
        assert missing not in names, missing
        names.append(missing)


def test_the_cells_cover_the_scoping_rules():
    assert len(CELLS) >= 25


@pytest.mark.parametrize(("code", "expected"), CELLS, ids=[c[:30] for c, _ in CELLS])
def test_names_read_follow_pythons_scoping(code, expected):
    assert names_read(code) == expected
    # never fewer than Python needs (more only where a binding may not happen first)
    assert set(needed(code, NOTEBOOK)) <= set(names_read(code))
