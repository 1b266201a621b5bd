"""Shared fixtures: offline HF environment, a tiny Llama, synthetic batches, a reference trainer."""

from __future__ import annotations

import os
import tempfile

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
os.environ.setdefault("HF_HOME", tempfile.mkdtemp(prefix="megalith-hf-"))


# Without a GPU, megalith's Triton kernels run in Triton's interpreter (fp32). The variable must be
# set before anything imports triton (transformers' Llama module does), so it is set here.
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Import the heavy modelling code once in the pytest process: forked ranks inherit it instead of
# each importing transformers' Llama (seconds per rank on 2 cores).
import transformers.models.llama.modeling_llama  # noqa: F401


@pytest.fixture(autouse=True)
def _offline_hf(monkeypatch, tmp_path_factory):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path_factory.mktemp("hf_home")))
