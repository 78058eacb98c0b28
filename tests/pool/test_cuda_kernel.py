"""The GPU tier through real kernels (jupyter_client), issue 36: CUDA initialised in the
notebook first; CUDA tensors through ``--need``, ``--out``, ``%ddp push``/``pull``;
``%ddp copy`` of a CUDA model and optimizer; ``log_metrics`` of CUDA scalars; a detached
pool keeping CUDA tensors across a kernel restart. At 2, 4 and 8 ranks sharing one GPU.

The magics test also runs on a 2-rank CPU pool (the same cells: ``dev`` is the notebook's
device), so a mistake in it shows on any machine.
"""

from __future__ import annotations

import ast
import os

import pytest
import torch
from test_detached_kernel import digest, notebook_value
from test_kernel import execute, kernels, restarted  # noqa: F401

from helpers import detached_family, new_kernel
from nbddp.rank.gpus import plan

CUDA = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
pytestmark = pytest.mark.kernel
SHARING = (2, 4, 8)
LAYOUTS = [pytest.param(("cpu", 2), id="cpu-2ranks")] + [
    pytest.param(("cuda", n), id=f"cuda-{n}ranks", marks=CUDA) for n in SHARING
]


def value(kc, expr: str):
    """``expr`` evaluated in the notebook (a literal)."""
    r = execute(kc, f"print(repr({expr}))")
    assert r.error is None, r.text
    return ast.literal_eval(r.stdout.strip())


def ok(kc, code: str, timeout: float = 120) -> str:
    r = execute(kc, code, timeout=timeout)
    assert r.error is None, r.text
    return r.text


def gpus_of(n: int) -> list[str]:
    """Each rank's device where ``n`` ranks take this machine's GPUs round-robin."""
    g = torch.cuda.device_count()
    return [f"cuda:{r % g}" for r in range(n)]


@pytest.fixture(scope="module")
def kernel_for(tmp_path_factory):
    """One kernel for each kind of layout (``cpu``, ``cuda``), started the first time a test
    asks for it: with the GPUs visible for a ``cuda`` test, hidden for a CPU one
    (tests/cpu_machine.py); nbddp loaded. Shut down after the module."""
    started: dict[str, tuple] = {}

    def get(kind: str):
        if kind not in started:
            tmp = tmp_path_factory.mktemp(f"kernel-{kind}")
            env = dict(os.environ, JUPYTER_RUNTIME_DIR=str(tmp / "rt"), IPYTHONDIR=str(tmp / "ip"))
            started[kind] = new_kernel(tmp, env=env)
            ok(started[kind][1], "%load_ext nbddp\nimport torch")
        return started[kind][1]

    try:
        yield get
    finally:
        for km, client in started.values():
            execute(client, "%ddp stop")
            client.stop_channels()
            km.shutdown_kernel(now=True)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_cuda_tensors_through_need_out_push_pull_copy_and_metrics(kernel_for, layout):
    kind, n = layout
    kc = kernel_for(kind)
    ok(kc, f"%ddp start -n {n}" + (" --device cpu" if kind == "cpu" else ""))
    where = gpus_of(n) if kind == "cuda" else ["cpu"] * n
    ok(kc, f"dev = {'cuda' if kind == 'cuda' else 'cpu'!r}")
    ok(kc, "w = torch.ones(2**20, device=dev)\nsmall = torch.full((3,), 2.0, device=dev)")
    ok(kc, "%%ddp --text --quiet --need w,small --out o\n(str(w.device), w.sum().item(), small)")
    got = value(kc, "[(d, s, str(t.device), t.tolist()) for d, s, t in o]")
    assert got == [(d, 2.0**20, d, [2.0] * 3) for d in where]

    ok(kc, "p = torch.arange(10.0, device=dev)\n%ddp push p")
    ok(
        kc,
        "%%ddp --text --quiet --out o\nq = torch.full((2**18,), float(rank), device=device)\n"
        "(str(p.device), p.sum().item())",
    )
    assert value(kc, "o") == [(d, 45.0) for d in where]
    ok(kc, "qs = %ddp pull q --all\none = %ddp pull q --rank 1")
    assert value(kc, "[(str(t.device), t[0].item(), t.numel()) for t in qs]") == [
        (d, float(r), 2**18) for r, d in enumerate(where)
    ]
    assert value(kc, "(one[-1].item(), one.device.type)") == (1.0, kind)

    ok(
        kc,
        "%%ddp --text --quiet\ntorch.manual_seed(rank)\nnet = torch.nn.Linear(16, 8).to(device)\n"
        "adam = torch.optim.Adam(net.parameters())\n"
        "net(torch.randn(2, 16, device=device)).sum().backward()\nadam.step()",
    )
    ok(kc, "%ddp copy net adam --from 0")
    ok(
        kc,
        "%%ddp --text --quiet --out o\n(str(next(net.parameters()).device),\n"
        " [t.cpu().tolist() for t in net.parameters()],\n"
        " adam.state[next(net.parameters())]['exp_avg'].cpu().tolist(),\n"
        " str(adam.state[next(net.parameters())]['exp_avg'].device))",
    )
    copied = value(kc, "o")
    assert [(c[0], c[3]) for c in copied] == [(d, d) for d in where]
    assert all(c[1:3] == copied[0][1:3] for c in copied)

    ok(kc, "%ddp metrics --clear")
    ok(
        kc,
        "%%ddp --text --quiet\nimport nbddp\nfor i in range(20):\n"
        "    nbddp.log_metrics({'loss': torch.tensor(rank + i / 4, device=device),\n"
        "                       'acc': torch.ones((), device=device) * i}, step=i)",
    )
    ok(
        kc,
        "m = %ddp metrics loss\n"
        "rows = m.to_dict('records') if hasattr(m, 'to_dict') else m\n"
        "pts = sorted((int(x['rank']), int(x['step']), float(x['value'])) for x in rows)",
    )
    assert value(kc, "pts") == [(r, i, r + i / 4) for r in range(n) for i in range(20)]
    ok(kc, "%%ddp --quiet\ndel w, small, p, q, net, adam")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.timeout(300)
def test_a_notebook_with_cuda_initialised_starts_nccl_then_shares_the_gpu(kernel):
    """CUDA initialised in the notebook first: ``%%ddp -n G`` forms an NCCL group (a rank
    per GPU) and the notebook's CUDA tensor arrives on each rank's GPU; ``-n 2G`` resizes
    to ranks sharing the GPUs over gloo, said in one line; ``fork`` is refused."""
    _, k = kernel
    g = torch.cuda.device_count()
    ok(
        k,
        "%load_ext nbddp\nimport torch\nx = torch.arange(2**20, dtype=torch.float32, "
        "device='cuda')\nassert torch.cuda.is_initialized()",
    )
    cell = (
        "--text --quiet --need x --out o\nimport torch.distributed as dist\n"
        "(dist.get_backend(), str(device), str(x.device), x.sum().item())"
    )
    total = float(torch.arange(2**20, dtype=torch.float32).sum())
    ok(k, f"%%ddp -n {g} {cell}")
    assert value(k, "o") == [("nccl", d, d, total) for d in gpus_of(g)]
    said = ok(k, f"%%ddp -n {2 * g} {cell}")
    assert said.count(plan(2 * g, count=g).note) == 1, said
    assert value(k, "o") == [("gloo", d, d, total) for d in gpus_of(2 * g)]
    r = execute(k, f"%ddp start -n {2 * g} --start-method fork")
    assert r.text.startswith("UsageError: start method 'fork' is unsafe"), r.text
    assert len(r.text.strip().splitlines()) == 1, r.text
    ok(k, "%ddp stop")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.timeout(400)
@pytest.mark.parametrize("n", [2, 4])
def test_a_detached_pool_keeps_cuda_tensors_across_a_kernel_restart(kernels, n):  # noqa: F811
    name = f"gpu{n}"
    km, k = kernels()
    ok(k, "%load_ext nbddp\nimport torch")
    ok(k, f"%ddp start -n {n} --detached {name}")
    with detached_family(name) as family:
        ok(
            k,
            "%%ddp --text --quiet\nkept = torch.full((1000,), float(rank), device=device)\n"
            "model = torch.nn.Linear(8, 4).to(device)\nopt = torch.optim.Adam(model.parameters())\n"
            "model(torch.randn(2, 8, device=device)).sum().backward()\nopt.step()",
        )
        before = digest(k)
        k = restarted(km, k)
        ok(k, "%load_ext nbddp")
        ok(k, f"%ddp connect {name}")
        assert digest(k) == before
        where = notebook_value(k, "(str(kept.device), str(next(model.parameters()).device))", "d_")
        assert where == [(d, d) for d in gpus_of(n)]
        family.stopped_by(lambda: ok(k, f"%ddp stop {name}"))
