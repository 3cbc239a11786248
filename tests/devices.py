"""The devices a test runs on: the CPU always, CUDA when a GPU and a CUDA build are present."""
import pytest
import torch

import maskedbranch as mb

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.cuda,
            pytest.mark.skipif(not (torch.cuda.is_available() and mb.WITH_CUDA), reason="needs a GPU and a CUDA build"),
        ],
    ),
]
