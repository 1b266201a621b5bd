"""The fast rollout engine (CPU eager path) against Hugging Face references.

Tiny random Llama: hidden 32, 2 layers, 4 query heads / 2 KV heads (GQA), vocab 64, float32.
Log-prob tolerance: 1e-5 absolute against a teacher-forced HF forward of the same tokens.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from megalith.common.errors import ConfigError
from megalith.testing import run_triton
from megalith_chat.engine.fast import FastEngine, FastEngineConfig
from megalith_chat.engine.fast_rollout import FastGenerator, StopStrings
from megalith_chat.engine.sampling import SamplingParams, nucleus_mask
from megalith_chat.rollout.generation import response_logprobs

TOL = 1e-5


def tiny_llama(seed: int) -> LlamaForCausalLM:
    cfg = LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=64, max_position_embeddings=128, pad_token_id=0,
        bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    return tiny_llama(0)


@pytest.fixture(scope="module")
def engine(model: LlamaForCausalLM) -> FastEngine:
    return FastEngine(model, FastEngineConfig(max_batch=8, max_len=48, sync_every=2), device="cpu")


def left_padded(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 64, (3, 7), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    mask[2, :1] = 0
    return ids.masked_fill(mask == 0, 0), mask


def test_greedy_equals_hf_generate(model: LlamaForCausalLM, engine: FastEngine) -> None:
    ids, mask = left_padded()
    ours = engine.generate(ids, mask, SamplingParams(10, greedy=True)).tokens
    hf = model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0
    )
    assert torch.equal(ours, hf[:, ids.shape[1] :])


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_teacher_forced_forward(
    model: LlamaForCausalLM, engine: FastEngine, temperature: float
) -> None:
    ids, mask = left_padded(2)
    gen = torch.Generator().manual_seed(3)
    out = engine.generate(ids, mask, SamplingParams(9, temperature=temperature), generator=gen)
    with torch.no_grad():
        ref = response_logprobs(model, ids, mask, out.tokens, torch.ones_like(out.tokens), temperature)
    assert out.logprobs.shape == (3, 9)
    assert torch.allclose(out.logprobs, ref, atol=TOL, rtol=0)


def test_sampling_reproducible_and_seed_dependent(engine: FastEngine) -> None:
    ids, mask = left_padded()
    params = SamplingParams(12, temperature=1.3)
    runs = [
        engine.generate(ids, mask, params, generator=torch.Generator().manual_seed(s)).tokens
        for s in (5, 5, 6)
    ]
    assert torch.equal(runs[0], runs[1])
    assert not torch.equal(runs[0], runs[2])


def test_top_k_top_p_never_leave_the_nucleus(model: LlamaForCausalLM, engine: FastEngine) -> None:
    """First tokens of 8 identical rows drawn 30 times: all inside the hand-computed set."""
    ids = torch.randint(1, 64, (1, 5), generator=torch.Generator().manual_seed(4)).repeat(8, 1)
    mask = torch.ones_like(ids)
    with torch.no_grad():
        probs = torch.softmax(model(input_ids=ids[:1]).logits[0, -1] / 2.0, dim=-1)
    order = probs.argsort(descending=True).tolist()
    mass, nucleus = 0.0, []
    for t in order:  # smallest prefix whose mass reaches 0.5
        nucleus.append(t)
        mass += float(probs[t])
        if mass >= 0.5:
            break
    top3 = set(order[:3])
    gen = torch.Generator().manual_seed(0)
    seen_p, seen_k = set(), set()
    for _ in range(30):
        seen_p |= set(
            engine.generate(ids, mask, SamplingParams(1, temperature=2.0, top_p=0.5), generator=gen)
            .tokens[:, 0]
            .tolist()
        )
        seen_k |= set(
            engine.generate(ids, mask, SamplingParams(1, temperature=2.0, top_k=3), generator=gen)
            .tokens[:, 0]
            .tolist()
        )
    assert seen_p <= set(nucleus) and seen_k <= top3
    assert len(seen_k) >= 2  # it does sample


def test_nucleus_mask_by_hand() -> None:
    probs = torch.tensor([[0.1, 0.5, 0.15, 0.25], [0.4, 0.3, 0.2, 0.1]])
    keep = nucleus_mask(probs, torch.tensor([[0.7], [1.0]]), torch.tensor([[0], [2]]))
    assert keep.tolist() == [[False, True, False, True], [True, True, False, False]]


def test_eos_and_stop_strings_truncate(model: LlamaForCausalLM, engine: FastEngine) -> None:
    ids, mask = left_padded()
    free = engine.generate(ids, mask, SamplingParams(10, greedy=True)).tokens
    eos = int(free[0, 3])
    cut = engine.generate(ids, mask, SamplingParams(10, greedy=True), eos_ids=[eos], pad_id=0).tokens
    first = int((free[0] == eos).nonzero()[0])
    assert torch.equal(cut[0, : first + 1], free[0, : first + 1])
    assert (cut[0, first + 1 :] == 0).all()

    class Tok:  # decodes token t as the letter chr(65 + t % 26)
        def decode(self, row: list[int], skip_special_tokens: bool = True) -> str:
            return "".join(chr(65 + t % 26) for t in row)

    text = Tok().decode(free[1].tolist())
    stop = text[4:6]
    stops = StopStrings(Tok(), [stop], 3)
    engine.generate(ids, mask, SamplingParams(10, greedy=True, stop=(stop,)), on_sync=stops)
    assert stops.ends[1] == text.index(stop) + len(stop)
    assert stops.cut(text) == text[: text.index(stop) + len(stop)]


def test_update_weights_matches_new_model(engine: FastEngine) -> None:
    ids, mask = left_padded()
    other = tiny_llama(7)
    before = engine.weights.wqkv[0].data_ptr()
    try:
        assert engine.update_weights(other.state_dict()) > 0
        ours = engine.generate(ids, mask, SamplingParams(8, greedy=True)).tokens
        hf = other.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0
        )
        assert torch.equal(ours, hf[:, ids.shape[1] :])
        assert engine.weights.wqkv[0].data_ptr() == before  # copied in place
    finally:
        engine.update_weights(tiny_llama(0))


def test_partial_updates_fold_norm_weights(engine: FastEngine) -> None:
    """Norm weights live folded into their projections: a projection alone is folded with the
    current norm weight; a norm weight without all its projections is refused before anything is
    written."""
    ids, mask = left_padded()
    other = tiny_llama(0)
    p = "model.layers.1."
    with torch.no_grad():
        other.model.layers[1].mlp.up_proj.weight.mul_(-2.0)
        other.model.layers[1].post_attention_layernorm.weight.uniform_(0.5, 1.5)
    new = other.state_dict()
    before = [t.clone() for t in (engine.weights.wgu[1], engine.weights.ln2[1])]
    try:
        with pytest.raises(
            ConfigError, match=f"{p}post_attention_layernorm.weight is folded into {p}mlp.gate_proj"
        ):
            engine.update_weights(
                {k: new[k] for k in (p + "post_attention_layernorm.weight", p + "mlp.up_proj.weight")}
            )
        assert torch.equal(engine.weights.wgu[1], before[0]) and torch.equal(engine.weights.ln2[1], before[1])
        engine.update_weights({p + "mlp.up_proj.weight": new[p + "mlp.up_proj.weight"]})  # projection alone
        with torch.no_grad():
            other.model.layers[1].post_attention_layernorm.weight.copy_(before[1])
        ours = engine.generate(ids, mask, SamplingParams(6, greedy=True))
        ref = response_logprobs(other, ids, mask, ours.tokens, torch.ones_like(ours.tokens))
        assert torch.allclose(ours.logprobs, ref, atol=TOL)
    finally:
        engine.update_weights(tiny_llama(0))


def test_fast_generator_matches_generated_layout(
    model: LlamaForCausalLM, engine: FastEngine, chat_tokenizer
) -> None:  # type: ignore[no-untyped-def]
    from megalith_chat.rollout.generation import SamplingConfig, generate

    big = tiny_llama(0)
    big.resize_token_embeddings(len(chat_tokenizer))
    fast = FastGenerator(FastEngine(big, FastEngineConfig(max_batch=2, max_len=16), device="cpu"))
    prompts = [[{"role": "user", "content": "hello there"}]]
    ours = fast(big, chat_tokenizer, prompts, 2, SamplingConfig(6, 0.0))
    ref = generate(big, chat_tokenizer, prompts, 2, SamplingConfig(6, 0.0))
    w = min(ours.response_ids.shape[1], ref.response_ids.shape[1])
    assert ours.texts == ref.texts and torch.equal(ours.truncated, ref.truncated)
    assert torch.equal(ours.response_ids[:, :w], ref.response_ids[:, :w])
    assert torch.equal(ours.response_mask[:, :w], ref.response_mask[:, :w])
    assert torch.allclose(ours.logprobs[:, :w], ref.logprobs[:, :w], atol=TOL)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"temperature": 0.0}, "0.0"),
        ({"temperature": -1.0}, "-1.0"),
        ({"top_p": 0.0}, "0.0"),
        ({"top_p": 1.5}, "1.5"),
    ],
)
def test_bad_sampling_params(kwargs: dict[str, float], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        SamplingParams(4, **kwargs)  # type: ignore[arg-type]


def test_prompt_too_long_and_batch_too_big(engine: FastEngine) -> None:
    ids = torch.ones(1, 45, dtype=torch.long)
    with pytest.raises(ConfigError, match="45 .*= 49 exceeds max_len 48"):
        engine.generate(ids, torch.ones_like(ids), SamplingParams(4, greedy=True))
    ids = torch.ones(9, 3, dtype=torch.long)
    with pytest.raises(ConfigError, match="9 rows"):
        engine.generate(ids, torch.ones_like(ids), SamplingParams(4, greedy=True))


def test_unknown_parameter_rejected(engine: FastEngine) -> None:
    with pytest.raises(ConfigError, match="model.layers.0.foo.weight"):
        engine.update_weights({"model.layers.0.foo.weight": torch.zeros(1)})


def in_interpreter(script: str, timeout: float = 120) -> str:
    """stdout of ``script`` run by a fresh Python with the Triton interpreter on (the interpreter
    must be chosen before Triton is first imported); fails the test if the script fails."""
    return run_triton(script, True, timeout)


CHECK_KERNEL = """
import torch
from megalith_chat.engine.fast_attention import decode_attention
g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(3, 2, n, 16, generator=g) for n in (3, 90, 90))  # G = 3 query heads per KV head
start, slot = torch.tensor([0, 5, 40]), torch.tensor(70)
ar = torch.arange(90)
mask = ((ar >= start[:, None]) & (ar <= slot))[:, None, None]
ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3)
two = decode_attention(q, k, v, start, slot, 0.3, target_programs=12)  # two splits + combine
one = decode_attention(q, k, v, start, slot, 0.3, target_programs=1)  # one split, written directly
print("MAXERR", max(float((out - ref).abs().max()) for out in (two, one)))
"""


def test_triton_decode_attention_in_interpreter() -> None:
    """The split-KV kernel against SDPA with the left-padding / slot mask (Triton interpreter, CPU):
    3 query heads per KV head (padded to 16 rows), two splits (and one, without the combine pass),
    rows starting inside and past the first key block, the slot before the end of the cache."""
    stdout = in_interpreter(CHECK_KERNEL)
    err = float(stdout.split("MAXERR")[1])
    assert err < 1e-5


CHECK_PROLOGUE = """
import torch
from megalith_chat.engine.fast_prologue import rope_store, rope_store_reference
g = torch.Generator().manual_seed(0)
b, heads, kv, d, t = 3, 4, 2, 16, 20
qkv = torch.randn(b, (heads + 2 * kv) * d + 5, generator=g)[:, 5:]  # rows with a stride gap
angle = torch.rand(b, d // 2, generator=g) * 6
cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)
k_cache, v_cache = torch.randn(2, 4, kv, t, d, generator=g), torch.randn(2, 4, kv, t, d, generator=g)
caches = [k_cache, v_cache, k_cache.clone(), v_cache.clone()]
before = k_cache.clone()
slot = torch.tensor(7)
q = rope_store(qkv, cos, sin, caches[0][1, :b], caches[1][1, :b], slot, kv, d)
ref = rope_store_reference(qkv, cos, sin, caches[2][1, :b], caches[3][1, :b], slot, kv, d)
err = max(float((q - ref).abs().max()), float((caches[0] - caches[2]).abs().max()),
          float((caches[1] - caches[3]).abs().max()))
changed = (caches[0] != before).any(-1).nonzero().tolist()
print("SHAPE", tuple(q.shape), "CHANGED", len(changed), all(c[0] == 1 and c[3] == 7 for c in changed))
print("MAXERR", err)
"""


def test_fused_decode_prologue_in_interpreter() -> None:
    """Split + RoPE + cache write kernel against the torch path on a GQA shape, strided rows and a
    cache view of a larger buffer (only slot 7 of rows 0-2 of layer 1 may change)."""
    stdout = in_interpreter(CHECK_PROLOGUE)
    assert "SHAPE (3, 2, 2, 16) CHANGED 6 True" in stdout  # rows 0-2 x 2 heads, slot 7 only
    assert float(stdout.split("MAXERR")[1]) < 1e-6


CHECK_NORM_KERNELS = """
import torch
from megalith_chat.engine import fast_mlp, fast_ops
from megalith_chat.engine.fast_prologue import rope_store, rope_store_reference
g = torch.Generator().manual_seed(0)
b, heads, kv, d, t, hidden = 3, 6, 1, 16, 20, 40  # 8 heads: one program and one masked-off slot
x = torch.randn(b, hidden, generator=g) * 3
qkv = torch.randn(b, (heads + 2 * kv) * d, generator=g)
bias = torch.randn((heads + 2 * kv) * d, generator=g)
angle = torch.rand(b, d // 2, generator=g) * 6
cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)
caches = [torch.randn(b, kv, t, d, generator=g) for _ in range(2)]
caches += [c.clone() for c in caches]
slot = torch.tensor(3)
q = rope_store(qkv, cos, sin, caches[0], caches[1], slot, kv, d, x, bias, 1e-5)
scaled = qkv * fast_ops.rms_scale(x, 1e-5) + bias
ref = rope_store_reference(scaled, cos, sin, caches[2], caches[3], slot, kv, d)
print("PROLOGUE", max(float((q - ref).abs().max()), *(float((a - c).abs().max()) for a, c in zip(caches[:2], caches[2:]))))
gate_up = torch.randn(b, 2 * 600, generator=g)  # I = 600: two programs per row, the second partly masked
out = fast_mlp.norm_silu_mul(gate_up, x, 1e-5)
print("SILU", float((out - fast_ops.norm_silu_mul(gate_up, x, 1e-5)).abs().max()))
"""


def test_norm_folded_kernels_in_interpreter() -> None:
    """The prologue with the input norm's ``1 / rms(x)`` and a QKV bias (hidden 40, not a power of
    two; 8 heads per program, one of them past the end) and the norm + SwiGLU activation kernel
    (a partly masked block) against their torch references."""
    stdout = in_interpreter(CHECK_NORM_KERNELS)
    assert float(stdout.split("PROLOGUE")[1].split()[0]) < 1e-5
    assert float(stdout.split("SILU")[1].split()[0]) < 1e-5


CHECK_ATTENTION_PROLOGUE = """
import torch
from megalith_chat.engine import fast_ops
from megalith_chat.engine.fast_attention import Prologue, decode_attention
from megalith_chat.engine.fast_prologue import rope_store_reference
g = torch.Generator().manual_seed(0)
b, kv, group, d, t, hidden = 3, 2, 3, 16, 96, 40
width = (kv * group + 2 * kv) * d
x = torch.randn(b, hidden, generator=g) * 3
qkv, bias = torch.randn(b, width, generator=g), torch.randn(width, generator=g)
angle = torch.rand(b, d // 2, generator=g) * 6
cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)
start, slot = torch.tensor([0, 5, 40]), torch.tensor(70)
ar = torch.arange(90)
mask = ((ar >= start[:, None]) & (ar <= slot))[:, None, None]
caches = [torch.randn(b, kv, t, d, generator=g) for _ in range(2)]
ref_caches = [c.clone() for c in caches]
scaled = qkv * fast_ops.rms_scale(x, 1e-5) + bias
q = rope_store_reference(scaled, cos, sin, ref_caches[0], ref_caches[1], slot, kv, d)
ref = torch.nn.functional.scaled_dot_product_attention(q, ref_caches[0][:, :, :90], ref_caches[1][:, :, :90],
                                                       attn_mask=mask, scale=0.3)
for programs in (24, 1):  # three splits of the key range, or one
    got = [c.clone() for c in caches]
    out = decode_attention(Prologue(qkv, cos, sin, x, bias, 1e-5), got[0][:, :, :90], got[1][:, :, :90],
                           start, slot, 0.3, target_programs=programs)
    print("MAXERR", max(float((out - ref).abs().max()), *(float((a - r).abs().max()) for a, r in zip(got, ref_caches))))
"""


def test_attention_with_the_prologue_in_interpreter() -> None:
    """The attention kernel finishing the QKV projection itself (1 / rms, bias, RoPE for 3 query
    heads per KV head, the step's key and value into the cache and attended from registers) against
    the torch prologue + SDPA, with the key range in three splits and in one."""
    stdout = in_interpreter(CHECK_ATTENTION_PROLOGUE)
    errors = [float(line.split()[1]) for line in stdout.splitlines() if line.startswith("MAXERR")]
    assert len(errors) == 2 and max(errors) < 1e-5


CHECK_SAMPLER = """
import torch
from megalith_chat.engine import fast_sample
from megalith_chat.engine.fast_state import DecodeState
from megalith_chat.engine.sampling import SamplingParams
g = torch.Generator().manual_seed(0)
b, vocab = 304, 40
kernels = fast_sample.make_kernels(block=32)  # 2 chunks, the second partly masked
logits = (torch.randn(vocab, generator=g) * 2).expand(b, vocab).contiguous()
eos = int(logits[0].argsort()[-2])  # the second most likely token
st = DecodeState(b, 4, vocab, torch.device("cpu"))
ids = torch.ones(b, 1, dtype=torch.long)
st.prepare(ids, torch.ones_like(ids), b, SamplingParams(4, temperature=0.5), (eos,), 3)
st.seed.fill_(1234)
st.greedy[:4] = True
st.inv_t[:4] = 1.0
st.done[4:8] = True
fast_sample.sample_step(logits, st, b, kernels)
tok, lp = st.out_tok[:, 0].clone(), st.out_lp[:, 0].clone()
ref = torch.log_softmax(logits * st.inv_t, -1).gather(1, tok[:, None])[:, 0]
live = torch.ones(b, dtype=torch.bool)
live[4:8] = False
print("GREEDY", bool((tok[:4] == logits[0].argmax()).all()))
print("FINISHED", bool((tok[4:8] == 3).all() and (lp[4:8] == 0).all()))
print("LPERR", float((lp - ref)[live].abs().max()))
print("EOS", bool(torch.equal(st.done[8:], tok[8:] == eos)), int((tok[8:] == eos).sum()) > 0)
print("TOK", bool(torch.equal(st.tok, tok)))
freq = torch.bincount(tok[8:], minlength=vocab).float() / (b - 8)
print("TV", float((freq - torch.softmax(logits[0] * 2, -1)).abs().sum() / 2))
st.done[8:] = False
small = 64  # the same key again, then the next column, on fewer rows
fast_sample.sample_step(logits[:small], st, small, kernels)
print("SAME", bool(torch.equal(st.out_tok[8:small, 0], tok[8:small])))
st.ridx.fill_(1)
fast_sample.sample_step(logits[:small], st, small, kernels)
print("NEXT", float((st.out_tok[8:small, 1] != tok[8:small]).float().mean()))
"""


def test_fused_sampler_in_interpreter() -> None:
    """The Philox + Gumbel-max sampler (two vocabulary chunks) against the distribution it must
    draw from (temperature 0.5, 296 draws: total variation < 0.12; the expected sampling error is
    0.055 and the largest of 400 torch.multinomial draws of that size 0.119, while temperature 1
    instead of 0.5 is 0.37 away), exact log-probs, greedy and finished rows, the
    end-of-sequence bookkeeping, the same draw for the same key and another for the next column."""
    stdout = in_interpreter(CHECK_SAMPLER, timeout=240)
    assert "GREEDY True" in stdout and "FINISHED True" in stdout and "TOK True" in stdout
    assert "EOS True True" in stdout and "SAME True" in stdout
    assert float(stdout.split("LPERR")[1].split()[0]) < 1e-5
    assert float(stdout.split("TV")[1].split()[0]) < 0.12
    assert float(stdout.split("NEXT")[1].split()[0]) > 0.5


CHECK_FUSED_ENGINE = """
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM
from megalith_chat.engine.fast import FastEngine, FastEngineConfig
from megalith_chat.engine.sampling import SamplingParams
from megalith_chat.rollout.generation import response_logprobs
cfg = Qwen2Config(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=64, max_position_embeddings=128, pad_token_id=0,
                  bos_token_id=None, eos_token_id=None)
cfg._attn_implementation = "sdpa"
torch.manual_seed(0)
model = Qwen2ForCausalLM(cfg).eval()  # QKV biases
with torch.no_grad():
    for layer in model.model.layers:  # norm weights away from 1, so that folding them matters
        layer.input_layernorm.weight.uniform_(0.5, 1.5)
        layer.post_attention_layernorm.weight.uniform_(0.5, 1.5)
engine = FastEngine(model, FastEngineConfig(max_batch=4, max_len=24, attention="triton"), device="cpu")
engine.fused_prologue = engine.fused_sampling = True  # the CUDA kernels, here in the interpreter
ids = torch.randint(1, 64, (3, 5), generator=torch.Generator().manual_seed(1))
mask = torch.ones_like(ids)
mask[0, :2] = 0
ids = ids.masked_fill(mask == 0, 0)
engine.prologue_in_attention = False  # first the prologue as a kernel of its own
apart = engine.generate(ids, mask, SamplingParams(8, greedy=True))
engine.prologue_in_attention = True  # then inside the attention kernel (the CUDA default)
out = engine.generate(ids, mask, SamplingParams(8, greedy=True))
hf = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
print("TOKENS_EQUAL", torch.equal(out.tokens, hf[:, ids.shape[1]:]), torch.equal(apart.tokens, out.tokens))
with torch.no_grad():
    ref = response_logprobs(model, ids, mask, out.tokens, torch.ones_like(out.tokens))
print("MAXERR", float((out.logprobs - ref).abs().max()), float((apart.logprobs - ref).abs().max()))
params = SamplingParams(8, temperature=0.7)
drawn = [engine.generate(ids, mask, params, generator=torch.Generator().manual_seed(s)) for s in (3, 3, 4)]
with torch.no_grad():
    ref = response_logprobs(model, ids, mask, drawn[0].tokens, torch.ones_like(drawn[0].tokens), 0.7)
print("SAMPLED_MAXERR", float((drawn[0].logprobs - ref).abs().max()))
print("REPRODUCED", torch.equal(drawn[0].tokens, drawn[1].tokens), not torch.equal(drawn[0].tokens, drawn[2].tokens))
"""


def test_engine_with_fused_kernels_matches_hf() -> None:
    """The engine's decode step with its CUDA kernels (norm-folded prologue and activation, Triton
    attention with the prologue inside it and apart, fused sampler; run in the interpreter) on a
    Qwen2 model with QKV biases and non-unit norm weights: the greedy tokens of HF ``generate``, the
    log-probs of a teacher-forced HF forward (greedy, and sampled at temperature 0.7), the same draw
    again from the same generator seed."""
    stdout = in_interpreter(CHECK_FUSED_ENGINE, timeout=240)
    assert "TOKENS_EQUAL True True" in stdout
    errors = stdout.split("MAXERR")[1].split()[:2]  # prologue in the attention kernel, then apart
    assert max(float(e) for e in errors) < TOL
    assert float(stdout.split("SAMPLED_MAXERR")[1].split()[0]) < TOL
    assert "REPRODUCED True True" in stdout


CHECK_GEMM_ENGINE = """
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from megalith_chat.engine.fast import FastEngine, FastEngineConfig
from megalith_chat.engine.fast_gemm import GemmConfig, ProjectionConfigs
from megalith_chat.engine.sampling import SamplingParams
from megalith_chat.rollout.generation import response_logprobs
cfg = LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=64, max_position_embeddings=128, pad_token_id=0,
                  bos_token_id=None, eos_token_id=None, attention_bias=True)  # q, k, v and o biases
cfg._attn_implementation = "sdpa"
torch.manual_seed(0)
model = LlamaForCausalLM(cfg).eval()
with torch.no_grad():
    for layer in model.model.layers:
        layer.input_layernorm.weight.uniform_(0.5, 1.5)
        layer.post_attention_layernorm.weight.uniform_(0.5, 1.5)
        for proj in (layer.self_attn.q_proj, layer.self_attn.o_proj):
            proj.bias.uniform_(-0.5, 0.5)
engine = FastEngine(model, FastEngineConfig(max_batch=4, max_len=24, attention="triton"), device="cpu")
engine.fused_prologue = True  # the CUDA kernels, here in the interpreter
engine.gemm = ProjectionConfigs(o=GemmConfig(block_n=16, block_k=16), down=GemmConfig(block_k=16, split=2))
ids = torch.randint(1, 64, (3, 5), generator=torch.Generator().manual_seed(1))
mask = torch.ones_like(ids)
mask[0, :2] = 0
ids = ids.masked_fill(mask == 0, 0)
hf = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
for inside in (True, False):  # the QKV prologue in the attention kernel, then apart
    engine.prologue_in_attention = inside
    out = engine.generate(ids, mask, SamplingParams(8, greedy=True))
    with torch.no_grad():
        ref = response_logprobs(model, ids, mask, out.tokens, torch.ones_like(out.tokens))
    print("RESULT", torch.equal(out.tokens, hf[:, ids.shape[1]:]), float((out.logprobs - ref).abs().max()))
engine.gemm = None  # cuBLAS: the same tokens
print("CUBLAS", torch.equal(engine.generate(ids, mask, SamplingParams(8, greedy=True)).tokens, out.tokens))
"""


def test_engine_with_triton_gemm_matches_hf() -> None:
    """The decode step with its projections by the split-K Triton matmul (``fast_gemm``: QKV, o with
    the residual add and bias, gate/up with 1 / rms and SwiGLU, down with the residual add; run in
    the interpreter) on a Llama with q/k/v/o biases and non-unit norm weights: the greedy tokens of
    HF ``generate`` and the log-probs of a teacher-forced HF forward, with the QKV prologue inside
    the attention kernel and apart."""
    stdout = in_interpreter(CHECK_GEMM_ENGINE, timeout=240)
    results = [line.split()[1:] for line in stdout.splitlines() if line.startswith("RESULT")]
    assert len(results) == 2, stdout
    for equal, error in results:
        assert equal == "True"
        assert float(error) < TOL
    assert "CUBLAS True" in stdout


CHECK_SHARED_PROMPT = """
import torch
from megalith_chat.engine.fast_attention import decode_attention
g = torch.Generator().manual_seed(0)
start, slot, end = torch.tensor([5, 5, 40, 40]), torch.tensor(70), torch.tensor(50)
ar = torch.arange(90)
mask = ((ar >= start[:, None]) & (ar <= slot))[:, None, None]
sdpa = torch.nn.functional.scaled_dot_product_attention
for heads in (3, 1):  # query heads per KV head (1: the padded rows of the dot are most of its rows)
    q = torch.randn(4, 2, heads, 16, generator=g)
    k, v = (torch.randn(4, 2, 90, 16, generator=g) for _ in range(2))
    k_ref, v_ref = k.clone(), v.clone()
    for lead in (0, 2):  # a group's second row attends to its first row's prompt slots
        k_ref[lead + 1, :, :50], v_ref[lead + 1, :, :50] = k[lead, :, :50], v[lead, :, :50]
    ref = sdpa(q, k_ref, v_ref, attn_mask=mask, scale=0.3)
    outs = [decode_attention(q, k, v, start, slot, 0.3, target_programs=t, members=2, prompt_end=end)
            for t in (12, 1)]
    own = sdpa(q, k, v, attn_mask=mask, scale=0.3)  # the rows' own (different) prompt slots
    print("READS_LEADER", float((outs[0] - own)[1::2].abs().max()) > 1e-2,
          float((outs[0] - own)[::2].abs().max()) < 1e-5)
    print("MAXERR", max(float((o - ref).abs().max()) for o in outs))
"""


def test_shared_prompt_decode_attention_in_interpreter() -> None:
    """Rows in groups of 2 sharing a prompt (slots ``start .. prompt_end - 1``): the prompt slots
    come from each group's first row, even where the second row's own slots differ, the rest from
    each row's own cache; against SDPA on caches with the first row's prompt copied in (Triton
    interpreter, 3 and 1 query heads per KV head, with and without splits of the prompt range)."""
    stdout = in_interpreter(CHECK_SHARED_PROMPT)
    assert stdout.count("READS_LEADER True True") == 2
    errors = [float(line.split()[1]) for line in stdout.splitlines() if line.startswith("MAXERR")]
    assert len(errors) == 2 and max(errors) < 1e-5


CHECK_SHARED_ENGINE = """
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from megalith_chat.engine.fast import FastEngine, FastEngineConfig
from megalith_chat.engine.sampling import SamplingParams
cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=64, max_position_embeddings=128, pad_token_id=0,
                  bos_token_id=None, eos_token_id=None)
cfg._attn_implementation = "sdpa"
torch.manual_seed(0)
model = LlamaForCausalLM(cfg).eval()
config = FastEngineConfig(max_batch=8, max_len=24, attention="triton", share_prompts=True)
engine = FastEngine(model, config, device="cpu")
ids = torch.randint(1, 64, (3, 5), generator=torch.Generator().manual_seed(1))
mask = torch.ones_like(ids)
mask[0, :2] = 0
ids, mask = ids.masked_fill(mask == 0, 0).repeat_interleave(2, 0), mask.repeat_interleave(2, 0)
params = SamplingParams(8, temperature=1.0)
outs = [engine.generate(ids, mask, params, generator=torch.Generator().manual_seed(2), group=grp) for grp in (2, 1)]
print("ATTENTION", engine.attention, "MEMBERS", engine._members(ids, mask, 2, 6))
print("TOKENS_EQUAL", torch.equal(outs[0].tokens, outs[1].tokens))
print("MAXERR", float((outs[0].logprobs - outs[1].logprobs).abs().max()))
auto = FastEngine(model, FastEngineConfig(max_batch=8, max_len=24, attention="triton"), device="cpu")
# auto: shared from 2048 (row, KV head) pairs per bucket, here 2 KV heads -> 1024 rows
print("AUTO", [auto._members(ids, mask, 2, rows) for rows in (6, 1022, 1024)])
"""


def test_engine_shares_group_prompts() -> None:
    """A sampled ``generate`` of 3 prompts x 2 samples with ``group=2`` (each prompt prefilled once,
    its cache slots read once per group: Triton attention in the interpreter, CPU) gives the tokens
    of the unshared call, log-probs within the engine's 1e-5 (the first call leaves the second rows'
    prompt slots unwritten). By default (``share_prompts=None``) only buckets with at least 2048
    (row, KV head) pairs share."""
    stdout = in_interpreter(CHECK_SHARED_ENGINE, timeout=240)
    assert "ATTENTION triton MEMBERS 2" in stdout
    assert "AUTO [1, 1, 2]" in stdout
    assert "TOKENS_EQUAL True" in stdout
    assert float(stdout.split("MAXERR")[1].split()[0]) < TOL


def test_bad_groups_rejected(engine: FastEngine) -> None:
    ids, mask = left_padded()
    params = SamplingParams(2)
    with pytest.raises(ConfigError, match="divide the batch of 3 rows, got 2"):
        engine.generate(ids, mask, params, group=2)
    pair = torch.cat([ids[:1], ids[:1], ids[1:2], ids[2:3]])
    pair_mask = torch.cat([mask[:1], mask[:1], mask[1:2], mask[2:3]])
    with pytest.raises(ConfigError, match="prompt_ids row 3 differs from row 2, the first of its group of 2"):
        engine.generate(pair, pair_mask, params, group=2)
    assert engine._members(pair[:2], pair_mask[:2], 2, 2) == 1  # CPU (SDPA attention): nothing shared


def test_share_prompts_from_the_cli(model: LlamaForCausalLM, caplog: pytest.LogCaptureFixture) -> None:
    """``chat-train grpo --[no-]share-prompts`` reaches the producers' engine config (default None:
    the engine decides); on CPU the engine runs SDPA attention, so nothing is shared there, and
    when asked for sharing it says so (silent by default)."""
    from megalith_chat.cli import build_parser
    from megalith_chat.commands import grpo_config
    from megalith_chat.engine.fast_rollout import make_fast_generator

    parser = build_parser()
    flags = {"grpo": None, "grpo --share-prompts": True, "grpo --no-share-prompts": False}
    for args, want in flags.items():
        assert grpo_config(parser.parse_args(args.split())).engine.share_prompts is want
    auto = make_fast_generator(model, "fast", seed=0)
    assert auto is not None and not auto.engine.share_prompts and not caplog.text
    on = grpo_config(parser.parse_args(["grpo", "--share-prompts"]))
    fast = make_fast_generator(model, "fast", seed=0, share_prompts=on.engine.share_prompts)
    assert fast is not None and fast.engine.config.share_prompts and not fast.engine.share_prompts
    assert "share_prompts needs the Triton decode attention" in caplog.text
    assert make_fast_generator(model, "hf", share_prompts=True) is None
    assert "--share-prompts applies to the fast rollout engine only" in caplog.text


HOPPER_PTX = """
import inspect, json, re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from megalith_chat.engine import fast_attention

partial, _ = fast_attention.make_kernels()
names = list(inspect.signature(partial.fn).parameters)
consts = dict(G=1, BG=16, D=64, BN=32, PREC="tf32", DIRECT=True, PART=0, R=1, BQ=16, ROPE=False,
              NORM=False, HAS_BIAS=False, HIDDEN=1)
def kind(n):
    if n in ("start_ptr", "slot_ptr", "pend_ptr"): return "*i64"
    if n in ("m_ptr", "l_ptr", "a_ptr"): return "*fp32"
    if n.endswith("_ptr"): return "*bf16"
    return "fp32" if n in ("scale", "eps") else "i32"
aligned = [i for i, n in enumerate(names) if n.endswith("_ptr") or n in ("sk_b", "sk_h", "sk_t")]
sig = {n: kind(n) for n in names if n not in consts}
attrs = {(i,): [["tt.divisibility", 16]] for i in aligned}
src = ASTSource(partial, {**sig, **dict.fromkeys(consts, "constexpr")}, consts, attrs)
text = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 2}).asm["ptx"]
print(json.dumps({"loads": len(re.findall(r"cp[.]async[.][^;]*global[^;]*;", text))}))
"""


def test_decode_attention_compiles_for_hopper() -> None:
    """Compiled for an H100/H200 (sm_90, no GPU needed): the decode attention's cache loads (k and
    v) are pipelined as asynchronous copies."""
    import json

    got = json.loads(run_triton(HOPPER_PTX, False).strip().splitlines()[-1])
    assert got["loads"] >= 2  # k and v pipelined
