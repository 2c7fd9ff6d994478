"""The workflow both agent-framework examples run (``agents_sdk.py``, ``langgraph_agents.py``).

Four agents, each with its own instructions, read one ~1,000-token report and the earlier agents'
replies. The report is built from this folder's task files (no network); each task gets a new one.
Nothing here names a layout: the server (``hf-kvshare serve``) finds the shared text itself.

Styles (``--style``):

- ``messages``: the report is a user message of its own, earlier replies are assistant messages, then
  one short user line (a framework's history, as it keeps it);
- ``tool``: the report is a tool's result (a function call and its output in the history), then the
  replies as in ``messages`` (Agents SDK only);
- ``one-message``: ONE user message built with an f-string around the report and the replies (the
  usual hand-written style).

Per agent the table gives the time to the first streamed token (TTFT) and, with ``--reports`` (the
file the server writes its reports to: ``HF_KVSHARE_REPORTS``), what the server says it supplied.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time
import urllib.request
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
#: the project's docs the reports are cut from (their prose; examples/*.jsonl's documents after them)
SOURCES = ("docs/workloads.md", "docs/methods.md", "docs/serving-bench.md", "docs/architecture.md")
#: the packages each framework needs (the ``agents`` extra of hf_kvshare installs them all)
FRAMEWORKS = {
    "agents_sdk": ["agents:openai-agents"],
    "langgraph": ["langgraph:langgraph", "langchain_openai:langchain-openai"],
}
INSTALL = 'pip install "hf_kvshare[agents]"  (or: pip install openai-agents langgraph langchain-openai)'
STYLES = ("messages", "tool", "one-message")

AGENTS = [
    ("analyst", "You are the analyst. List the three most important facts in the report."),
    ("skeptic", "You are the skeptic. Say which claims in the report and the notes need checking."),
    ("planner", "You are the planner. Propose the team's next three steps from the report and notes."),
    ("writer", "You are the writer. Sum up the report and the team's notes in two sentences."),
]
#: the last user line of the ``messages`` / ``tool`` styles
YOUR_TURN = "Your answer:"
#: characters of the report: ~1,000 tokens of the embedded SmolLM2 tokenizer
REPORT_CHARS = 3550


def missing_packages(framework: str) -> list[str]:
    """The PyPI names of ``framework``'s packages that are not importable here."""
    return [
        pypi
        for module, pypi in (entry.split(":") for entry in FRAMEWORKS[framework])
        if importlib.util.find_spec(module) is None
    ]


def paragraphs() -> list[str]:
    """Prose paragraphs of the project's docs (no code, headings, tables or lists), then every given
    document of this folder's task files: the material reports are cut from."""
    found: list[str] = []
    for name in SOURCES:
        lines, fenced = [], False
        for line in [*(ROOT / name).read_text().splitlines(), ""]:
            if line.startswith("```"):
                fenced, lines = not fenced, []
            elif fenced:
                continue
            elif line.strip():
                lines.append(line.strip())
            elif lines:
                if not lines[0].startswith(("#", "|", "-", "*", "<", "!", "[")) and not lines[0][0].isdigit():
                    found.append(" ".join(lines))
                lines = []
    for name in ("observations.jsonl", "repeated_docs.jsonl"):
        for line in (HERE / name).read_text().splitlines():
            for slot in json.loads(line)["slots"]:
                if slot.get("kind") == "observation" and slot["text"] not in found:
                    found.append(slot["text"])
    return found


def make_report(seed: int, chars: int = REPORT_CHARS) -> str:
    """A report of ~``chars`` characters: consecutive paragraphs of :func:`paragraphs`, the ``seed``-th
    window of them (windows do not overlap: the replies to one report do not quote the next), under a
    header that names the report."""
    texts, windows, window = paragraphs(), [], []
    for text in texts:
        window.append(text)
        if sum(len(t) + 1 for t in window) >= chars:
            windows.append(window)
            window = []
    body = "\n".join(windows[seed % len(windows)])
    if len(body) > chars * 1.1:  # a long last paragraph: cut at a sentence's end
        body = body[: body.rfind(". ", 0, int(chars * 1.1)) + 1]
    header = (
        f"Report {seed} ({uuid.uuid5(uuid.NAMESPACE_URL, str(seed)).hex[:8]}): notes from the team's files."
    )
    return f"{header}\n{body}"


def one_message(report: str, replies: list[tuple[str, str]]) -> str:
    """The one-message style: the report and the replies inside ONE user message (an f-string)."""
    notes = "\n\n".join(f"{name} wrote:\n{text}" for name, text in replies)
    return f"Read the report and the team's notes, then answer.\n\nReport:\n{report}\n\nNotes:\n{notes}\n\n{YOUR_TURN}"


def chat_messages(style: str, report: str, replies: list[tuple[str, str]]) -> list[dict]:
    """The conversation an agent sends after its instructions, as chat messages (``messages`` and
    ``one-message`` styles; the Agents SDK's ``tool`` style builds its own items)."""
    if style == "one-message":
        return [{"role": "user", "content": one_message(report, replies)}]
    history = [{"role": "assistant", "content": text} for _, text in replies]
    return [{"role": "user", "content": report}, *history, {"role": "user", "content": YOUR_TURN}]


def served_model(base_url: str) -> str:
    """The server's one model (``GET /v1/models``)."""
    with urllib.request.urlopen(base_url.rstrip("/") + "/models", timeout=30) as response:
        return json.loads(response.read())["data"][0]["id"]


class ServerReports:
    """The reports the server appends to its ``HF_KVSHARE_REPORTS`` file (a streamed reply does not
    carry one): the lines written since :meth:`mark`. Agents run one after another, so they are the
    last agent's."""

    def __init__(self, path: str | None):
        self.path = Path(path) if path else None
        self.seen = 0

    def _lines(self) -> list[str]:
        try:
            return self.path.read_text().splitlines()
        except OSError:
            return []

    def mark(self) -> None:
        if self.path is not None:
            self.seen = len(self._lines())

    def latest(self, wait_s: float = 10.0) -> dict | None:
        """The newest report written since :meth:`mark` (the server writes it once the request is
        recorded, just after the reply): waits up to ``wait_s``; ``None`` without a file."""
        if self.path is None:
            return None
        deadline = time.monotonic() + wait_s
        while True:
            lines = self._lines()
            if len(lines) > self.seen:
                self.seen = len(lines)
                try:
                    return json.loads(lines[-1])
                except ValueError:
                    return None
            if time.monotonic() > deadline:
                return None
            time.sleep(0.2)


@dataclass
class Row:
    task: int
    agent: str
    ttft_s: float | None
    chars: int
    prompt_tokens: int | None = None
    supplied_tokens: int | None = None

    @classmethod
    def of(cls, task: int, agent: str, ttft_s: float | None, text: str, report: dict | None) -> Row:
        report = report or {}
        return cls(task, agent, ttft_s, len(text), report.get("prompt_tokens"), report.get("supplied_tokens"))


def parser(description: str, styles: tuple[str, ...] = STYLES) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description, epilog=f"Needs the framework: {INSTALL}")
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    p.add_argument("--model", default=None, help="the served model's name (default: the server's one model)")
    p.add_argument("--style", choices=styles, default="messages")
    p.add_argument(
        "--tasks", type=int, default=3, help="tasks in a row, a new report each (the first warms up)"
    )
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--seed", type=int, default=None, help="the first report's seed (default: from the clock)")
    p.add_argument(
        "--reports", default=None, help="the server's HF_KVSHARE_REPORTS file: shared tokens per agent"
    )
    p.add_argument("--json", default=None, help="also write the rows to this file")
    return p


def later_agents_median(rows: list[Row]) -> float | None:
    """Median TTFT of agents 2-4 over the tasks after the first (the first warms the agents up)."""
    ttfts = [r.ttft_s for r in rows if r.task > 1 and r.agent != AGENTS[0][0] and r.ttft_s is not None]
    return statistics.median(ttfts) if ttfts else None


def finish(rows: list[Row], args: argparse.Namespace, framework: str) -> int:
    """Print the table (and write ``--json``); 1 when an agent got no streamed reply."""
    print(f"{framework}, style {args.style}")
    print(f"{'task':>4}  {'agent':<8} {'TTFT s':>7} {'prompt':>7} {'shared':>7} {'chars':>6}")
    for r in rows:
        ttft = f"{r.ttft_s:7.3f}" if r.ttft_s is not None else "      -"
        shared = "-" if r.supplied_tokens is None else r.supplied_tokens
        prompt = "-" if r.prompt_tokens is None else r.prompt_tokens
        print(f"{r.task:>4}  {r.agent:<8} {ttft} {prompt:>7} {shared:>7} {r.chars:>6}")
    median = later_agents_median(rows)
    if median is not None:
        print(f"agents 2-{len(AGENTS)} median TTFT (tasks 2-{args.tasks}): {median:.3f} s")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "framework": framework,
                    "style": args.style,
                    "median_s": median,
                    "rows": [asdict(r) for r in rows],
                }
            )
        )
    failed = [f"task {r.task} {r.agent}" for r in rows if r.ttft_s is None or r.chars == 0]
    if failed:
        print("no streamed reply from: " + ", ".join(failed))
        return 1
    return 0
