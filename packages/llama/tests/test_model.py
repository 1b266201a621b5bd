"""Model loading: tiny configs, HF directories, bad inputs, data directory, atomic writes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megalith.common.errors import CheckpointError, ConfigError
from megalith_llama.io import atomic_directory
from megalith_llama.model import check_seq_len, load_model, load_tokenizer
from megalith_llama.paths import data_dir


def test_tiny_config_shape_and_seed(bpe_tokenizer) -> None:
    a = load_model("tiny", tokenizer=bpe_tokenizer, seed=1)
    cfg = a.model.config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (
        64,
        2,
        4,
        2,
    )
    assert cfg.vocab_size == len(bpe_tokenizer) == 400
    assert cfg.eos_token_id == bpe_tokenizer.eos_token_id
    assert a.model.lm_head.weight.data_ptr() == a.model.model.embed_tokens.weight.data_ptr()
    b = load_model("tiny", tokenizer=bpe_tokenizer, seed=1)
    c = load_model("tiny", tokenizer=bpe_tokenizer, seed=2)
    w = "model.layers.0.mlp.up_proj.weight"
    assert torch.equal(a.model.state_dict()[w], b.model.state_dict()[w])
    assert not torch.equal(a.model.state_dict()[w], c.model.state_dict()[w])


def test_hf_directory_round_trip(bpe_tokenizer, tmp_path: Path) -> None:
    tiny = load_model("tiny-32", tokenizer=bpe_tokenizer, seed=3)
    tiny.model.save_pretrained(tmp_path)
    tiny.tokenizer.save_pretrained(tmp_path)
    loaded = load_model(tmp_path)
    ids = torch.tensor([bpe_tokenizer.encode("the model learns tokens")])
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(ids).logits, tiny.model.eval()(ids).logits)
    assert loaded.tokenizer.encode("the data") == bpe_tokenizer.encode("the data")
    assert load_model(str(tmp_path), tokenizer=str(tmp_path)).source == str(tmp_path)


def test_bad_model_inputs_name_the_path(bpe_tokenizer, tmp_path: Path) -> None:
    missing = tmp_path / "nope" / "model"
    with pytest.raises(CheckpointError, match=f"does not exist: {missing}"):
        load_model(missing, tokenizer=bpe_tokenizer)
    corrupt = tmp_path / "broken.gguf"
    corrupt.write_bytes(b"GGUF" + b"\x00\xff" * 64)
    with pytest.raises(CheckpointError, match=str(corrupt)):
        load_model(corrupt, tokenizer=bpe_tokenizer)
    with pytest.raises(CheckpointError, match=f"no config.json\\): {tmp_path}"):
        load_model(tmp_path, tokenizer=bpe_tokenizer)
    tiny = load_model("tiny-32", tokenizer=bpe_tokenizer)
    tiny.model.save_pretrained(tmp_path / "m")
    (tmp_path / "m" / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match=str(tmp_path / "m")):
        load_model(tmp_path / "m", tokenizer=bpe_tokenizer)
    with pytest.raises(ConfigError, match="unknown model 'huge'"):
        load_model("huge", tokenizer=bpe_tokenizer)
    with pytest.raises(CheckpointError, match="tokenizer path does not exist"):
        load_tokenizer(tmp_path / "none")


def test_vocab_and_seq_len_mismatch(bpe_tokenizer, build_bpe_tokenizer, tmp_path: Path) -> None:
    tiny = load_model("tiny-32", tokenizer=bpe_tokenizer)
    tiny.model.save_pretrained(tmp_path)
    bigger = build_bpe_tokenizer()
    bigger.add_tokens([f"extra{i}" for i in range(5)])
    with pytest.raises(
        ConfigError, match="tokenizer has 405 tokens but the model's embedding has only 400 rows"
    ):
        load_model(tmp_path, tokenizer=bigger)
    check_seq_len(tiny.model.config, 2048)
    with pytest.raises(ConfigError, match="seq_len 4096 exceeds the model's max_position_embeddings 2048"):
        check_seq_len(tiny.model.config, 4096)


def test_data_dir_resolution(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("MEGALITH_DATA_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert data_dir() == tmp_path / ".cache" / "megalith" / "llama"
    monkeypatch.setenv("MEGALITH_DATA_DIR", str(tmp_path / "env"))
    assert data_dir() == tmp_path / "env"
    assert data_dir(tmp_path / "flag") == tmp_path / "flag"


def test_atomic_directory(tmp_path: Path) -> None:
    target = tmp_path / "out"
    with pytest.raises(RuntimeError), atomic_directory(target) as tmp:
        (tmp / "half").write_text("x")
        raise RuntimeError("killed midway")
    assert list(tmp_path.iterdir()) == []  # no target, no temporary left behind
    with atomic_directory(target) as tmp:
        (tmp / "a").write_text("1")
    with pytest.raises(FileExistsError, match="overwrite"), atomic_directory(target):
        pass
    with atomic_directory(target, overwrite=True) as tmp:
        (tmp / "b").write_text("2")
    assert sorted(p.name for p in target.iterdir()) == ["b"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
