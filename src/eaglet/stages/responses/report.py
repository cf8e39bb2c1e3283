"""What a dataset's regenerated answers look like: the checks a user reads before training on
them, each a count and the first record ids (`eaglet status`, the report page, the sidecar's
`regeneration`).

    turns             assistant turns regenerated (one per record), of how many conversations
    truncated         answers cut at max_new_tokens (dropped or kept, `truncated`)
    empty_answer      no content and no tool call
    empty_reasoning   asked to think (thinking on) but no reasoning
    leftover_markers  template or grammar markers inside the text of an answer or its reasoning
    calls_unanswered  prompts whose trajectory has a tool call without a result
    refused           prompts the API refused for good
    token_drift       stored tokens against the server's count (generated streams)
"""

from __future__ import annotations

from eaglet.formats.grammar import Grammar

FIRST = 5  # record ids shown per check
MARKERS = ("<|im_start|>", "<|im_end|>", "<think>", "</think>")  # ChatML and reasoning


def report(records: list[dict], stats: dict, g: Grammar) -> dict:
    """The checks over the records written (and the stage's stats: truncation, refusals, drift)."""
    markers = tuple(dict.fromkeys((*MARKERS, *g.markers)))
    found: dict[str, list[str]] = {
        "empty_answer": [],
        "empty_reasoning": [],
        "leftover_markers": [],
        "calls_unanswered": [],
    }
    for rec in records:
        text, reasoning = rec.get("response") or "", rec.get("reasoning") or ""
        if not text.strip() and not rec.get("tool_calls"):
            found["empty_answer"].append(rec["id"])
        if any((rec.get("chat_template_kwargs") or {}).values()) and not reasoning.strip():
            found["empty_reasoning"].append(rec["id"])
        if any(m in text or m in reasoning for m in markers):
            found["leftover_markers"].append(rec["id"])
        if unanswered_calls(rec["messages"]):
            found["calls_unanswered"].append(rec["id"])
    what = "the last turn" if stats.get("turns") == "last" else "every turn"
    what += f" of {stats.get('conversations', len(records)):,} conversations"
    out = {"turns": {"count": len(records), "first": [], "what": what}}
    truncated = stats.get("truncated", {})
    out["truncated"] = {
        "count": truncated.get("dropped", 0) + truncated.get("kept", 0),
        "first": truncated.get("first", []),
        "what": "dropped" if truncated.get("dropped") else "kept",
    }
    out |= {k: {"count": len(ids), "first": ids[:FIRST]} for k, ids in found.items()}
    refused = stats.get("rejected", {}).get("api", 0)
    first = stats.get("first_rejected", {}).get("api")
    out["refused"] = {"count": refused, "first": [first.split(":")[0]] if first else []}
    drift = stats.get("token_drift", {})
    worst = drift.get("worst")
    out["token_drift"] = {"drift": drift.get("drift", 0.0), "first": [worst["id"]] if worst else []}
    return out


def unanswered_calls(messages: list[dict]) -> list[str]:
    """Ids of the tool calls in `messages` that no later tool message answers."""
    pending: list[str] = []
    for m in messages:
        if m.get("role") == "assistant":
            pending += [c.get("id") or "" for c in m.get("tool_calls") or []]
        elif m.get("role") == "tool":
            answered = m.get("tool_call_id")
            if answered in pending:
                pending.remove(answered)
            elif pending:  # no id: the earliest pending call (as the prompts stage pairs them)
                pending.pop(0)
    return pending


def summary(rep: dict) -> str:
    """One status line: the checks that found something."""
    parts = []
    for name, check in rep.items():
        if name in ("turns", "token_drift") or not check["count"]:
            continue
        what = f" {check['what']}" if name == "truncated" else ""
        parts.append(f"{check['count']} {name.replace('_', ' ')}{what} (first {check['first'][0]})")
    return "; ".join(parts)
