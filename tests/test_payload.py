"""Payloads: cloudpickle, with big tensors through shared-memory files."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from nbddp import payload


@pytest.fixture
def directory(tmp_path):
    return str(tmp_path)


def test_big_tensors_go_through_files_and_come_back_as_real_tensors(directory):
    big = torch.randn(1 << 19)  # 2 MB
    shipment = payload.dumps({"big": big, "small": torch.ones(3)}, directory)
    assert len(shipment.files) == 1 and len(shipment.data) < 10_000
    loaded = payload.loads(shipment.data)
    shipment.remove()
    assert not os.listdir(directory)
    assert torch.equal(loaded["big"], big) and torch.equal(loaded["small"], torch.ones(3))
    loaded["big"][0] = 123.0  # its own memory: writable, and the original is untouched
    assert big[0] != 123.0


def test_parameters_keep_their_type_and_grad_flag(directory):
    p = torch.nn.Parameter(torch.randn(1 << 19))
    frozen = torch.nn.Parameter(torch.randn(1 << 19), requires_grad=False)
    loaded = payload.loads(payload.dumps([p, frozen], directory).data)
    assert isinstance(loaded[0], torch.nn.Parameter) and loaded[0].requires_grad
    assert isinstance(loaded[1], torch.nn.Parameter) and not loaded[1].requires_grad


def test_modules_round_trip_with_their_weights(directory):
    model = torch.nn.Linear(1024, 1024)
    shipment = payload.dumps(model, directory)
    assert shipment.files  # the 4 MB weight went through a file
    loaded = payload.loads(shipment.data)
    assert torch.equal(loaded.weight, model.weight) and torch.equal(loaded.bias, model.bias)


def test_numpy_arrays_and_odd_tensors(directory):
    arr = np.arange(1 << 18, dtype=np.float64)
    view = torch.randn(1024, 1024)[:, ::2]  # not contiguous
    half = torch.randn(1 << 20, dtype=torch.bfloat16)
    loaded = payload.loads(payload.dumps([arr, view, half], directory).data)
    assert isinstance(loaded[0], np.ndarray) and (loaded[0] == arr).all()
    assert torch.equal(loaded[1], view) and torch.equal(loaded[2], half)


def test_without_a_directory_everything_is_inline(directory):
    shipment = payload.dumps(torch.randn(1 << 19))
    assert shipment.files == [] and len(shipment.data) > 2_000_000


def test_a_failed_dump_leaves_no_files(directory):
    import threading

    with pytest.raises(TypeError):
        payload.dumps([torch.randn(1 << 19), threading.Lock()], directory)
    assert not os.listdir(directory)
