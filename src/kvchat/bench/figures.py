"""A bench's figures as it measures them, for ``make gpu-check``: a step that its time limit cuts off
keeps what it measured, where the bench's own JSON comes only at its end."""
import json
import os


def figure(row: dict) -> None:
    """``row`` as one JSON line of the file KVCHAT_FIGURES names (gpu-check's results.jsonl), under
    the step KVCHAT_STEP; nothing where it is not set."""
    path = os.environ.get("KVCHAT_FIGURES")
    if path:
        with open(path, "a") as out:
            out.write(json.dumps({"step": os.environ.get("KVCHAT_STEP", ""), "figure": row}) + "\n")
