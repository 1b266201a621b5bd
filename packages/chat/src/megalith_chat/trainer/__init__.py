"""megalith_chat.trainer (see the modules)."""
