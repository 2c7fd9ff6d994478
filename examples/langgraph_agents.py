"""Four LangGraph agents against ``hf-kvshare serve``, sharing without any layout field.

Start the server (the embedded SmolLM2-135M; options after ours go to vLLM)::

    hf-kvshare serve --model smollm2-135m --method fullshared:prefix_reuse=True --dtype float32 \\
        --enforce-eager --port 8000

then ``python examples/langgraph_agents.py --base-url http://127.0.0.1:8000/v1``. A ``StateGraph``
over ``MessagesState`` chains four nodes, each an agent with its own system prompt calling
``langchain_openai.ChatOpenAI`` (Chat Completions, streamed). The state starts with the report as a
human message and collects each agent's reply as an AI message (``--style messages``), or each node
writes the report and the replies into one f-string message (``--style one-message``;
examples/agent_workflow.py). TTFT is the node's first streamed token (``stream_mode="messages"``).
The first task warms the agents up (``prefix_reuse``: an agent's own prompt comes from its earlier requests).
"""

from __future__ import annotations

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

STYLES = ("messages", "one-message")


def build_graph(llm, style: str, report: str, starts: dict, reports: ServerReports, served: dict):
    """The four agents as a chain of graph nodes; ``starts`` / ``served`` collect each node's request
    start and the server's report."""
    from langchain_core.messages import HumanMessage, SystemMessage, convert_to_messages
    from langgraph.graph import END, START, MessagesState, StateGraph

    def node(name: str, instructions: str):
        def call(state: MessagesState) -> dict:
            if style == "messages":  # the graph's history as it is: the report, then the replies
                conversation = [*state["messages"], HumanMessage(YOUR_TURN)]
            else:
                replies = [(m.name, m.content) for m in state["messages"] if m.type == "ai"]
                conversation = convert_to_messages(chat_messages(style, report, replies))
            messages = [SystemMessage(instructions), *conversation]
            reports.mark()
            starts[name] = time.perf_counter()
            reply = llm.invoke(messages)
            reply.name = name
            served[name] = reports.latest()
            return {"messages": [reply]}

        return call

    graph = StateGraph(MessagesState)
    previous = START
    for name, instructions in AGENTS:
        graph.add_node(name, node(name, instructions))
        graph.add_edge(previous, name)
        previous = name
    graph.add_edge(previous, END)
    return graph.compile()


def run_task(task: int, report: str, args, llm, reports: ServerReports) -> list[Row]:
    from langchain_core.messages import AIMessageChunk, HumanMessage

    starts: dict[str, float] = {}
    served: dict[str, dict | None] = {}
    ttfts: dict[str, float] = {}
    graph = build_graph(llm, args.style, report, starts, reports, served)
    state = {"messages": [HumanMessage(report)]} if args.style == "messages" else {"messages": []}
    final = None
    for mode, payload in graph.stream(state, stream_mode=["messages", "values"]):
        if mode == "values":
            final = payload
            continue
        chunk, metadata = payload
        node = metadata.get("langgraph_node")
        if isinstance(chunk, AIMessageChunk) and chunk.content and node in starts and node not in ttfts:
            ttfts[node] = time.perf_counter() - starts[node]
    texts = {m.name: str(m.content) for m in final["messages"] if m.type == "ai"}
    return [Row.of(task, name, ttfts.get(name), texts.get(name, ""), served.get(name)) for name, _ in AGENTS]


def main(argv: list[str] | None = None) -> int:
    args = parser(__doc__.splitlines()[0], styles=STYLES).parse_args(argv)
    missing = missing_packages("langgraph")
    if missing:
        print(f"examples/langgraph_agents.py needs {', '.join(missing)}: {INSTALL}", file=sys.stderr)
        return 2
    try:
        from langchain_openai import ChatOpenAI

        model = args.model or served_model(args.base_url)
        llm = ChatOpenAI(
            model=model,
            base_url=args.base_url,
            api_key="unused",
            temperature=0,
            max_tokens=args.max_tokens,
            streaming=True,
            max_retries=0,
            timeout=600,
        )
        reports = ServerReports(args.reports)
        seed = args.seed if args.seed is not None else time.time_ns() % 1_000_000
        rows: list[Row] = []
        for task in range(1, args.tasks + 1):
            rows += run_task(task, make_report(seed + task), args, llm, reports)
    except Exception as error:  # a server that is not there, a refused request: say so, exit non-zero
        print(f"failed: {type(error).__name__}: {error}", file=sys.stderr)
        return 1
    return finish(rows, args, "LangGraph")


if __name__ == "__main__":
    sys.exit(main())
