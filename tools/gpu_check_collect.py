"""gpu_check.sh's bookkeeping: file a step's stdout, then print one line per bench.

    gpu_check_collect.py step NAME OUT   stdout.tmp -> a line of results.jsonl if JSON, else log.txt
    gpu_check_collect.py summary OUT     one line per decode bench and chat turn, for the closing note

results.jsonl also holds the figures a step filed as it went ({"step", "figure"}, kvchat.bench.figures).
"""
import json
import sys
from pathlib import Path


def file_step(name: str, out: Path) -> None:
    tmp = out / "stdout.tmp"
    text = tmp.read_text() if tmp.exists() else ""
    tmp.unlink(missing_ok=True)
    try:
        line = json.dumps({"step": name, "result": json.loads(text)})
    except ValueError:
        with open(out / "log.txt", "a") as log:
            log.write(text)
        return
    with open(out / "results.jsonl", "a") as results:
        results.write(line + "\n")


def summary(out: Path) -> None:
    results = out / "results.jsonl"
    for line in results.read_text().splitlines() if results.exists() else []:
        step = json.loads(line)
        if "result" not in step:  # a figure filed as it was measured: the step's result repeats it
            continue
        r = step["result"]
        if "chat_turn" in r:
            c = r["chat_turn"]
            print(f"{step['step']}: a chat's next turn {c['ttft_long_ms']:.1f} ms after {c['history_tokens']} cached "
                  f"tokens, {c['ttft_short_ms']:.1f} ms after {c['short_tokens']}: ratio {c['ratio']:.2f}")
        for k in r.get("measured", []) if isinstance(r, dict) else []:
            if k["context"] == max(x["context"] for x in r["measured"]):
                print(f"{step['step']}: decode {k['precision']} at {k['context']}: {k['measured_us']:.1f} us measured, "
                      f"{k['predicted_us']:.1f} us modelled, {k['bound_us']:.1f} us at the bandwidth "
                      f"({k['bound_us'] / k['measured_us']:.0%} of it)")
        if "paths" not in r:
            continue
        paths = ", ".join(f"{k} {v['decode_tok_s']:.1f} tok/s ({v['roofline_fraction']:.0%})"
                          for k, v in r["paths"].items())
        print(f"{step['step']}: roofline {r['roofline_tok_s']:.1f} tok/s at {r['bandwidth_gb_s']:.0f} GB/s; {paths}"
              + (f"; compiled/eager {r['compiled_vs_eager']:.2f}x" if "compiled_vs_eager" in r else ""))


if __name__ == "__main__":
    if sys.argv[1] == "step":
        file_step(sys.argv[2], Path(sys.argv[3]))
    else:
        summary(Path(sys.argv[2]))
