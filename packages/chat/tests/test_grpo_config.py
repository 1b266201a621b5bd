"""``chat-train grpo`` arguments -> GRPORunConfig: defaults, system prompts, and bad flags that
must fail before Ray starts (no Ray, no model in these tests)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from megalith.common.errors import ConfigError
from megalith_chat.cli import build_parser
from megalith_chat.commands import DEFAULT_PREFIX, DEFAULT_SYSTEM, grpo_config
from megalith_chat.engine.config import GRPORunConfig, PromptSource
from megalith_chat.engine.prompts import load_prompts
from megalith_chat.rollout.producer import RolloutConfig


def _config(*argv: str) -> Any:
    return grpo_config(build_parser().parse_args(["grpo", *argv]))


@pytest.fixture
def prompts_file(tmp_path: Path) -> Path:
    records = [
        {"prompt": "Translate to French: cat", "system": "You are a translator.", "answer": "chat"},
        {"prompt": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2+2?"}]},
        {"prompt": "Say hi", "answer": "hi"},
    ]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _systems(config: Any) -> list[str | None]:
    return [
        next((m["content"] for m in p.prompt if m["role"] == "system"), None)
        for p in load_prompts(config.prompts)
    ]


def test_prompts_file_keeps_its_own_system_turns(prompts_file: Path) -> None:
    """The calculator instruction and the '<answer>' prefix belong to the arithmetic task only."""
    cfg = _config("--prompts", str(prompts_file), "--reward", "exact")
    assert _systems(cfg) == ["You are a translator.", "Be terse.", None]
    assert cfg.rollout.response_prefix == ""
    # an explicit --system-prompt fills only the prompts that have none
    cfg = _config("--prompts", str(prompts_file), "--reward", "exact", "--system-prompt", "Be kind.")
    assert _systems(cfg) == ["You are a translator.", "Be terse.", "Be kind."]
    cfg = _config("--prompts", str(prompts_file), "--reward", "exact", "--response-prefix", "<answer>")
    assert cfg.rollout.response_prefix == "<answer>"


def test_task_defaults_for_system_prompt_and_prefix() -> None:
    arithmetic = _config()
    assert set(_systems(arithmetic)) == {DEFAULT_SYSTEM}
    assert arithmetic.rollout.response_prefix == DEFAULT_PREFIX
    reverse = _config("--task", "reverse")
    assert set(_systems(reverse)) == {None} and reverse.rollout.response_prefix == ""
    bare = _config("--system-prompt", "", "--response-prefix", "")
    assert set(_systems(bare)) == {None} and bare.rollout.response_prefix == ""


def test_steps_defaults_are_real_and_documented(capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    assert parser.parse_args(["grpo"]).steps == 24 and _config().steps == 24
    for command in ("sft", "dpo", "rm"):
        assert parser.parse_args([command, "--data", "x"]).steps == 50
    with pytest.raises(SystemExit):
        parser.parse_args(["grpo", "--help"])
    assert "optimizer steps, >= 1 (default: 24)" in " ".join(capsys.readouterr().out.split())


def test_lora_alpha_follows_the_rank() -> None:
    from megalith_chat.trainer.runs import _lora

    assert _config("--lora-r", "4").lora.alpha == 8.0
    assert _config().lora.alpha == 32.0  # default rank 16
    assert _config("--lora-r", "4", "--lora-alpha", "3").lora.alpha == 3.0
    assert _config("--lora-r", "0").lora is None
    sft = build_parser().parse_args(["sft", "--data", "x", "--lora-r", "4"])
    assert sft.lora_alpha is None and _lora(sft).alpha == 8.0


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--steps", "0"], "--steps must be >= 1, got 0"),
        (["--steps", "-5"], "--steps must be >= 1, got -5"),
        (["--advantage", "rloo", "-G", "1"], "--group-size must be >= 2, got 1"),
        (["-G", "1"], "--group-size must be >= 2, got 1"),
        (["--clip-eps", "1.5"], "--clip-eps must be in [0, 1), got 1.5"),
        (["--clip-eps-high", "-1"], "--clip-eps-high must be >= 0, got -1.0"),
        (["--reward", "exact=1,answer_fmt=0.2"], "unknown reward 'answer_fmt'"),
        (["--reward", "math=heavy"], "'heavy'"),
        (["--reward", "no_such_module_xyz:fn"], "'no_such_module_xyz'"),
        (
            ["--prompts", "/nonexistent.jsonl", "--reward", "math"],
            "--prompts /nonexistent.jsonl: no such file",
        ),
        (["--num-cpus", "0"], "--num-cpus must be >= 1, got 0"),
        (["--prompts-per-step", "0"], "--prompts-per-step must be >= 1, got 0"),
        (["--lr", "-1"], "--lr must be a number > 0, got -1.0"),
        (["--lora-r", "-2"], "--lora-r must be >= 0, got -2"),
        (["--temperature", "nan"], "--temperature must be >= 0, got nan"),
        (["--kl-coef", "-0.1"], "--kl-coef must be >= 0, got -0.1"),
        (["--lora-r", "4", "--lora-alpha", "nan"], "LoRA needs r >= 1, alpha > 0"),
    ],
)
def test_bad_grpo_flags_fail_in_grpo_config(argv: list[str], named: str) -> None:
    with pytest.raises(ConfigError) as info:
        _config(*argv)
    assert named in str(info.value)


def test_dpo_beta_is_named_by_its_flag(capsys: pytest.CaptureFixture[str]) -> None:
    from megalith_chat.cli import main

    assert main(["dpo", "--data", "x.jsonl", "--beta", "nan"]) == 2
    assert "--beta must be a number > 0, got nan" in capsys.readouterr().err


def test_joining_a_cluster_checks_only_the_reward_spec_form() -> None:
    """With --ray-address the reward module may exist on the workers only: not imported here."""
    cfg = _config("--ray-address", "127.0.0.1:1", "--reward", "workers_only_module:fn")
    assert cfg.prompts.reward == "workers_only_module:fn"
    with pytest.raises(ConfigError, match="'answer_fmt'"):
        _config("--ray-address", "127.0.0.1:1", "--reward", "answer_fmt")


def test_run_configs_validate_themselves() -> None:
    """Library users (GRPOEngine(config)) get the same checks as the command line."""
    with pytest.raises(ConfigError, match="'answer_fmt'"):
        PromptSource(task="reverse", reward="exact=1,answer_fmt=0.2")
    with pytest.raises(ConfigError, match="'sorting'"):
        PromptSource(task="sorting")
    with pytest.raises(ConfigError, match="group_size = 1"):
        GRPORunConfig(rollout=RolloutConfig(group_size=1, dynamic_sampling=False))
    assert PromptSource(task="reverse", reward="some.module:fn").reward == "some.module:fn"
