"""A self-contained HTML page showing sampled episodes token by token, coloured by mask.

Policy tokens (mask 1) are green, environment/prompt/template tokens (mask 0) grey:
a masking bug (a tool result in green, a sampled token in grey) is visible at once. Each
policy turn starts with a label: its step reward, its per-turn reward and the advantage
its tokens trained with.
"""

from __future__ import annotations

import html
import json
from pathlib import Path

_STYLE = """
body{font-family:system-ui,sans-serif;margin:1.5em;max-width:1100px}
.ep{border:1px solid #ccc;border-radius:6px;margin:1em 0;padding:.6em}
.meta{font-size:.9em;color:#333;margin-bottom:.4em}
.toks{font-family:ui-monospace,monospace;white-space:pre-wrap;font-size:.85em;line-height:1.5}
.p{background:#c8f0c8}.e{background:#eee;color:#555}
.legend span{padding:0 .4em;margin-right:1em}
.turn{font-size:.8em;color:#05a;font-family:system-ui,sans-serif}
"""


def episode_files(run_dir: str | Path) -> list[Path]:
    """The run's ``episodes/step_*.jsonl`` files, oldest first."""
    return sorted((Path(run_dir) / "episodes").glob("step_*.jsonl"))


def render_html(run_dir: str | Path, step: int | None = None, max_episodes: int = 32) -> Path:
    """Write ``run_dir/viewer/step_N.html`` for ``step`` (default: the latest) and return it."""
    files = episode_files(run_dir)
    if not files:
        raise FileNotFoundError(f"no episodes/step_*.jsonl in {run_dir}: nothing to show")
    if step is None:
        path = files[-1]
    else:
        path = Path(run_dir) / "episodes" / f"step_{step:06d}.jsonl"
        if not path.exists():
            steps = ", ".join(str(int(f.stem.split("_")[1])) for f in files)
            raise FileNotFoundError(f"no episodes for step {step}; available steps: {steps}")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    parts = [
        f"<html><head><meta charset='utf-8'><title>{path.stem}</title>",
        f"<style>{_STYLE}</style></head><body><h2>{html.escape(str(run_dir))}: "
        f"{path.stem}</h2><div class='legend'><span class='p'>policy token (mask 1)</span>"
        "<span class='e'>environment / prompt (mask 0)</span></div>",
    ]
    for i, row in enumerate(rows[:max_episodes]):
        adv = row.get("advantage")
        meta = (
            f"episode {i} &middot; "
            + (f"env {html.escape(row['env'])} &middot; " if row.get("env") else "")
            + f"group {row['group']} &middot; reward {row['reward']:g}"
            f" &middot; advantage {'n/a' if adv is None else f'{adv:+.3f}'} &middot; "
            f"turns {row['num_turns']} &middot; stop {html.escape(row['stop_reason'])}"
        )
        starts = {start: k for k, (start, _) in enumerate(row.get("turn_spans", []))}
        toks = "".join(
            (_turn_label(row, starts[i]) if i in starts else "")
            + f"<span class='{'p' if m else 'e'}' title='{t}'>{html.escape(s)}</span>"
            for i, (t, m, s) in enumerate(
                zip(row["input_ids"], row["action_mask"], row["tokens"], strict=True)
            )
        )
        parts.append(
            f"<div class='ep'><div class='meta'>{meta}</div><div class='toks'>{toks}</div></div>"
        )
    parts.append("</body></html>")
    out = Path(run_dir) / "viewer" / f"{path.stem}.html"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(parts))
    return out


def _turn_label(row: dict, k: int) -> str:
    """``[turn k: step reward, turn reward, advantage]`` before turn ``k``'s first token."""

    def value(key: str) -> str:
        values = row.get(key)
        return "n/a" if not values else f"{values[k]:+.3g}"

    return (
        f"<span class='turn'>[turn {k + 1}: step reward {value('step_rewards')} &middot; "
        f"turn reward {value('turn_rewards')} &middot; advantage "
        f"{value('turn_advantages')}]</span>"
    )
