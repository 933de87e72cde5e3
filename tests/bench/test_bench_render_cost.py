"""bench.render_cost works: the conversation grows turn by turn, a ``--quick`` run checks every
incremental render against the full one and writes its section and JSON line (no timing assertions:
the figures are the benchmark's, not the test's)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import msgspec

from bench import render_cost


def test_conversation_resends_the_growing_history() -> None:
    conversation = render_cost.build_conversation(0.5, turns=4, tokens=4000, model="tiny-llama")
    decoded = [msgspec.json.decode(body) for body in conversation.bodies]
    assert [len(d["messages"]) for d in decoded] == [2, 4, 6, 8]
    assert all(d["model"] == "tiny-llama" for d in decoded)
    # each body's history is the previous body's, plus the answer and the new user message
    assert decoded[2]["messages"][:4] == decoded[1]["messages"]
    assert [m["role"] for m in decoded[3]["messages"][-3:]] == ["user", "assistant", "user"]
    text = render_cost.message_text(random.Random(3), 2000)
    assert 2000 <= len(text) < 4000 and "\n\n" in text


def test_quick_run_writes_its_section(tmp_path: Path) -> None:
    out, jsonl = tmp_path / "RESULTS.md", tmp_path / "render_cost.jsonl"
    out.write_text("# Benchmark results\n\n## Someone else's section\n\nkept\n", encoding="utf-8")
    assert render_cost.main(["--quick", "--out", str(out), "--jsonl", str(jsonl)]) == 0
    text = out.read_text(encoding="utf-8")
    assert "## Someone else's section\n\nkept" in text
    assert "<!-- render_cost:begin -->" in text and "<!-- render_cost:end -->" in text
    assert "## Tokens mode: incremental render" in text and "| 6 |" in text
    run = json.loads(jsonl.read_text(encoding="utf-8").splitlines()[-1])
    turns = run["turns"]
    assert [t["turn"] for t in turns] == [1, 2, 3, 4, 5, 6]
    assert turns[0]["new_tokens"] == turns[0]["prompt_tokens"]  # the first turn has no state
    # later turns encode only their new tail: the history's tokens are reused
    assert all(t["new_tokens"] < t["prompt_tokens"] / 2 for t in turns[2:])
    assert turns[-1]["prompt_tokens"] > 3000
