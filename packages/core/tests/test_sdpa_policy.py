"""`megalith.policies.sdpa`: plain causal masks are left to SDPA's `is_causal`, even while dynamo
traces; padded batches still get HF's mask. Outputs must equal the unpatched model's (fp32, 1e-6)."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import AttentionInterface

from megalith.booster import Booster
from megalith.booster.plugins import ZeroPlugin
from megalith.common.errors import ConfigError
from megalith.policies.sdpa import NAME, restore_sdpa, use_mask_free_causal_sdpa

SMALL = dict(
    vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=32,
)  # fmt: skip


def _model(impl: str = "sdpa") -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**SMALL, attn_implementation=impl)).eval()


@pytest.fixture
def masks_seen():
    """Record, per attention call, whether a mask reached the attention function (trace-time value)."""
    seen: list[bool] = []

    def spy(module, q, k, v, attention_mask, **kwargs):
        seen.append(attention_mask is not None)
        return sdpa_attention_forward(module, q, k, v, attention_mask, **kwargs)

    model = _model()
    assert use_mask_free_causal_sdpa(model)
    AttentionInterface.register(NAME, spy)
    yield model, seen
    AttentionInterface.register(NAME, sdpa_attention_forward)


def test_no_mask_reaches_attention_when_compiled(masks_seen):
    """The mask function traces under dynamo (fullgraph) and the outputs match. With torch >= 2.14
    HF skips the mask here by itself; the next test is the one that fails without the policy."""
    model, seen = masks_seen
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    reference = _model()(input_ids=ids).logits
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    out = compiled(input_ids=ids).logits
    assert seen and not any(seen), seen
    torch.testing.assert_close(out, reference, atol=1e-6, rtol=0)


def test_no_mask_while_hf_refuses_to_skip(masks_seen, monkeypatch):
    """Before torch 2.14 HF's SDPA mask never takes the causal skip while dynamo traces (emulated
    here eagerly by refusing the skip); the plain causal case must still reach SDPA without one."""
    from transformers import masking_utils

    monkeypatch.setattr(masking_utils, "_ignore_causal_mask_sdpa", lambda *args, **kwargs: False)
    model, seen = masks_seen
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    control: list[bool] = []
    plain = _model()
    AttentionInterface.register("sdpa", lambda m, q, k, v, mask, **kw: (control.append(mask is not None),
                                sdpa_attention_forward(m, q, k, v, mask, **kw))[1])  # fmt: skip
    try:
        reference = plain(input_ids=ids).logits
    finally:
        AttentionInterface.register("sdpa", sdpa_attention_forward)
    out = model(input_ids=ids).logits
    assert control and all(control), "HF is expected to build the mask while tracing"
    assert seen and not any(seen), seen
    torch.testing.assert_close(out, reference, atol=1e-6, rtol=0)


def test_padding_mask_is_still_applied(masks_seen):
    model, seen = masks_seen
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding in row 0
    out = model(input_ids=ids, attention_mask=mask).logits
    assert seen and all(seen), seen
    reference = _model()(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(out[:, 3:], reference[:, 3:], atol=1e-6, rtol=0)
    torch.testing.assert_close(out[1], reference[1], atol=1e-6, rtol=0)


def test_sliding_window_keeps_its_mask():
    torch.manual_seed(0)
    config = MistralConfig(**SMALL, sliding_window=4, attn_implementation="sdpa")
    model = MistralForCausalLM(config).eval()
    reference = copy.deepcopy(model)
    assert use_mask_free_causal_sdpa(model)
    ids = torch.randint(0, 64, (1, 10), generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(
        model(input_ids=ids).logits, reference(input_ids=ids).logits, atol=1e-6, rtol=0
    )


def test_other_implementations_untouched_and_restore():
    eager = _model("eager")
    assert not use_mask_free_causal_sdpa(eager)
    assert eager.config._attn_implementation == "eager"
    model = _model()
    use_mask_free_causal_sdpa(model)
    assert model.config._attn_implementation == NAME
    restore_sdpa(model)
    assert model.config._attn_implementation == "sdpa"


def test_booster_compile_switches_the_model():
    model = _model().train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    Booster(plugin=ZeroPlugin(stage=1), compile=True).boost(model, opt)
    assert model.config._attn_implementation == NAME
    plain = _model()
    Booster(plugin=ZeroPlugin(stage=1)).boost(plain, torch.optim.AdamW(plain.parameters()))
    assert plain.config._attn_implementation == "sdpa"


def test_booster_compile_options_reach_torch_compile(monkeypatch):
    seen = []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kw: seen.append(kw))
    model = _model().train()
    options = {"coordinate_descent_tuning": True}
    booster = Booster(plugin=ZeroPlugin(stage=1), compile=True, compile_options=options)
    booster.boost(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    assert seen == [{"options": options}]
    seen.clear()
    plain = _model().train()
    Booster(plugin=ZeroPlugin(stage=1), compile=True).boost(plain, torch.optim.AdamW(plain.parameters()))
    assert seen == [{"options": None}]


@pytest.mark.parametrize(
    ("compile", "options"), [(False, {"coordinate_descent_tuning": True}), (True, ["max_autotune"])]
)
def test_booster_compile_options_bad_input(compile, options):
    with pytest.raises(ConfigError, match=r"compile_options=.*needs compile=True"):
        Booster(compile=compile, compile_options=options)
