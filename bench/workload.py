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

Sizes are in the backends' tokens: the system prompt and every user message are drawn from a fixed
English word list (``backends.words``) until they encode to exactly the planned number of tokens
with the model's tokenizer (``WordCosts``; by default the shipped ``models/tiny-llama``, which the
backends serve). Its byte-level BPE splits text into pre-tokens at spaces, so a message's token count
is the sum of its words' counts (" water" is 4 tokens there; the old word tokenizer counted 1).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

import msgspec
import tokenizers

from backends.words import WORDS
from rendering.model import DEFAULT_MODEL_DIR


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
    #: tokens per user message (its content, encoded alone), inclusive range
    user_tokens: tuple[int, int] = (40, 120)
    #: answer length in tokens, inclusive range (sent as max_tokens with ignore_eos)
    answer_tokens: tuple[int, int] = (100, 200)
    #: tokens of the system prompt shared by every session (its content, encoded alone)
    system_tokens: int = 300
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
        for name in ("user_tokens", "answer_tokens"):
            low, high = getattr(self, name)
            if not 1 <= low <= high:
                raise ValueError(f"{name} must be a range (low, high) with 1 <= low <= high")
        if self.system_tokens < 1:
            raise ValueError("system_tokens must be at least 1")
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


#: the system prompt's first words; the rest are drawn
SYSTEM_HEAD = "You are a helpful assistant."


class WordCosts:
    """The word list with each word's token count in one tokenizer, for sizing text in its tokens."""

    def __init__(self, tokenizer: tokenizers.Tokenizer, words: Sequence[str] = WORDS) -> None:
        self.tokenizer = tokenizer
        self.words = tuple(words)
        # every word is drawn after a space, so it is costed as " word" (one pre-token)
        encoded = tokenizer.encode_batch([" " + w for w in self.words], add_special_tokens=False)
        self.cost = {w: len(e.ids) for w, e in zip(self.words, encoded, strict=True)}
        cheapest = min(self.cost.values())
        if cheapest != 1:
            raise ValueError("the tokenizer has no one-token word in the word list; messages cannot be sized exactly")
        #: fitting[k] = the words of at most k tokens (k up to the dearest word's count)
        self.fitting = [tuple(w for w in self.words if self.cost[w] <= k) for k in range(max(self.cost.values()) + 1)]

    @classmethod
    def of_model(cls, model_dir: str | Path = DEFAULT_MODEL_DIR) -> WordCosts:
        """The costs in a model folder's tokenizer (default: the shipped one the backends serve)."""
        return cls(tokenizers.Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json")))

    def count(self, text: str) -> int:
        """``text``'s token count (no special tokens)."""
        return len(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def text(self, rng: random.Random, head: str, tokens: int) -> str:
        """``head`` followed by words drawn from ``rng``: exactly ``tokens`` tokens, or ``head`` and one
        word if ``head`` alone takes that many (with tiny-llama: 14 tokens for the system prompt's head,
        21 for a first message's "Conversation N of seed S:", 5 for "Next:")."""
        remaining = max(1, tokens - self.count(head))
        words: list[str] = []
        while remaining > 0:
            word = rng.choice(self.words)
            if self.cost[word] > remaining:
                word = rng.choice(self.fitting[min(remaining, len(self.fitting) - 1)])
            words.append(word)
            remaining -= self.cost[word]
        return head + " " + " ".join(words)


def generate(spec: WorkloadSpec, costs: WordCosts | None = None) -> Workload:
    """The workload of ``spec`` sized in ``costs``' tokenizer (default: the shipped model's): a pure
    function of both (same spec and tokenizer -> equal workload)."""
    spec.check()
    costs = costs or WordCosts.of_model()
    rng = random.Random(spec.seed)
    system = costs.text(rng, SYSTEM_HEAD, spec.system_tokens)
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
            text = costs.text(rng, head, rng.randint(*spec.user_tokens))
            pause = think * rng.uniform(0.5, 1.5) if turn < turns - 1 else 0.0
            plans.append(TurnPlan(text, rng.randint(*spec.answer_tokens), round(pause, 4)))
        sessions.append(SessionPlan(index, f"mt-{spec.seed}-{index}", round(clock, 4), is_heavy, tuple(plans)))
    return Workload(spec, system, tuple(sessions))


def system_message(workload: Workload) -> dict[str, str]:
    return {"role": "system", "content": workload.system_prompt}
