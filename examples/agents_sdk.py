"""Four OpenAI Agents SDK agents against ``hf-kvshare serve``, sharing without any layout field.

Start the server (the embedded SmolLM2-135M; options after ours go to vLLM)::

    hf-kvshare serve --model smollm2-135m --method fullshared:prefix_reuse=True --dtype float32 \\
        --enforce-eager --port 8000

then ``python examples/agents_sdk.py --base-url http://127.0.0.1:8000/v1``. Each agent is an
``agents.Agent`` with its own instructions on the Chat Completions model (``/v1/responses`` gets exact
K/V only: README, "What is shared with whom"); it reads the report and the earlier agents' replies
(``--style``: as messages, as a tool result, or in one f-string message; examples/agent_workflow.py)
and is run with ``Runner.run_streamed``: TTFT is the first text delta. The first task warms the agents
up (an agent's own instructions are placed from its earlier requests: ``prefix_reuse``).
"""

from __future__ import annotations

import asyncio
import sys
import time

from agent_workflow import (
    AGENTS,
    INSTALL,
    YOUR_TURN,
    Row,
    ServerReports,
    chat_messages,
    finish,
    make_report,
    missing_packages,
    parser,
    served_model,
)


def agent_input(style: str, report: str, replies: list[tuple[str, str]]) -> list[dict]:
    """The agent's input items: chat messages, or (``tool``) the report as a function call's output."""
    if style != "tool":
        return chat_messages(style, report, replies)
    call = {"type": "function_call", "call_id": "call_report", "name": "read_report", "arguments": "{}"}
    history = [{"role": "assistant", "content": text} for _, text in replies]
    output = {"type": "function_call_output", "call_id": "call_report", "output": report}
    return [call, output, *history, {"role": "user", "content": YOUR_TURN}]


async def run_task(task: int, report: str, args, model, reports: ServerReports) -> list[Row]:
    from agents import Agent, ModelSettings, Runner
    from openai.types.responses import ResponseTextDeltaEvent

    settings = ModelSettings(temperature=0, max_tokens=args.max_tokens)
    replies: list[tuple[str, str]] = []
    rows = []
    for name, instructions in AGENTS:
        agent = Agent(name=name, instructions=instructions, model=model, model_settings=settings)
        reports.mark()
        start, ttft = time.perf_counter(), None
        result = Runner.run_streamed(agent, input=agent_input(args.style, report, replies), max_turns=1)
        async for event in result.stream_events():
            if event.type == "raw_response_event" and isinstance(event.data, ResponseTextDeltaEvent):
                if event.data.delta and ttft is None:
                    ttft = time.perf_counter() - start
        text = str(result.final_output or "")
        replies.append((name, text))
        rows.append(Row.of(task, name, ttft, text, reports.latest()))
    return rows


async def run(args) -> list[Row]:
    from agents import OpenAIChatCompletionsModel, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)  # no traces sent to OpenAI
    client = AsyncOpenAI(base_url=args.base_url, api_key="unused", timeout=600, max_retries=0)
    model = OpenAIChatCompletionsModel(model=args.model or served_model(args.base_url), openai_client=client)
    reports = ServerReports(args.reports)
    seed = args.seed if args.seed is not None else time.time_ns() % 1_000_000
    rows: list[Row] = []
    for task in range(1, args.tasks + 1):
        rows += await run_task(task, make_report(seed + task), args, model, reports)
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parser(__doc__.splitlines()[0]).parse_args(argv)
    missing = missing_packages("agents_sdk")
    if missing:
        print(f"examples/agents_sdk.py needs {', '.join(missing)}: {INSTALL}", file=sys.stderr)
        return 2
    try:
        rows = asyncio.run(run(args))
    except Exception as error:  # a server that is not there, a refused request: say so, exit non-zero
        print(f"failed: {type(error).__name__}: {error}", file=sys.stderr)
        return 1
    return finish(rows, args, "OpenAI Agents SDK")


if __name__ == "__main__":
    sys.exit(main())
