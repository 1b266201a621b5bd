"""megalith_chat.rollout (see the modules)."""
