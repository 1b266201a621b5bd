"""Per-session conversation memory, token-budgeted; older turns are folded into a running summary.

Each session id has its own state; nothing is shared between ids. When the recent turns exceed the
token budget, the oldest turns move into the summary as one line each (role + first sentence, clipped),
and the summary keeps only its newest lines within half the budget.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

from megalith.common.errors import ConfigError
from megalith_qa.text import split_sentences

_TOKEN = re.compile(r"[A-Za-z0-9_]+|[\u3400-\u9fff]|[^\sA-Za-z0-9_]")


def approx_tokens(text: str) -> int:
    """Rough token count: words, CJK characters and punctuation marks each count one."""
    return len(_TOKEN.findall(text))


@dataclass(frozen=True)
class Turn:
    role: str  # "user" | "assistant"
    content: str


@dataclass
class _Session:
    turns: list[Turn] = field(default_factory=list)
    summary: list[str] = field(default_factory=list)


class ConversationMemory:
    """Session id -> recent turns + summary. At most `max_sessions` sessions are kept (LRU)."""

    def __init__(self, token_budget: int = 512, max_sessions: int = 10_000) -> None:
        if token_budget < 32:
            raise ConfigError(f"token_budget must be >= 32, got {token_budget}")
        self.token_budget = token_budget
        self.max_sessions = max_sessions
        self._sessions: OrderedDict[str, _Session] = OrderedDict()
        self._lock = threading.Lock()

    def _get(self, session_id: str) -> _Session:
        state = self._sessions.get(session_id)
        if state is None:
            state = self._sessions[session_id] = _Session()
            while len(self._sessions) > self.max_sessions:
                self._sessions.popitem(last=False)
        self._sessions.move_to_end(session_id)
        return state

    def add(self, session_id: str, role: str, content: str) -> None:
        with self._lock:
            state = self._get(session_id)
            state.turns.append(Turn(role, content))
            self._compact(state)

    def _compact(self, state: _Session) -> None:
        while len(state.turns) > 1 and sum(approx_tokens(t.content) for t in state.turns) > self.token_budget:
            old = state.turns.pop(0)
            first = (split_sentences(old.content) or [old.content])[0][:160]
            state.summary.append(f"{old.role}: {first}")
        while len(state.summary) > 1 and approx_tokens("\n".join(state.summary)) > self.token_budget // 2:
            state.summary.pop(0)

    def turns(self, session_id: str) -> list[Turn]:
        with self._lock:
            state = self._sessions.get(session_id)
            return list(state.turns) if state else []

    def questions(self, session_id: str) -> list[str]:
        return [t.content for t in self.turns(session_id) if t.role == "user"]

    def summary(self, session_id: str) -> str:
        with self._lock:
            state = self._sessions.get(session_id)
            return "\n".join(state.summary) if state else ""

    def render(self, session_id: str) -> str:
        """Summary of older turns followed by the recent turns, one line each."""
        lines = []
        summary = self.summary(session_id)
        if summary:
            lines.append(f"(earlier) {summary}")
        lines.extend(f"{t.role}: {t.content}" for t in self.turns(session_id))
        return "\n".join(lines)

    def __contains__(self, session_id: str) -> bool:
        with self._lock:
            return session_id in self._sessions
