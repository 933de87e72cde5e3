"""Seeded multi-turn chat workloads for the routing benchmark (``bench.multiturn``).

A workload is a list of sessions, each a planned conversation: when it arrives (Poisson
arrivals: exponential gaps at ``arrival_rate`` sessions per second), its user messages, the
length of each answer and the think time after each answer. Every session starts with the
same shared system prompt. What the backend answers is only known at run time, so the runner
builds each turn's prompt as it goes: the previous prompt + the previous answer + the next
user message (the chat format), which is what lets a backend's prefix cache serve it.

The same ``WorkloadSpec`` (seed included) always gives the same ``Workload``, so every policy
of a benchmark run replays exactly the same conversations. Answers are requested with
``ignore_eos`` so that their lengths (in tokens) are part of the plan as well: the prompt token
counts are then identical across policies, and so is the oracle hit ratio.

The skewed variant (``heavy_share > 0``) makes a few sessions much longer (``heavy_turns_x``
times the turns) and busier (``heavy_think_x`` times the think time).

Text is drawn from the session-backend tokenizer's word list, so one word is one token there.
"""

from __future__ import annotations

import random

import msgspec

from backends.words import WORDS


class WorkloadSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What to generate; every field has a default (the full benchmark's uniform variant)."""

    #: number of sessions (conversations)
    sessions: int = 64
    #: turns of an ordinary session
    turns: int = 8
    #: Poisson arrival rate of new sessions, per second
    arrival_rate: float = 1.0
    #: mean think time between turns, seconds (each pause is uniform in [0.5, 1.5] x this)
    think_s: float = 2.0
    #: words per user message, inclusive range
    user_words: tuple[int, int] = (40, 120)
    #: answer length in tokens, inclusive range (sent as max_tokens with ignore_eos)
    answer_tokens: tuple[int, int] = (100, 200)
    #: words of the system prompt shared by every session
    system_words: int = 300
    #: share of heavy sessions (0 = the uniform variant)
    heavy_share: float = 0.0
    heavy_turns_x: float = 3.0
    heavy_think_x: float = 0.25
    seed: int = 1

    def check(self) -> None:
        """Raise ``ValueError`` naming the first field out of range."""
        if self.sessions < 1 or self.turns < 1:
            raise ValueError("sessions and turns must be at least 1")
        if not self.arrival_rate > 0:
            raise ValueError("arrival_rate must be > 0 sessions per second")
        if self.think_s < 0:
            raise ValueError("think_s must be >= 0")
        for name in ("user_words", "answer_tokens"):
            low, high = getattr(self, name)
            if not 1 <= low <= high:
                raise ValueError(f"{name} must be a range (low, high) with 1 <= low <= high")
        if self.system_words < 1:
            raise ValueError("system_words must be at least 1")
        if not 0 <= self.heavy_share <= 1:
            raise ValueError("heavy_share must be between 0 and 1")
        if self.heavy_turns_x < 1 or not 0 < self.heavy_think_x <= 1:
            raise ValueError("heavy_turns_x must be >= 1 and heavy_think_x in (0, 1]")


class TurnPlan(msgspec.Struct, frozen=True):
    #: the new user message of this turn
    user: str
    #: answer length in tokens (max_tokens, with ignore_eos)
    max_tokens: int
    #: pause after the answer before the next turn (0 after the last turn)
    think_s: float


class SessionPlan(msgspec.Struct, frozen=True):
    index: int
    #: the X-Session-ID a client sends in the header variant
    session_id: str
    #: arrival time, seconds after the run started
    start_s: float
    heavy: bool
    turns: tuple[TurnPlan, ...]


class Workload(msgspec.Struct, frozen=True):
    spec: WorkloadSpec
    system_prompt: str
    sessions: tuple[SessionPlan, ...]

    @property
    def num_requests(self) -> int:
        return sum(len(s.turns) for s in self.sessions)

    @property
    def last_arrival_s(self) -> float:
        return max((s.start_s for s in self.sessions), default=0.0)


def _sentence(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def generate(spec: WorkloadSpec) -> Workload:
    """The workload of ``spec``: a pure function of it (same spec -> equal workload)."""
    spec.check()
    rng = random.Random(spec.seed)
    system = "You are a helpful assistant. " + _sentence(rng, spec.system_words)
    # heavy sessions: a fixed count, spread by the rng (at least one when the share is > 0)
    num_heavy = max(1, round(spec.sessions * spec.heavy_share)) if spec.heavy_share > 0 else 0
    heavy = set(rng.sample(range(spec.sessions), num_heavy))
    sessions: list[SessionPlan] = []
    clock = 0.0
    for index in range(spec.sessions):
        if index:
            clock += rng.expovariate(spec.arrival_rate)
        is_heavy = index in heavy
        turns = round(spec.turns * spec.heavy_turns_x) if is_heavy else spec.turns
        think = spec.think_s * (spec.heavy_think_x if is_heavy else 1.0)
        plans: list[TurnPlan] = []
        for turn in range(turns):
            # the first message names the session: derived session ids (hash of the system
            # prompt + first user message) are then distinct per conversation
            head = f"Conversation {index} of seed {spec.seed}:" if turn == 0 else "Next:"
            text = f"{head} {_sentence(rng, rng.randint(*spec.user_words))}"
            pause = think * rng.uniform(0.5, 1.5) if turn < turns - 1 else 0.0
            plans.append(TurnPlan(text, rng.randint(*spec.answer_tokens), round(pause, 4)))
        sessions.append(SessionPlan(index, f"mt-{spec.seed}-{index}", round(clock, 4), is_heavy, tuple(plans)))
    return Workload(spec, system, tuple(sessions))


def system_message(workload: Workload) -> dict[str, str]:
    return {"role": "system", "content": workload.system_prompt}
