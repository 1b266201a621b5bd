"""Chat data: templates, SFT/preference tokenisation with loss masks, JSONL datasets, built-in tasks."""

from megalith_chat.data.datasets import (
    PreferenceExample,
    PromptExample,
    SFTExample,
    load_preference_dataset,
    load_prompt_dataset,
    load_sft_dataset,
    read_jsonl,
)
from megalith_chat.data.preview import preview_examples, render_loss_mask
from megalith_chat.data.sft import (
    IGNORE_INDEX,
    TokenizedExample,
    TokenizedPair,
    tokenize_conversation,
    tokenize_preference,
)
from megalith_chat.data.tasks import TASKS, Task, arithmetic_task, get_task, reverse_digits_task
from megalith_chat.data.templates import (
    CHATML_TEMPLATE,
    encode_prompt,
    ensure_chat_template,
    render_chat,
    validate_messages,
)

__all__ = [
    "CHATML_TEMPLATE",
    "IGNORE_INDEX",
    "TASKS",
    "PreferenceExample",
    "PromptExample",
    "SFTExample",
    "Task",
    "TokenizedExample",
    "TokenizedPair",
    "arithmetic_task",
    "encode_prompt",
    "ensure_chat_template",
    "get_task",
    "load_preference_dataset",
    "load_prompt_dataset",
    "load_sft_dataset",
    "preview_examples",
    "read_jsonl",
    "render_chat",
    "render_loss_mask",
    "reverse_digits_task",
    "tokenize_conversation",
    "tokenize_preference",
    "validate_messages",
]
