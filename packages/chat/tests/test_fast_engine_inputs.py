"""The fast rollout engine (CPU eager path): what it refuses, what it merges, bad input.

Tiny random decoders (hidden 32, 2 layers, 4 query heads / 2 KV heads, vocab 64, float32, norm
weights in [0.5, 1.5]); engine log-probs against a teacher-forced forward of the same (PEFT) model
within 1e-5, greedy tokens against its ``generate``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from megalith.common.errors import ConfigError
from megalith_chat.engine.fast import FastEngine, FastEngineConfig
from megalith_chat.engine.fast_rollout import StopStrings
from megalith_chat.engine.sampling import SamplingParams
from megalith_chat.rollout.generation import response_logprobs

TOL = 1e-5
FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
}


def tiny(family: str = "llama", seed: int = 0, **overrides: Any) -> Any:
    config_cls, model_cls = FAMILIES[family]
    kw: dict[str, Any] = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=64, max_position_embeddings=128, pad_token_id=0,
        bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    kw.update(overrides)
    cfg = config_cls(**kw)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = model_cls(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def left_padded() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(1, 64, (3, 7), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    mask[2, :1] = 0
    return ids.masked_fill(mask == 0, 0), mask


def engine_of(model: Any, max_len: int = 48) -> FastEngine:
    return FastEngine(model, FastEngineConfig(max_batch=4, max_len=max_len, sync_every=2), device="cpu")


def assert_matches(model: Any, engine: FastEngine, new: int = 8) -> None:
    """Greedy tokens equal ``model.generate``'s; log-probs (greedy and T = 0.7) a teacher-forced forward."""
    ids, mask = left_padded()
    ours = engine.generate(ids, mask, SamplingParams(new, greedy=True))
    hf = model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0
    )
    assert torch.equal(ours.tokens, hf[:, ids.shape[1] :])
    sampled = engine.generate(ids, mask, SamplingParams(new, 0.7), generator=torch.Generator().manual_seed(3))
    for out, t in ((ours, 1.0), (sampled, 0.7)):
        with torch.no_grad():
            ref = response_logprobs(model, ids, mask, out.tokens, torch.ones_like(out.tokens), t)
        assert torch.allclose(out.logprobs, ref, atol=TOL, rtol=0)


# ---------------------------------------------------------------- model configs


@pytest.mark.parametrize(
    ("family", "overrides", "needle"),
    [
        ("mistral", {"sliding_window": 4}, "sliding_window=4"),
        (
            "qwen2",
            {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1},
            "sliding_window=8",
        ),
        (
            "llama",
            {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}},
            "'dynamic'",
        ),
        (
            "llama",
            {
                "rope_parameters": {
                    "rope_type": "longrope",
                    "rope_theta": 1e4,
                    "short_factor": [1.0] * 4,
                    "long_factor": [2.0] * 4,
                    "original_max_position_embeddings": 16,
                }  # fmt: skip
            },
            "'longrope'",
        ),
        ("llama", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ("qwen2", {"hidden_act": "relu"}, "hidden_act='relu'"),
    ],
)
def test_unimplemented_model_configs_refused(family: str, overrides: dict[str, Any], needle: str) -> None:
    """Each of these runs (before the check) with log-probs off by 1e-4 .. 1e-1 or other tokens."""
    with pytest.raises(ConfigError, match=needle):
        engine_of(tiny(family, **overrides))


def test_sliding_window_as_wide_as_the_cache_is_harmless() -> None:
    """A window ``W >= max_len`` hides no cache slot the engine can attend: allowed, and equal to HF
    (which applies the window); growing the cache past ``W`` is refused."""
    mistral = tiny("mistral", sliding_window=48)
    engine = engine_of(mistral, max_len=48)
    assert_matches(mistral, engine)
    with pytest.raises(ConfigError, match="sliding_window=48.*max_len <= 48, got 49"):
        engine.reserve(4, 49)
    # Qwen2's window applies from layer max_window_layers on: none of these 2 layers
    qwen = tiny("qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=2)
    assert_matches(qwen, engine_of(qwen))


def test_rope_tables_computed_on_a_copy() -> None:
    model = tiny()
    engine = engine_of(model)
    theirs, ours = model.model.rotary_emb, engine._rotary
    assert ours is not theirs
    assert {t.data_ptr() for t in ours.buffers()}.isdisjoint(t.data_ptr() for t in theirs.buffers())


# ---------------------------------------------------------------- PEFT


def peft_model(family: str = "llama", tied: bool = False, **lora: Any) -> Any:
    from peft import LoraConfig, get_peft_model

    lora.setdefault("target_modules", ["q_proj", "v_proj", "o_proj", "down_proj"])
    model = get_peft_model(tiny(family, tie_word_embeddings=tied), LoraConfig(r=4, lora_alpha=8, **lora))
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():  # every adapter weight away from its init (B = 0, A_embedding = 0, m = ||W||)
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.add_(0.3 * torch.randn(p.shape, generator=g))
    return model.eval()


@pytest.mark.parametrize(
    ("family", "lora"),
    [
        ("llama", {"use_dora": True}),  # ignored before: off by 0.35 in log-prob
        ("qwen2", {"lora_bias": True, "target_modules": ["q_proj", "v_proj"]}),  # its bias was dropped
        ("llama", {"target_modules": ["embed_tokens", "q_proj"]}),  # the embedding's delta was dropped
    ],
)
def test_peft_adapters_merged_like_peft_forward(family: str, lora: dict[str, Any]) -> None:
    model = peft_model(family, **lora)
    assert_matches(model, engine_of(model))


def test_a_peft_state_dict_is_refused_with_the_way_to_pass_it() -> None:
    """``update_weights(peft_model.state_dict())``: the adapter tensors cannot be copied as they are;
    the error names the tensor and says to pass the model; the model itself is merged and matches."""
    model = peft_model()
    engine = engine_of(model)
    with pytest.raises(
        ConfigError,
        match=r"'base_model\.model\.model\.layers\.0\..*' is a PEFT adapter tensor.*update_weights\(model\)",
    ):
        engine.update_weights(model.state_dict())
    assert engine.update_weights(model) > 0
    assert_matches(model, engine)


def test_dora_on_an_embedding_refused() -> None:
    model = peft_model(target_modules=["embed_tokens", "q_proj"], use_dora=True)
    with pytest.raises(ConfigError, match="DoraEmbeddingVariant.*embed_tokens"):
        engine_of(model)


def test_lora_bias_without_a_base_bias_refused() -> None:
    """PEFT adds the adapter's bias even where the base layer has none; the engine has no slot for it."""
    with pytest.warns(UserWarning, match="lora_bias"):
        model = peft_model(lora_bias=True, target_modules=["q_proj", "o_proj"])
    with pytest.raises(ConfigError, match=r"lora_bias.*model\.layers\.0\.self_attn\.q_proj"):
        engine_of(model)


def test_modules_to_save_uses_the_active_copy() -> None:
    """The saved copy (not ``original_module``) under its plain name; the original with adapters off."""
    model = peft_model(modules_to_save=["lm_head"])
    with torch.no_grad():
        model.base_model.model.lm_head.modules_to_save["default"].weight.mul_(-1.5)
    assert_matches(model, engine_of(model))
    with model.disable_adapter():
        plain = engine_of(model)
        assert torch.equal(plain.weights.lm_head, model.get_base_model().lm_head.original_module.weight)
        assert_matches(model, plain)


def test_modules_to_save_of_a_tied_head_refused() -> None:
    """PEFT's forward uses the trained head copy and the original embedding: no longer tied."""
    with pytest.warns(UserWarning, match="tie_word_embeddings"):
        model = peft_model("qwen2", tied=True, modules_to_save=["lm_head"])
    engine_of(model)  # built: the copy still equals the embedding
    with torch.no_grad():
        model.base_model.model.lm_head.modules_to_save["default"].weight.mul_(-1.5)
    with pytest.raises(ConfigError, match="ties lm_head.weight to model.embed_tokens.weight"):
        engine_of(model)


# ---------------------------------------------------------------- stop strings


def byte_level_bpe() -> Any:
    """A byte-level BPE tokenizer (the 256 byte symbols, no merges) with the GPT-2 / Llama-3 /
    SmolLM2 byte-level decoder: an incomplete UTF-8 character decodes to U+FFFD."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


@pytest.mark.parametrize("stop", ["。", "5。"])
def test_stop_string_ending_in_a_character_split_by_a_sync(stop: str) -> None:
    tokenizer = byte_level_bpe()
    text = "x = 5。done"
    ids = tokenizer.encode(text)
    end = len(tokenizer.encode("x = 5。"))  # tokens up to the stop's last byte
    split = len(tokenizer.encode("x = 5")) + 1  # the first sync ends inside the 3-byte 。
    assert tokenizer.decode(ids[:split]).endswith("\ufffd")
    stops = StopStrings(tokenizer, [stop], 1)
    assert stops(torch.tensor([ids[:split]])) == []
    assert stops(torch.tensor([ids])) == [0]
    assert stops.ends == [end]


# ---------------------------------------------------------------- bad input


def test_stop_must_be_a_tuple_of_strings() -> None:
    with pytest.raises(ConfigError, match="'abc'"):
        SamplingParams(3, stop="abc")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="3"):
        SamplingParams(3, stop=("a", 3))  # type: ignore[arg-type]
    assert SamplingParams(3, stop=["a"]).stop == ("a",)  # type: ignore[arg-type]


def test_stop_without_a_sync_hook_refused() -> None:
    """The engine holds no tokenizer: ``stop`` was silently ignored; now it needs ``on_sync``."""
    engine = engine_of(tiny())
    ids, mask = left_padded()
    with pytest.raises(ConfigError, match="stop=\\('ab',\\) needs an on_sync hook"):
        engine.generate(ids, mask, SamplingParams(3, greedy=True, stop=("ab",)))
    out = engine.generate(ids, mask, SamplingParams(3, greedy=True, stop=("ab",)), on_sync=lambda t: [])
    assert out.tokens.shape == (3, 3)


def test_temperature_whose_inverse_overflows_refused() -> None:
    with pytest.raises(ConfigError, match="1e-39"):
        SamplingParams(3, temperature=1e-39)
    assert SamplingParams(3, temperature=1e-39, greedy=True).logprob_temperature == 1.0


def test_bad_prompts_refused() -> None:
    engine = engine_of(tiny())
    ids, mask = left_padded()
    params = SamplingParams(3, greedy=True)
    bad = [
        (ids[0], mask[0], r"prompt_ids .*\(7,\)"),
        (ids[:0], mask[:0], r"prompt_ids .*\(0, 7\)"),
        (ids[:, :0], mask[:, :0], r"prompt_ids .*\(3, 0\)"),
        (ids.float(), mask, "torch.float32"),
        (ids, mask[:2], r"prompt_mask .*\(3, 7\), got \(2, 7\)"),
        (ids, mask[:, 1:], r"prompt_mask .*\(3, 7\), got \(3, 6\)"),
    ]
    for prompt_ids, prompt_mask, needle in bad:
        with pytest.raises(ConfigError, match=needle):
            engine.generate(prompt_ids, prompt_mask, params)


@pytest.mark.parametrize(
    ("field", "value", "needle"),
    [
        ("attention", "flash", "got 'flash'"),
        ("kv_block", 0, "got 0"),
    ],
)
def test_bad_engine_config_refused(field: str, value: Any, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        FastEngineConfig(**{field: value})
