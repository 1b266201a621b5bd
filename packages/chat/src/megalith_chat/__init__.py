"""megalith-chat: RLHF / GRPO building blocks on megalith.

``algorithms`` (pure-torch losses and advantages), ``rewards`` (verifiable rewards and a safe
runner), ``data`` (chat templates, loss masks, datasets, built-in tasks), ``messages``
(producer/consumer message types) and ``cli`` (``chat-train``). Importing this package is cheap;
submodules import torch and transformers where needed.
"""

__version__ = "0.1.0"
