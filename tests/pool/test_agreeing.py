"""Which ranks hold a DDP model apart after a re-form (pure: roster-like records), and the
fingerprint each rank sends. The pool's copy and notes: tests/pool/test_keep_training.py."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from nbddp.pool.agreeing import Apart, apart
from nbddp.rank.rebind import fingerprint


@dataclass
class Rec:
    rank: int
    weights: tuple = ()


def recs(digests: list[str], opts: str = "opt") -> list[Rec]:
    return [Rec(r, (("model", d, opts),)) for r, d in enumerate(digests)]


@pytest.mark.parametrize("n", [3, 8, 64])
def test_the_largest_group_is_the_model_and_the_rest_are_apart(n):
    digests = ["a"] * n
    digests[1] = "b"
    assert apart(recs(digests)) == [
        Apart("model", 0, tuple(r for r in range(n) if r != 1), (1,), ("opt",))
    ]
    assert apart(recs(["a"] * n)) == []  # one model: nothing said


def test_a_tie_goes_to_the_group_with_the_lowest_rank_and_unread_digests_do_not_count():
    assert apart(recs(["b", "a", "a", "b"])) == [Apart("model", 0, (0, 3), (1, 2), ("opt",))]
    # a rank that could not fingerprint ("") is neither apart nor agreeing
    assert apart(recs(["a", "", "a"])) == []
    # the majority need not hold rank 0: the source is its lowest rank
    assert apart(recs(["b", "a", "a"], opts="")) == [Apart("model", 1, (1, 2), (0,), ())]


def test_a_fingerprint_tells_one_optimizer_step_apart():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1))
    twin = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1))
    twin.load_state_dict(net.state_dict())
    assert fingerprint(net) == fingerprint(twin) != ""
    opt = torch.optim.SGD(twin.parameters(), lr=1e-3)
    twin(torch.ones(1, 4)).sum().backward()
    opt.step()
    assert fingerprint(net) != fingerprint(twin)
    assert fingerprint(net.to(torch.bfloat16)) != ""  # (no numpy bfloat16: read as bytes)
    assert fingerprint(torch.nn.Linear(2, 2, device="meta")) == ""  # nothing to read
