"""The default model: the packaged SmolLM2-135M-Instruct GGUF, converted once into the data directory."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from megalith_llama.model import SMOLLM2_DIRNAME, load_model, smollm2_gguf_path


def _dequantized(*names: str) -> list[np.ndarray]:
    """Independent reference: tensors straight from the GGUF file via the gguf library."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    tensors = {t.name: t for t in GGUFReader(str(smollm2_gguf_path())).tensors}
    return [
        dequantize(t.data, t.tensor_type).reshape([int(x) for x in reversed(t.shape)])
        for t in (tensors[n] for n in names)
    ]


@pytest.fixture
def data_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A fresh data directory, deleted afterwards (the converted model is about 540 MB)."""
    monkeypatch.setenv("MEGALITH_DATA_DIR", str(tmp_path))
    yield tmp_path
    shutil.rmtree(tmp_path / "models", ignore_errors=True)


@pytest.mark.slow
def test_default_model_converted_once(data_dir: Path) -> None:
    tmp_path = data_dir
    loaded = load_model()  # converts the GGUF into tmp_path/models/SmolLM2-135M-Instruct
    target = tmp_path / "models" / SMOLLM2_DIRNAME
    assert (target / "model.safetensors").is_file() and (target / "tokenizer.json").is_file()
    assert sorted(p.name for p in tmp_path.joinpath("models").iterdir()) == [SMOLLM2_DIRNAME]
    model = loaded.model
    assert model.config.tie_word_embeddings and "quantization_config" not in model.config.to_dict()
    emb = model.get_input_embeddings().weight
    assert model.get_output_embeddings().weight.data_ptr() == emb.data_ptr()
    ref_emb, ref_down = _dequantized("token_embd.weight", "blk.0.ffn_down.weight")
    np.testing.assert_allclose(emb.detach().numpy(), ref_emb, rtol=0, atol=1e-6)
    down = model.model.layers[0].mlp.down_proj.weight.detach().numpy()
    np.testing.assert_allclose(down, ref_down, rtol=0, atol=1e-6)

    mtime = (target / "model.safetensors").stat().st_mtime_ns
    again = load_model(data_dir=tmp_path)  # second load reads the cache, no re-conversion
    assert (target / "model.safetensors").stat().st_mtime_ns == mtime
    tok = again.tokenizer
    assert len(tok) == again.model.config.vocab_size == 49152
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.no_grad():
        out = again.model.generate(**prompt, max_new_tokens=12, do_sample=False)
    assert "Paris" in tok.decode(out[0, prompt["input_ids"].shape[1] :])
