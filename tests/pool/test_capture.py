from __future__ import annotations

import contextlib
import copy
import dataclasses
import io
import os
import re
import threading
import types

import pytest
import torch

from nbddp.pool.capture import (
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
    size_of,
    split_names,
)
from nbddp.pool.errors import CaptureError
from nbddp.pool.shipped import Shipped
from nbddp.wire import payload


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
    with pytest.raises(
        CaptureError, match=r"^cannot ship 'lock' \(lock\) to the ranks: TypeError: cannot pickle"
    ):
        pack(objs)


def test_a_shipment_that_fails_only_as_a_whole_says_why(tmp_path):
    gone = str(tmp_path / "gone")  # big tensors cannot go into a folder that is not there
    with pytest.raises(CaptureError, match=r"^cannot ship the objects: FileNotFoundError: .*gone"):
        pack({"big": torch.ones(1 << 19)}, gone)


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
    "w": 0,
    "last": 0,
    "_": types.SimpleNamespace(),
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
    ("for k in keys:\n    pass\nelse:\n    print(last)", ["keys", "print", "last"]),
    ("while False:\n    pass\nelse:\n    print(x)", ["print", "x"]),
    (
        "try:\n    pass\nexcept ValueError:\n    pass\nelse:\n    print(x)\nfinally:\n"
        "    print(limit)",
        ["ValueError", "print", "x", "limit"],
    ),
    ("match x:\n    case 21 if limit:\n        print(limit)", ["x", "limit", "print"]),
    (
        "s = {(q := v) for v in data}\nd = {(r := v): v for v in data}\nprint(q, r)",
        ["data", "print"],
    ),
    ("g = (w := v for v in data)\nprint(w)", ["data", "print", "w"]),
    (
        "class Two:\n    def a(self):\n        return scale\n    def b(self):\n"
        "        return limit\nTwo()",
        ["scale", "limit"],
    ),
    ("def f():\n    global counter\n    counter = 1\nprint(counter)", ["print", "counter"]),
    ("for _.n in data:\n    pass", ["data", "_"]),
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


@pytest.mark.parametrize(
    ("code", "expected"), CELLS, ids=[re.sub(r"\W+", "_", c[:30]).strip("_") for c, _ in CELLS]
)
def test_names_read_follow_pythons_scoping(code, expected):
    assert names_read(code) == expected
    # never fewer than Python needs (more only where a binding may not happen first)
    assert set(needed(code, NOTEBOOK)) <= set(names_read(code))


# ---------------------------------------------------------------- sizes, ship folder, what was sent


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("100MB", 100 * 2**20),
        ("1.5GB", int(1.5 * 2**30)),
        ("512KB", 512 * 2**10),
        ("512k", 512 * 2**10),
        ("2048B", 2048),
        ("10", 10 * 2**20),  # a bare number is megabytes
        (" 1 gb ", 2**30),
        ("3M", 3 * 2**20),
    ],
)
def test_sizes_are_read_in_binary_units(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "MB", "1.5.2GB", "10TB", "-1MB", "ten"])
def test_a_size_that_is_not_one_says_how_to_write_it(text):
    with pytest.raises(CaptureError, match=r"not a size: .* \(say 100MB, 1GB, 512KB\)"):
        parse_size(text)


@pytest.mark.parametrize(
    ("nbytes", "text"),
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1024, "1.0 KB"),
        (1536, "1.5 KB"),
        (5 * 2**20, "5.0 MB"),
        (3 * 2**30, "3.0 GB"),
        (2**42, "4096.0 GB"),
    ],
)
def test_sizes_are_said_in_binary_units(nbytes, text):
    assert human(nbytes) == text


def test_big_tensors_ship_through_the_folder_given_and_inline_without_one():
    folder = payload.shm_dir()
    try:
        shipment = pack({"big": torch.ones(1 << 19)}, folder)  # 2 MB: over the threshold
        assert shipment.files
        assert all(os.path.dirname(f) == folder for f in shipment.files)
        assert torch.equal(payload.loads(shipment.data)["big"], torch.ones(1 << 19))
        shipment.remove()
        inline = pack({"big": torch.ones(1 << 19)}, None)  # ranks on other hosts
        assert not inline.files
        assert len(inline.data) > 2 * 2**20
    finally:
        os.rmdir(folder)


def test_what_was_shipped_counts_as_unchanged_while_the_notebook_binds_the_same_object():

    shipped, t, big = Shipped(), torch.ones(2), [1, 2]
    assert not shipped.unchanged(1, "t", t)
    shipped.sent(1, "t", t)
    shipped.sent(1, "n", 5)  # not weakly referable: held as it is
    shipped.sent(1, "big", big)
    assert shipped.unchanged(1, "t", t)
    assert shipped.unchanged(1, "n", 5)
    assert shipped.unchanged(1, "big", big)
    assert not shipped.unchanged(1, "t", torch.ones(2))  # rebound: ship again
    assert not shipped.unchanged(1, "other", t)
    assert not shipped.unchanged(2, "t", t)  # a new pool has nothing
    assert not shipped.unchanged(2, "n", 5)


def test_an_objects_version_holds_across_generations_while_the_notebook_binds_it():
    shipped, t, n = Shipped(), torch.ones(2), 5
    first = shipped.versions({"t": t, "n": n})
    assert shipped.versions({"t": t, "n": n}) == first  # the same objects, any generation
    again = shipped.versions({"t": torch.ones(2), "n": 6})  # rebound in the notebook
    assert again["t"] != first["t"]
    assert again["n"] != first["n"]
    assert len({first["t"], first["n"], again["t"], again["n"]}) == 4


def test_two_kernels_versions_never_meet_and_say_whose_they_are():
    """Issue 47, item 2: each kernel counted from 1, so a restarted kernel's ``lr`` could
    carry the version of the earlier kernel's: a detached pool's ranks took it for theirs."""
    from nbddp.wire import protocol as P

    a, b, lr = Shipped(), Shipped(), 0.1
    va, vb = a.versions({"lr": lr}), b.versions({"lr": lr})
    assert va["lr"] != vb["lr"]
    assert P.kernel_of(va["lr"]) == P.kernel_of(a.versions({"m": [1]})["m"]) == a.tag
    assert P.kernel_of(va["lr"]) != P.kernel_of(vb["lr"])
    assert a.names() == {"lr", "m"}


def test_what_the_notebook_deleted_or_rebound_is_let_go():
    """Issue 47, item 10: a list, dict or str ever shipped stayed alive, ``del`` or not."""
    import sys

    shipped = Shipped()
    big, text, kept = [0] * 1000, "x" * 10_000 + "!", {"a": 1}
    ns = {"big": big, "text": text, "kept": kept}
    before = sys.getrefcount(big), sys.getrefcount(text)
    for gen in (1, 2):
        for name, obj in ns.items():
            shipped.sent(gen, name, obj)
    versions = shipped.versions(ns)
    assert (sys.getrefcount(big), sys.getrefcount(text)) > before  # held by the records
    del ns["big"]
    ns["text"] = "rebound"
    shipped.forget_unbound(ns)
    assert (sys.getrefcount(big), sys.getrefcount(text)) == (before[0] - 1, before[1] - 1)
    assert shipped.unchanged(2, "kept", kept)  # still bound: its record stays
    assert shipped.versions({"kept": kept}) == {"kept": versions["kept"]}
    assert shipped.names() == {"big", "text", "kept"}  # what this kernel ever shipped


def test_a_collected_object_is_not_mistaken_for_a_new_one():
    import gc

    shipped = Shipped()
    t = torch.ones(2)
    shipped.sent(1, "t", t)
    del t
    gc.collect()
    assert not shipped.unchanged(1, "t", None)
    assert not shipped.unchanged(1, "t", torch.ones(2))


def test_collect_returns_the_named_objects_in_order_or_names_every_missing_one():
    assert list(collect(["b", "a"], {"a": 1, "b": 2, "c": 3}).items()) == [("b", 2), ("a", 1)]
    assert collect([], {"a": 1}) == {}
    with pytest.raises(CaptureError) as one:
        collect(["a", "x"], {"a": 1})
    assert str(one.value) == "name 'x' is not defined in the notebook"
    with pytest.raises(CaptureError) as several:
        collect(["x", "a", "y", "z"], {"a": 1})
    assert str(several.value) == "name 'x' is not defined in the notebook (nor 'y', 'z')"
    with pytest.raises(CaptureError) as two:
        collect(["x", "y"], {})
    assert str(two.value) == "name 'x' is not defined in the notebook (nor 'y')"


def test_import_text_is_kept_as_written_and_errors_quote_it():
    assert check_imports(None) == ""
    assert check_imports("   ") == ""
    assert check_imports("  import os  \n") == "import os"
    with pytest.raises(CaptureError) as other:
        check_imports("import os\nx = 1")
    assert str(other.value) == "--imports takes import statements only, not 'x = 1'"
    with pytest.raises(CaptureError) as broken:
        check_imports("import (")
    assert str(broken.value).startswith("--imports is not valid Python: ")
    assert str(broken.value).endswith(": 'import ('")


def test_rank_lists_and_ranges():
    assert parse_ranks(None) is None
    assert parse_ranks("0,2-3") == [0, 2, 3]
    assert parse_ranks(" 3 , 1,1 ") == [1, 3]
    assert parse_ranks("2-2") == [2]
    assert parse_ranks("0-3", 4) == [0, 1, 2, 3]
    with pytest.raises(CaptureError) as empty:
        parse_ranks("3-1")
    assert str(empty.value) == "--ranks: empty range '3-1'"
    with pytest.raises(CaptureError) as outside:
        parse_ranks("1,4", 4)
    assert str(outside.value) == "--ranks: no rank 4 in a pool of 4"
    with pytest.raises(CaptureError) as bad:
        parse_ranks("0;1")
    assert str(bad.value) == "--ranks takes ranks like 0,2-3, not '0;1'"


def test_names_from_none_are_none():
    assert split_names(None) == []
    assert split_names(",a, ,b") == ["a", "b"]  # an empty piece is skipped, not the end
    assert split_names(" a\tb\nc ") == ["a", "b", "c"]


def test_top_level_await_counts_every_name_it_mentions():
    """IPython runs top-level await (symtable reads it as any expression)."""
    assert names_read("await asyncio.sleep(delay)\nprint(x)") == ["asyncio", "delay", "print", "x"]


def test_a_statement_symtable_refuses_counts_every_name_in_it():
    """The ranks will report the error; meanwhile every name it mentions counts."""
    code = "def f():\n    nonlocal q\n    return z + y\nprint(x)"
    assert names_read(code) == ["z", "y", "print", "x"]


# ---------------------------------------------------------------- how big, what goes


def test_sizes_of_tensors_modules_arrays_and_the_rest():
    import numpy as np

    assert size_of(torch.ones(10)) == 40
    linear = torch.nn.Linear(4, 2)
    linear.register_buffer("steps", torch.zeros(3))
    assert size_of(linear) == (8 + 2 + 3) * 4 + 1024
    assert size_of(np.ones(5)) == 40
    things = [1, 2, 3]
    assert size_of(things) == len(payload.dumps(things).data)
    looks_like_an_array = types.SimpleNamespace(nbytes=10**9)  # not numpy: pickled
    assert size_of(looks_like_an_array) == len(payload.dumps(looks_like_an_array).data)


class _Chunk:
    """Pickles to a fresh 1 MB of bytes, made only when it is asked for."""

    made = 0

    def __reduce__(self):
        _Chunk.made += 1
        return bytes, (bytes(2**20),)


def test_an_object_over_the_limit_is_refused_before_it_is_ever_pickled_whole():
    import tracemalloc

    chunks = [_Chunk() for _ in range(64)]  # 64 MB, if pickled whole
    _Chunk.made = 0
    tracemalloc.start()
    try:
        _, _, notes = select_auto("chunks", {"chunks": chunks}, frozenset(), [], limit=4 * 2**20)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert _Chunk.made <= 5  # it stopped once past the limit
    assert peak < 16 * 2**20  # never more than a few chunks in memory
    assert notes == [
        "chunks not shipped automatically: it pickles to more than the 4.0 MB limit "
        "(name it with --need chunks)"
    ]


class _Zero:
    """Pickles as the stand-in sizing leaves where a tensor or an array was."""

    def __reduce__(self):
        return int, ()


def test_sizing_stops_just_past_the_limit_and_not_before():
    things = [1, "two", 3.0]
    exact = len(payload.dumps(things).data)
    assert size_of(things, exact) == exact
    assert size_of(things, exact - 1) is None
    assert size_of(things, None) == exact


def test_tensors_and_arrays_inside_objects_count_their_bytes_unpickled():
    import numpy as np

    frame = len(payload.dumps({"t": _Zero()}).data)
    assert size_of({"t": torch.zeros(2**20)}) == 4 * 2**20 + frame
    assert size_of({"t": np.zeros(2**20)}) == 8 * 2**20 + frame
    assert size_of({"t": torch.zeros(2**20)}, 4 * 2**20) is None  # it counts toward the limit
    assert size_of({"t": np.zeros(2**20)}, 8 * 2**20) is None
    objects = np.array([None, "x"], dtype=object)  # its nbytes are pointers: pickled
    assert size_of({"t": objects}) == len(payload.dumps({"t": objects}).data)


def test_a_name_over_the_limit_by_its_own_size_says_the_size():
    ns = {"t": torch.zeros(2**20)}
    _, _, notes = select_auto("t", ns, frozenset(), [], limit=2**20)
    assert notes == [
        "t not shipped automatically: 4.0 MB is over the 1.0 MB limit (name it with --need t)"
    ]


def test_automatic_capture_goes_on_after_a_name_it_leaves_behind():
    ns = {
        "lock": threading.Lock(),
        "big": torch.zeros(2**20),
        "sent": 1,
        "len": 5,  # the notebook shadows a builtin: never shipped
        "edge": torch.zeros(256),  # 1024 bytes: exactly the limit
        "data": 7,
    }
    chosen, _, notes = select_auto(
        "lock, big, sent, len, edge, data",
        ns,
        frozenset(),
        [],
        limit=1024,
        already_sent=lambda name, obj: obj is ns["sent"] and name == "sent",
    )
    assert list(chosen) == ["edge", "data"]
    assert len(notes) == 2


def test_what_was_shipped_is_not_kept_alive_by_the_record():
    import gc
    import weakref

    shipped, t = Shipped(), torch.ones(2)
    shipped.sent(1, "t", t)
    alive = weakref.ref(t)
    del t
    gc.collect()
    assert alive() is None
