"""megalith_chat.engine (see the modules)."""
