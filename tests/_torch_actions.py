"""Test support: torch pipelining actions in fxpipe's action vocabulary (test-only private API)."""

from __future__ import annotations


def torch_action_names(actions) -> list[str]:
    """fxpipe action strings (``"2B0"``) of a row of torch ``_Action``s.

    torch's ``I`` (backward-input) is fxpipe's ``B``; torch's full ``B`` is fxpipe's ``B``
    then ``W``; overlapped actions contribute their sub-actions; ``None`` (padding) is skipped.
    """
    out: list[str] = []
    for a in actions:
        if a is None:
            continue
        if a.sub_actions is not None:
            out += torch_action_names(a.sub_actions)
            continue
        t = a.computation_type.value
        if t == "I":
            out.append(f"{a.stage_index}B{a.microbatch_index}")
        elif t == "B":
            out += [f"{a.stage_index}B{a.microbatch_index}", f"{a.stage_index}W{a.microbatch_index}"]
        else:
            out.append(f"{a.stage_index}{t}{a.microbatch_index}")
    return out
