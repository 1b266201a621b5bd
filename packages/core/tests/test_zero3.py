"""ZeRO-3 (sharded parameters) on 2 and 4 gloo ranks equals a single-process fp32 reference;
measured bytes equal plan(); communication is the ZeRO paper's 1.5× DDP (Core v2 §1, §3, §6)."""

from __future__ import annotations

from functools import cache

import pytest
import torch

from megalith.booster import Booster, plan
from megalith.booster.plugins import DDPPlugin, ZeroPlugin
from megalith.common.errors import ConfigError
from megalith.testing import assert_states_close, run_distributed, state_of
from megalith.testing.loops import boosted_steps, reference_steps
from megalith.testing.models import WithUnused, synthetic_batches, tiny_llama

STEPS, GLOBAL_BATCH, SEQ, LR, WD, EPS = 3, 8, 12, 1e-3, 0.1, 1e-6
VARIANTS = {
    "plain": {},
    "prefetch": {"prefetch": True, "overlap": True},
    "accum3": {"accum": 3},
    "clip": {"clip": 0.05},
    "offload_half": {"offload": 0.5},
    "offload_all": {"offload": 1.0},
    "tied": {"tie": True, "prefetch": True},
    "frozen": {"frozen": True},
}
FROZEN = ("lm.model.norm.weight", "lm.model.layers.0.mlp.up_proj.weight")


def make_model(v: dict) -> torch.nn.Module:
    model = WithUnused(tie=v.get("tie", False))
    if v.get("frozen"):
        for name, p in model.named_parameters():
            p.requires_grad_(name not in FROZEN)
    return model


def make_opt(model: torch.nn.Module) -> torch.optim.Optimizer:
    decay = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() > 1]
    other = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() <= 1]
    # two param groups: ZeRO-3 must split every module group by optimizer group
    return torch.optim.AdamW(
        [{"params": decay}, {"params": other, "weight_decay": 0.0}], lr=LR, weight_decay=WD, eps=EPS
    )


@cache
def reference(variant: str) -> dict[str, torch.Tensor]:
    """Plain torch, one process, the whole global batch."""
    v = VARIANTS[variant]
    accum = v.get("accum", 1)
    model = make_model(v)
    opt = make_opt(model)
    reference_steps(model, opt, synthetic_batches(STEPS * accum, GLOBAL_BATCH, SEQ), accum, v.get("clip"))
    return state_of(model)


def train_zero3(rank: int, world: int, variant: str) -> dict[str, torch.Tensor]:
    v = VARIANTS[variant]
    accum = v.get("accum", 1)
    model = make_model(v)
    plugin = ZeroPlugin(
        stage=3,
        bucket_size_mb=0.01,  # ~2.6k elements: attention, MLP, embeddings each become a group
        offload_optim_frac=v.get("offload", 0.0),
        offload_param_frac=v.get("offload", 0.0),
        prefetch=v.get("prefetch", False),
        overlap_communication=v.get("overlap", False),
    )
    booster = Booster(plugin)
    model, opt, *_ = booster.boost(model, make_opt(model))
    batches = synthetic_batches(STEPS * accum, GLOBAL_BATCH, SEQ)
    boosted_steps(booster, model, opt, batches, rank, world, accum, v.get("clip"))
    if v.get("tie"):
        assert model.lm.lm_head.weight is model.lm.model.embed_tokens.weight
    with plugin.full_parameters(model):
        return state_of(model)


def zero3_worker(rank: int, world: int) -> dict[str, dict[str, torch.Tensor]]:
    return {name: train_zero3(rank, world, name) for name in VARIANTS}


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_zero3_matches_single_process(world: int) -> None:
    results = run_distributed(zero3_worker, world, timeout_s=240)
    for name in VARIANTS:
        ref = reference(name)
        for rank, states in enumerate(results):
            try:
                assert_states_close(states[name], ref, atol=1e-5)
            except AssertionError as exc:
                raise AssertionError(f"ZeRO-3 dp={world} variant={name} rank={rank}: {exc}") from None
        assert torch.equal(results[0][name]["unused.weight"], ref["unused.weight"])
    start = state_of(make_model(VARIANTS["frozen"]))
    for k in FROZEN:  # frozen parameters did not move, the others did
        assert torch.equal(results[0]["frozen"][k], start[k])
    assert not torch.equal(results[0]["frozen"]["lm.lm_head.weight"], start["lm.lm_head.weight"])


def measured_bytes(rank: int, world: int, offload: float, precision: str) -> dict[str, int]:
    model = tiny_llama()
    plugin = ZeroPlugin(stage=3, bucket_size_mb=0.01, offload_optim_frac=offload, offload_param_frac=offload)
    booster = Booster(plugin, precision=precision)
    model, opt, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    ids = torch.randint(0, 131, (2, 8))
    booster.backward(model(input_ids=ids, labels=ids).loss, opt)
    opt.step()
    return opt.memory_bytes()


@pytest.mark.parametrize(
    ("world", "offload", "precision"),
    [(2, 0.0, "fp32"), (4, 0.0, "fp32"), (4, 1.0, "fp32"), (2, 0.0, "bf16")],
)
def test_zero3_measured_bytes_match_plan(world: int, offload: float, precision: str) -> None:
    measured = run_distributed(measured_bytes, world, offload, precision)[0]
    psi = sum(p.numel() for p in tiny_llama().parameters())
    p = plan(
        tiny_llama(),
        ZeroPlugin(stage=3, offload_optim_frac=offload, offload_param_frac=offload),
        world_size=world,
        precision=precision,
    )
    # By hand: fp32 16Ψ/N (4 params + 4 grads + 8 Adam); bf16 2 params + 4 fp32 grads + 12 (Adam+master).
    per_param = 16 if precision == "fp32" else 18
    device = measured["params"] + measured["grads"] + measured["optimizer_states"]
    if offload == 1.0:
        assert device == 0 and p.total == 0
        assert measured["host"] == pytest.approx(per_param * psi / world, rel=0.05)
        assert measured["host"] == pytest.approx(p.host, rel=0.05)
    else:
        assert device == pytest.approx(per_param * psi / world, rel=0.05)
        assert device == pytest.approx(p.total, rel=0.05)
        assert measured["host"] == 0 == p.host


def test_plan_stage3_offload_fractions() -> None:
    model = tiny_llama()
    psi = sum(t.numel() for t in model.parameters())
    n = 8
    half = plan(model, ZeroPlugin(stage=3, offload_optim_frac=0.5), n, "bf16")
    # device: 2Ψ/N params + half of (4 grads + 12 Adam+master); host: the other half
    assert half.total == pytest.approx((2 + 8) * psi / n, rel=1e-3)
    assert half.host == pytest.approx(8 * psi / n, rel=1e-3)
    both = plan(model, ZeroPlugin(stage=3, offload_optim_frac=1.0, offload_param_frac=0.5), n, "fp32")
    assert both.params == pytest.approx(2 * psi / n, rel=1e-3) and both.grads == 0
    # host: 2Ψ/N params + 4 grads + 8 Adam + 4·0.5 separate masters (where params stay on device)
    assert both.host == pytest.approx((2 + 4 + 8 + 2) * psi / n, rel=1e-3)


def comm_worker(rank: int, world: int) -> dict[str, float]:
    import torch.distributed as dist

    from megalith.distributed import count_comm

    out = {}
    ids = torch.randint(0, 131, (2, 8), generator=torch.Generator().manual_seed(rank))
    for name in ("ddp", "zero1", "zero2", "zero3"):
        model = tiny_llama()
        stage = int(name[-1]) if name != "ddp" else 0
        plugin = DDPPlugin() if name == "ddp" else ZeroPlugin(stage=stage, bucket_size_mb=0.01)
        booster = Booster(plugin)
        model, opt, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
        if name == "ddp":  # count DDP's bucket all-reduces through a comm hook that reports them

            def hook(state, bucket):
                from megalith.distributed.comm_counter import report

                report("all_reduce", bucket.buffer(), world)
                fut = dist.all_reduce(bucket.buffer().div_(world), async_op=True).get_future()
                return fut.then(lambda f: f.value()[0])

            model.register_comm_hook(None, hook)
        with count_comm() as counter:
            booster.backward(model(input_ids=ids, labels=ids).loss, opt)
            opt.step()
            opt.zero_grad()
        out[name] = counter.bytes_sent
    return out


def test_zero3_communicates_one_and_a_half_times_ddp() -> None:
    world = 4
    volumes = run_distributed(comm_worker, world)[0]
    psi_bytes = 4 * sum(p.numel() for p in tiny_llama().parameters())
    # by hand: DDP all-reduces every gradient once: 2 (N-1)/N Ψ
    assert volumes["ddp"] == pytest.approx(2 * (world - 1) / world * psi_bytes, rel=0.05)
    assert volumes["zero3"] / volumes["ddp"] == pytest.approx(1.5, rel=0.05)
    assert volumes["zero2"] / volumes["ddp"] == pytest.approx(1.0, rel=0.05)
    assert volumes["zero1"] / volumes["ddp"] == pytest.approx(1.0, rel=0.05)


class WithIntParam(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lm = tiny_llama()
        self.lm.model.norm.register_parameter(
            "counter", torch.nn.Parameter(torch.zeros(3, dtype=torch.int64), requires_grad=False)
        )


def test_zero3_rejects_parameter_it_cannot_shard() -> None:
    model = WithIntParam()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    with pytest.raises(ConfigError, match=r"non-floating parameter 'lm\.model\.norm\.counter'"):
        Booster(ZeroPlugin(stage=3)).boost(model, opt)
    with pytest.raises(ConfigError, match=r"offload_param_frac=0.5 needs stage=3"):
        ZeroPlugin(stage=2, offload_param_frac=0.5)
    with pytest.raises(ConfigError, match=r"offload_optim_frac must be in \[0, 1\], got 1.5"):
        ZeroPlugin(stage=3, offload_optim_frac=1.5)
