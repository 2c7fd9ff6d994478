"""PReCache study: multi-LoRA plan -> act -> reflect agents sharing one trajectory cache.

    python -m hf_kvshare.bench.studies.precache --adapters runs/adapters --out docs/results

On the embedded SmolLM2-135M with trained role adapters (:mod:`hf_kvshare.lora.train_roles`;
trained first when ``--adapters`` holds none), one AutoAct-style episode
(:mod:`hf_kvshare.lora.autoact`) runs with every method **in lockstep** (turn ``t`` of every
method, then turn ``t + 1``), so each TTFT/E2E ratio compares measurements taken seconds apart on
a shared, noisy machine:

1. *free-running*: each method generates exactly ``--new-tokens`` tokens per turn (EOS
   suppressed, so every method's trajectory has the same length); the environment answers with
   the gold observation. TTFT, E2E, exact KV bytes, role-format adherence.
2. *teacher-forced* on NonShared's outputs: top-1 agreement and KL to NonShared; relative error
   of each method's shared base cache against the base cache the current agent builds from its
   own hidden states (``rope(W x_b + b)``), per layer and per transition (the PReCache paper's
   Figure 2); and of each method's full K/V against NonShared's.

Writes ``<out>/precache.md``, ``<out>/precache/*.png`` and ``<out>/precache/precache.json``.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from ...fidelity import kv_error_by_layer, mean_kl, relative_error, top1_agreement
from ...lora import AbsoluteRope, KVCapture, LoraBank
from ...lora.view import to_heads
from ...methods import METHODS
from ...session import Session
from ..workloads.autoact_world import ROLES, Episode, GoldTurn, World, gold_turns

FREE_METHODS = [
    "nonshared",
    "fullshared",
    "baseshared",
    "prelrshared",
    "prelrshared-lazy",
    "rebaseshared-lp",
    "rebaseshared-db",
]
FORCED_METHODS = [
    "nonshared",
    "fullshared",
    "baseshared",
    "prelrshared",
    "rebaseshared-lp",
    "rebaseshared-db",
]
BASE_ERROR_METHODS = ["baseshared", "prelrshared", "rebaseshared-lp"]
ROLE_FORMAT = {
    "plan": re.compile(r"^\s*Thought:"),
    "act": re.compile(r"Action:\s*Lookup\[[^\]]+\]"),
    "reflect": re.compile(r"^\s*Reflection:"),
}


#: tokens each role generates in the free-running pass (EOS suppressed: equal lengths for all methods)
NEW_TOKENS = {"plan": 24, "act": 10, "reflect": 32}


@dataclass
class StudyConfig:
    hops: int = 4  # capitals compared: 2 lookups each (20 turns, a 2K-token trajectory with filler=4)
    filler: int = 4  # extra sentences per observation page
    new_tokens: dict[str, int] = field(default_factory=lambda: dict(NEW_TOKENS))
    seed: int = 0
    free_methods: list[str] = field(default_factory=lambda: list(FREE_METHODS))
    forced_methods: list[str] = field(default_factory=lambda: list(FORCED_METHODS))


def make_method(label: str):
    """A method instance from a study label (``<registry name>`` or ``<name>-lazy``)."""
    if label.endswith("-lazy"):
        return METHODS[label[: -len("-lazy")]](materialize="lazy")
    return METHODS[label]()


def workload(config: StudyConfig) -> tuple[World, list[GoldTurn], str]:
    import random

    world = World.generate(seed=config.seed, filler=config.filler)
    question = world.question("compare", config.hops, random.Random(config.seed))
    return world, gold_turns(world, question), question.text


# ------------------------------------------------------------------ free-running pass
def run_free(
    model, tokenizer, config: StudyConfig, turns: list[GoldTurn], progress: bool = True
) -> dict[str, Any]:
    sessions = {m: Session(model, tokenizer, make_method(m)) for m in config.free_methods}
    episodes = {m: Episode() for m in config.free_methods}
    rows: dict[str, list[dict[str, Any]]] = {m: [] for m in config.free_methods}
    for i, gold in enumerate(tqdm(turns, desc="free-running turns", disable=not progress)):
        for m, session in sessions.items():
            r = session.run_turn(
                gold.agent,
                episodes[m].segments(gold.instruction),
                max_new_tokens=config.new_tokens[gold.agent],
                min_new_tokens=config.new_tokens[gold.agent],
                keep_cache=True,
            )
            episodes[m].add(r.output_slot)
            rows[m].append(
                {
                    "turn": i,
                    "agent": gold.agent,
                    "prompt_tokens": int(r.prompt_ids.numel()),
                    "ttft_s": r.ttft_s,
                    "e2e_s": r.e2e_s,
                    "tokens_prefilled": r.tokens_prefilled,
                    "reuse_ratio": r.reuse_ratio,
                    "turn_kv_bytes": r.cache.nbytes,
                    "peak_rss_bytes": r.peak_memory_bytes,
                    "output": r.text,
                    "role_format": bool(ROLE_FORMAT[gold.agent].search(r.text)),
                }
            )
            r.cache = None
    baseline = (
        _adapter_free_outputs(model, tokenizer, config, turns, sessions["nonshared"])
        if "nonshared" in sessions
        else []
    )
    state = {}
    for m, session in sessions.items():
        method = session.method
        if hasattr(method, "session_memory"):
            state[m] = method.session_memory(session)
        else:  # fullshared keeps every slot's latest K/V; nonshared keeps nothing (it recomputes)
            kept = sum(s.latest.nbytes for s in session.slots.values() if s.latest is not None)
            state[m] = {"total_bytes": kept}
    return {
        "rows": rows,
        "state": state,
        "outputs": {m: [t.output_ids.tolist() for t in s.turns] for m, s in sessions.items()},
        "adapter_free": baseline,
    }


def _adapter_free_outputs(model, tokenizer, config, turns, session, count: int = 6) -> list[dict[str, Any]]:
    """The first ``count`` NonShared prompts answered by the model with its adapters disabled: does the
    role format come from the adapters?"""
    out = []
    for gold, result in zip(turns[:count], session.turns):
        ids = result.prompt_ids[None].to(next(model.parameters()).device)
        n = config.new_tokens[gold.agent]
        with torch.no_grad(), model.disable_adapter():
            generated = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
            )
        text = tokenizer.decode(generated[0, ids.shape[1] :], skip_special_tokens=True)
        out.append(
            {"agent": gold.agent, "output": text, "role_format": bool(ROLE_FORMAT[gold.agent].search(text))}
        )
    return out


# ------------------------------------------------------------------ teacher-forced pass
def _base_error(store, ref_keys, ref_values, n: int) -> list[dict[str, float]]:
    rows = []
    for layer in range(len(ref_keys)):
        k, v = store.base(layer, 0, n)
        rows.append(
            {
                "layer": layer,
                "key": relative_error(k, ref_keys[layer][..., :n, :]),
                "value": relative_error(v, ref_values[layer][..., :n, :]),
            }
        )
    return rows


def run_forced(
    model,
    tokenizer,
    config: StudyConfig,
    turns: list[GoldTurn],
    forced: list[list[int]],
    progress: bool = True,
) -> dict[str, Any]:
    methods = [m for m in config.forced_methods if m != "nonshared"]
    reference = Session(model, tokenizer, "nonshared")
    sessions = {m: Session(model, tokenizer, make_method(m)) for m in methods}
    episodes = {m: Episode() for m in ["nonshared", *methods]}
    bank, rope = LoraBank(model), AbsoluteRope(model)
    per_turn: dict[str, list[dict[str, Any]]] = {m: [] for m in methods}
    for i, gold in enumerate(tqdm(turns, desc="teacher-forced turns", disable=not progress)):
        segments = episodes["nonshared"].segments(gold.instruction)
        with KVCapture(bank, base=True) as capture:  # the agent's own base cache, rope(W x_b + b)
            ref = reference.run_turn(gold.agent, segments, force_output=forced[i], keep_cache=True)
        episodes["nonshared"].add(ref.output_slot)
        P = ref.prompt_ids.numel()
        context = ref.segments[-1].start if len(ref.segments) > 1 else 0  # before the new instruction
        weight = next(model.parameters())
        cos, sin = rope.cos_sin(0, P - 1, weight.dtype, weight.device)
        ref_keys, ref_values = [], []
        for layer in range(bank.num_layers):
            k = to_heads(capture.base(layer, "key")[:1, : P - 1], bank.head_dim)
            ref_keys.append(AbsoluteRope.apply(k, cos, sin))
            ref_values.append(to_heads(capture.base(layer, "value")[:1, : P - 1], bank.head_dim))
        del capture
        for m, session in sessions.items():
            row: dict[str, Any] = {"turn": i, "agent": gold.agent, "context_tokens": context}
            store = getattr(session.method, "store", None)
            if store is not None and m in BASE_ERROR_METHODS and i > 0:
                s = store(session)
                n = min(s.common_prefix(ref.prompt_ids), context)
                if n > 0:
                    row["base_error"] = _base_error(s, ref_keys, ref_values, n)
            r = session.run_turn(
                gold.agent, episodes[m].segments(gold.instruction), force_output=forced[i], keep_cache=True
            )
            episodes[m].add(r.output_slot)
            row["agreement"] = top1_agreement(ref.logits, r.logits)
            row["kl"] = mean_kl(ref.logits, r.logits)
            if context > 0:
                row["kv_error"] = kv_error_by_layer(_FirstRow(r.cache), ref.cache, 0, context)
            per_turn[m].append(row)
            r.cache = None
        ref.cache = None
    return {"per_turn": per_turn}


class _FirstRow:
    """Row 0 of a (double-batched) cache, as ``kv_error_by_layer`` reads it."""

    def __init__(self, cache):
        self.cache, self.num_layers = cache, cache.num_layers

    def layer_kv(self, layer: int):
        k, v = self.cache.layer_kv(layer)
        return k[:1], v[:1]


# ------------------------------------------------------------------ summary
def summarize(free: dict[str, Any], forced: dict[str, Any], config: StudyConfig) -> dict[str, Any]:
    rows = free["rows"]
    ref = rows["nonshared"]
    summary = {}
    for m, turns in rows.items():
        later = [i for i in range(1, len(turns))]  # turn 0 is the same dense prefill for every method
        ttft_ratio = [ref[i]["ttft_s"] / turns[i]["ttft_s"] for i in later]
        out = {
            "ttft_ratio_mean": statistics.mean(ttft_ratio),
            "ttft_ratio_last": ttft_ratio[-1],
            "ttft_ratio_total": sum(ref[i]["ttft_s"] for i in later) / sum(turns[i]["ttft_s"] for i in later),
            "e2e_ratio_total": sum(ref[i]["e2e_s"] for i in later) / sum(turns[i]["e2e_s"] for i in later),
            "tokens_prefilled": sum(t["tokens_prefilled"] for t in turns),
            "reuse_ratio_mean": statistics.mean(turns[i]["reuse_ratio"] for i in later),
            "last_turn_kv_bytes": turns[-1]["turn_kv_bytes"],
            "state_kv_bytes": free["state"][m]["total_bytes"],
            "peak_rss_bytes": max(t["peak_rss_bytes"] for t in turns),
            "role_format": statistics.mean(float(t["role_format"]) for t in turns),
            "same_outputs_as_nonshared": statistics.mean(
                float(a == b) for a, b in zip(free["outputs"][m], free["outputs"]["nonshared"])
            ),
        }
        fidelity = forced["per_turn"].get(m)  # a "-lazy" variant reads the same caches (tested equal)
        if fidelity:
            out["agreement_mean"] = statistics.mean(r["agreement"] for r in fidelity)
            out["kl_mean"] = statistics.mean(r["kl"] for r in fidelity)
            errs = [r for r in fidelity if "base_error" in r]
            if errs:
                out["base_key_error_mean"] = statistics.mean(
                    statistics.mean(x["key"] for x in r["base_error"]) for r in errs
                )
                out["base_key_error_last_layer"] = statistics.mean(r["base_error"][-1]["key"] for r in errs)
                out["base_value_error_mean"] = statistics.mean(
                    statistics.mean(x["value"] for x in r["base_error"]) for r in errs
                )
            kv = [r for r in fidelity if "kv_error" in r]
            if kv:
                out["kv_key_error_mean"] = statistics.mean(
                    statistics.mean(x["key"] for x in r["kv_error"]) for r in kv
                )
        elif m == "nonshared":
            out.update(agreement_mean=1.0, kl_mean=0.0)
        summary[m] = out
    return summary


# ------------------------------------------------------------------ plots and report
def plot(data: dict[str, Any], out_dir: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    rows = data["free"]["rows"]
    ref = rows["nonshared"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for m, turns in rows.items():
        if m == "nonshared":
            continue
        x = [t["prompt_tokens"] for t in turns[1:]]
        axes[0].plot(
            x, [r["ttft_s"] / t["ttft_s"] for r, t in zip(ref[1:], turns[1:])], marker="o", ms=3, label=m
        )
        axes[1].plot(
            x, [r["e2e_s"] / t["e2e_s"] for r, t in zip(ref[1:], turns[1:])], marker="o", ms=3, label=m
        )
    for ax, what in zip(axes, ("TTFT", "E2E")):
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xlabel("prompt tokens (shared trajectory + instruction)")
        ax.set_ylabel(f"{what} speed-up vs NonShared (x)")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_dir / "ttft_e2e_ratio.png", dpi=110)
    plt.close(fig)
    files.append("ttft_e2e_ratio.png")

    per_turn = data["forced"]["per_turn"]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4))
    for m in BASE_ERROR_METHODS:
        errs = [r for r in per_turn.get(m, []) if "base_error" in r]
        if not errs:
            continue
        layers = len(errs[0]["base_error"])
        mean = [statistics.mean(r["base_error"][layer]["key"] for r in errs) for layer in range(layers)]
        style = {"marker": "o", "ms": 3, "label": m, "ls": ":" if m == "baseshared" else "-"}
        axes[0].plot(range(layers), mean, **style)
        axes[1].plot([r["turn"] for r in errs], [r["base_error"][-1]["key"] for r in errs], **style)
    for m in ("fullshared", "prelrshared", "rebaseshared-lp"):
        kv = [r for r in per_turn.get(m, []) if "kv_error" in r]
        if kv:
            layers = len(kv[0]["kv_error"])
            axes[2].plot(
                range(layers),
                [statistics.mean(r["kv_error"][layer]["key"] for r in kv) for layer in range(layers)],
                marker="o",
                ms=3,
                ls="--" if m == "fullshared" else "-",
                label=m,
            )
    axes[0].set_title("shared base keys vs the agent's own base (mean over transitions)", fontsize=9)
    axes[1].set_title("same, last layer, per agent transition", fontsize=9)
    axes[2].set_title("keys attention reads vs NonShared's (mean over transitions)", fontsize=9)
    axes[0].set_xlabel("layer")
    axes[1].set_xlabel("turn")
    axes[2].set_xlabel("layer")
    axes[1].xaxis.get_major_locator().set_params(integer=True)
    for ax in axes:
        ax.set_ylabel("relative error ||K - K_ref|| / ||K_ref||")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_dir / "base_cache_error.png", dpi=110)
    plt.close(fig)
    files.append("base_cache_error.png")
    return files


def _training_line(data: dict[str, Any]) -> str:
    training = data.get("adapters_training")
    if not training:
        return ""
    losses = ", ".join(f"{r} {v[0]:.2f} -> {v[-1]:.3f}" for r, v in training["loss"].items())
    how = f" by `{training['command']}`" if training.get("command") else ""
    return (
        f" Trained{how} in {training['train_seconds']:.0f} s on this machine; training loss (first -> last step): "
        f"{losses}."
    )


def _mb(n: float) -> str:
    return f"{n / 2**20:.1f}"


def findings(data: dict[str, Any]) -> list[str]:
    """What the numbers say, computed from them (each line names the figures it rests on)."""
    s, rows, per_turn = data["summary"], data["free"]["rows"], data["forced"]["per_turn"]
    ref = rows["nonshared"]
    out = []
    L, t_ref = ref[-1]["prompt_tokens"], ref[-1]["ttft_s"]
    speed = ", ".join(f"{m} {s[m]['ttft_ratio_last']:.1f}x" for m in s if m != "nonshared")
    out.append(
        f"**TTFT.** At the longest prompt ({L} tokens) NonShared needs {t_ref:.1f} s to the first token; speed-ups: {speed}."
    )
    e2e = ", ".join(f"{m} {s[m]['e2e_ratio_total']:.2f}x" for m in s if m != "nonshared")
    out.append(f"**E2E** (whole turns, total over turns 1..): {e2e}.")
    prelr = {r["turn"]: r for r in per_turn.get("prelrshared", []) if "base_error" in r}
    rebase = {r["turn"]: r for r in per_turn.get("rebaseshared-lp", []) if "base_error" in r}
    both = sorted(set(prelr) & set(rebase))
    if both:

        def mean_key(r):
            return statistics.mean(x["key"] for x in r["base_error"])

        closer = sum(mean_key(rebase[t]) < mean_key(prelr[t]) for t in both)
        closer_last = sum(
            rebase[t]["base_error"][-1]["key"] < prelr[t]["base_error"][-1]["key"] for t in both
        )
        out.append(
            f"**Neutral base (paper Fig. 2).** ReBaseShared's neutral base keys are closer to the current agent's own "
            f"base keys than PreLRShared's shared base at {closer} of {len(both)} agent transitions (mean over layers; "
            f"{closer_last} of {len(both)} at the last layer): mean key error "
            f"{s['rebaseshared-lp']['base_key_error_mean']:.3f} vs {s['prelrshared']['base_key_error_mean']:.3f}, "
            f"values {s['rebaseshared-lp']['base_value_error_mean']:.3f} vs {s['prelrshared']['base_value_error_mean']:.3f}. "
            f"BaseShared's base is PreLRShared's (both keep the base of whichever agent first processed a token)."
        )
    if "kv_key_error_mean" in s.get("fullshared", {}):
        kv = ", ".join(f"{m} {s[m]['kv_key_error_mean']:.3f}" for m in s if "kv_key_error_mean" in s[m])
        out.append(
            f"**Keys attention reads** vs NonShared's over the shared context (mean relative error): {kv}."
        )
    agree = ", ".join(
        f"{m} {s[m]['agreement_mean']:.3f} (KL {s[m]['kl_mean']:.3f})"
        for m in s
        if m != "nonshared" and "kl_mean" in s[m]
    )
    out.append(f"**Teacher-forced agreement with NonShared** (top-1; KL): {agree}.")
    if "rebaseshared-db" in s and "rebaseshared-lp" in s and "agreement_mean" in s["rebaseshared-db"]:
        out.append(
            "**LP vs DB.** Same caches, hence the same fidelity (agreement "
            f"{s['rebaseshared-lp']['agreement_mean']:.3f} vs {s['rebaseshared-db']['agreement_mean']:.3f}); they "
            f"differ in cost: DB's TTFT speed-up {s['rebaseshared-db']['ttft_ratio_mean']:.2f}x vs LP's "
            f"{s['rebaseshared-lp']['ttft_ratio_mean']:.2f}x (mean), E2E {s['rebaseshared-db']['e2e_ratio_total']:.2f}x vs "
            f"{s['rebaseshared-lp']['e2e_ratio_total']:.2f}x. On a CPU the second row costs as much as the first; DB "
            "pays off where a batch row is nearly free (GPU serving), LP where the stream is single (this machine)."
        )
    if "prelrshared-lazy" in s and "prelrshared" in s:
        turn_, lazy = s["prelrshared"], s["prelrshared-lazy"]
        faster = "lazy" if lazy["e2e_ratio_total"] > turn_["e2e_ratio_total"] else "turn"
        out.append(
            "**Materializing once per turn vs lazily per layer** (prelrshared): TTFT speed-up "
            f"{turn_['ttft_ratio_mean']:.2f}x (turn) vs {lazy['ttft_ratio_mean']:.2f}x (lazy), E2E {turn_['e2e_ratio_total']:.2f}x "
            f"vs {lazy['e2e_ratio_total']:.2f}x; the turn's own K/V {_mb(turn_['last_turn_kv_bytes'])} MiB vs "
            f"{_mb(lazy['last_turn_kv_bytes'])} MiB at the last turn. Faster here: **{faster}**; lazy trades "
            "an extra B(Ax) matmul per layer and step for not holding a full-size copy of the prefix."
        )
    pre = data["free"]["state"].get("prelrshared")
    if pre:
        lr = sum(pre["lr_bytes"].values())
        full = ref[-1]["turn_kv_bytes"]
        out.append(
            f"**Memory.** PReCache keeps {_mb(pre['total_bytes'])} MiB for the {pre['tokens']}-token trajectory: the "
            f"base once ({_mb(pre['base_bytes'])} MiB) + {len(pre['lr_bytes'])} LR caches ({_mb(lr)} MiB, "
            f"{100 * lr / pre['base_bytes']:.0f}% of the base), against {len(pre['lr_bytes'])} x {_mb(full)} MiB for "
            "one full cache per agent."
        )
    formats = ", ".join(f"{m} {s[m]['role_format']:.2f}" for m in s)
    base = data["free"].get("adapter_free") or []
    without = (
        f"; the same model with its adapters disabled, on NonShared's first {len(base)} prompts: "
        f"{sum(b['role_format'] for b in base)} of {len(base)}"
        if base
        else ""
    )
    out.append(f"**Role adapters specialize**: share of outputs in their role's format: {formats}{without}.")
    return out


def report(data: dict[str, Any], command: str) -> str:
    s = data["summary"]
    cfg = data["config"]
    rows = data["free"]["rows"]
    L = rows["nonshared"][-1]["prompt_tokens"]
    lines = [
        "# PReCache on the embedded model: plan -> act -> reflect agents with trained LoRA roles",
        "",
        "Every number and figure on this page comes from one run of:",
        "",
        "```",
        command,
        "```",
        "",
        f"(wall time {data['wall_s']:.0f} s; {data['threads']} torch threads; data in `precache/precache.json`).",
        "",
        "## Setup",
        "",
        f"- Model: SmolLM2-135M-Instruct (fp32, CPU) wrapped with the role adapters `{', '.join(ROLES)}` "
        f"({data['adapters']}).{_training_line(data)}",
        f"- Workload: one AutoAct-style episode (`hf_kvshare.lora.autoact`): question *{data['question']}*; "
        f"{len(rows['nonshared'])} turns ({', '.join(t['agent'] for t in rows['nonshared'])}); the tool's "
        f"observations are the gold pages ({cfg['filler']} filler sentences each). The last prompt holds "
        f"**{L} tokens**.",
        f"- Free-running: every method generates exactly {cfg['new_tokens']} tokens per role (EOS suppressed) so "
        "all trajectories have the same length; methods run in lockstep (turn t of every method, then t + 1), "
        "so each ratio compares times taken seconds apart. Ratios exclude turn 0 (a dense prefill for all).",
        "- Teacher-forced: every method is fed NonShared's outputs; agreement = top-1 agreement of the next-token "
        "prediction with NonShared; KL = mean KL(NonShared || method).",
        "- Base-cache error (paper Fig. 2): at each agent transition, the relative error "
        "`||K_shared - K_own|| / ||K_own||` of the method's stored base keys over the shared context against "
        "`rope(W x_b + b)`, the base keys the current agent b computes from its own adapted hidden states.",
        "",
        "## Summary",
        "",
        "| method | TTFT speed-up (mean / last turn) | E2E speed-up | prefilled tokens | rho | "
        "KV state kept (MiB) | last turn's own KV (MiB) | peak KV (MiB) | agreement | KL | "
        "base key error (mean / last layer) | role format |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for m, x in s.items():
        base = (
            f"{x['base_key_error_mean']:.3f} / {x['base_key_error_last_layer']:.3f}"
            if "base_key_error_mean" in x
            else "-"
        )
        agreement = f"{x['agreement_mean']:.3f}" if "agreement_mean" in x else "(= prelrshared)"
        kl = f"{x['kl_mean']:.3f}" if "kl_mean" in x else "-"
        lines.append(
            f"| {m} | {x['ttft_ratio_mean']:.2f}x / {x['ttft_ratio_last']:.2f}x | {x['e2e_ratio_total']:.2f}x | "
            f"{x['tokens_prefilled']} | {x['reuse_ratio_mean']:.2f} | {_mb(x['state_kv_bytes'])} | "
            f"{_mb(x['last_turn_kv_bytes'])} | {_mb(x['state_kv_bytes'] + x['last_turn_kv_bytes'])} | "
            f"{agreement} | {kl} | {base} | {x['role_format']:.2f} |"
        )
    n_agents = len(ROLES)
    full = rows["nonshared"][-1]["turn_kv_bytes"]
    lines += [
        "",
        "Columns: *TTFT speed-up* = NonShared TTFT / method TTFT per turn (mean over turns 1.., and at the "
        "longest prompt); *E2E speed-up* = total NonShared E2E / total method E2E; *rho* = PH tokens reused / "
        "PH tokens; *KV state kept* = exact bytes a method holds across turns at the end (PReCache: base once "
        "+ every agent's LR cache; FullShared: every slot's latest K/V; NonShared keeps nothing and recomputes, "
        f"and would need {n_agents} x {_mb(full)} = {_mb(n_agents * full)} MiB to keep one cache per agent); "
        "*last turn's own KV* = bytes of the turn's cache object (PReCache with `materialize='turn'` holds a "
        "full copy for the turn, `-lazy` only the appended positions); *peak KV* = the two together, the K/V "
        "memory alive at the end of the last turn; *role format* = fraction of outputs in "
        "their role's format (`Thought:`, `Action: Lookup[...]`, `Reflection:`).",
        "",
        f"Peak process RSS over the run: {_mb(max(x['peak_rss_bytes'] for x in s.values()))} MiB (model, all "
        "methods' sessions alive in lockstep; per-method RSS is not separable here, hence the exact KV bytes).",
        "",
        "![TTFT and E2E speed-up vs NonShared](precache/ttft_e2e_ratio.png)",
        "",
        "![Base-cache error vs the current agent's own base cache](precache/base_cache_error.png)",
        "",
        "## Per-turn TTFT (s) and prompt length",
        "",
        "| turn | agent | prompt tokens | " + " | ".join(rows) + " |",
        "|---|---|---|" + "---|" * len(rows),
    ]
    for i, t in enumerate(rows["nonshared"]):
        lines.append(
            f"| {i} | {t['agent']} | {t['prompt_tokens']} | "
            + " | ".join(f"{rows[m][i]['ttft_s']:.2f}" for m in rows)
            + " |"
        )
    lines += ["", "## Findings (computed from the data above)", ""]
    lines += [f"- {line}" for line in findings(data)]
    lines += ["", "## Reproduce", "", "```"]
    study = data.get("command", "python -m hf_kvshare.bench.studies.precache")
    match = re.search(r"--adapters\s+(\S+)", study)
    training = (data.get("adapters_training") or {}).get("command") or (
        f"python -m hf_kvshare.lora.train_roles --out {match.group(1) if match else 'runs/adapters'} --threads 1"
    )
    out_match = re.search(r"--out\s+(\S+)", study)
    out_dir = out_match.group(1) if out_match else "docs/results"
    lines += [
        f"{training}   # the role adapters (the study trains them itself when missing)",
        study,
        f"python -m hf_kvshare.bench.studies.precache --from-json {out_dir}/precache/precache.json --out {out_dir}"
        "   # re-render this page only",
        "```",
    ]
    lines += ["", "## Sample outputs (NonShared, free-running)", ""]
    for t in rows["nonshared"][:5]:
        lines.append(f"- **{t['agent']}**: `{t['output'].strip()}`")
    if data["free"].get("adapter_free"):
        lines += ["", "The same prompts with the adapters disabled (base SmolLM2-135M-Instruct):", ""]
        for t in data["free"]["adapter_free"][:5]:
            lines.append(f"- **{t['agent']}**: `{t['output'].strip()}`")
    lines.append("")
    return "\n".join(lines)


# ------------------------------------------------------------------ entry point
def run_study(
    model, tokenizer, config: StudyConfig, progress: bool = True, adapters: str = "given adapters"
) -> dict[str, Any]:
    """Both passes on ``model`` (a ``PeftModel`` with adapters named plan/act/reflect); returns all data."""
    _, turns, question = workload(config)
    t0 = time.perf_counter()
    free = run_free(model, tokenizer, config, turns, progress)
    forced = run_forced(model, tokenizer, config, turns, free["outputs"]["nonshared"], progress)
    data = {
        "config": asdict(config),
        "adapters": adapters,
        "question": question,
        "threads": torch.get_num_threads(),
        "free": free,
        "forced": forced,
    }
    data["summary"] = summarize(free, forced, config)
    data["wall_s"] = time.perf_counter() - t0
    return data


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="python -m hf_kvshare.bench.studies.precache", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--adapters", default="runs/adapters", help="role adapters (trained there first if missing)"
    )
    parser.add_argument("--out", default="docs/results", help="writes <out>/precache.md and <out>/precache/")
    parser.add_argument(
        "--hops", type=int, default=StudyConfig.hops, help="capitals compared (2 lookups each)"
    )
    parser.add_argument(
        "--filler", type=int, default=StudyConfig.filler, help="extra sentences per observation"
    )
    parser.add_argument(
        "--new-tokens",
        type=float,
        default=1.0,
        help="scales the tokens each role generates " + str(NEW_TOKENS),
    )
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a short episode (~1K tokens, --hops 2 --filler 2) for a smoke run",
    )
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument(
        "--from-json", default=None, help="re-render the report and plots from a saved precache.json (no run)"
    )
    args = parser.parse_args(argv)
    out = Path(args.out)
    adapters = Path(args.adapters)
    if args.from_json:
        data = json.loads(Path(args.from_json).read_text())
        _attach_training(data, adapters)
        write(data, out)
        return 0
    if args.threads:
        torch.set_num_threads(args.threads)
    from ...models import load_model
    from ..train_roles import load_role_adapters, train_roles

    if not all((adapters / r / "adapter_config.json").exists() for r in ROLES):
        print(
            f"no role adapters in {adapters}: training them (python -m hf_kvshare.lora.train_roles --out {adapters})"
        )
        train_roles(adapters, progress=not args.no_progress)
    model, tokenizer = load_model()
    model = load_role_adapters(model, adapters)
    new_tokens = {r: max(1, round(n * args.new_tokens)) for r, n in NEW_TOKENS.items()}
    if args.quick:
        args.hops, args.filler = 2, 2
    config = StudyConfig(hops=args.hops, filler=args.filler, new_tokens=new_tokens)
    roles_json = adapters / "roles.json"
    described = (
        f"`{adapters}`, trained by `python -m hf_kvshare.lora.train_roles`: "
        + json.dumps(json.loads(roles_json.read_text())["settings"])
        if roles_json.exists()
        else f"`{adapters}`"
    )
    data = run_study(model, tokenizer, config, progress=not args.no_progress, adapters=described)
    data["command"] = ("python -m hf_kvshare.bench.studies.precache " + " ".join(argv)).strip()
    _attach_training(data, adapters)
    write(data, out)
    print(json.dumps(data["summary"], indent=1))
    return 0


def _attach_training(data: dict[str, Any], adapters: Path) -> None:
    """The role adapters' training report (``roles.json``: settings, loss per step, time), if there is one."""
    roles = adapters / "roles.json"
    if "adapters_training" not in data and roles.exists():
        data["adapters_training"] = json.loads(roles.read_text())


def write(data: dict[str, Any], out: Path) -> None:
    """``<out>/precache.md``, ``<out>/precache/precache.json`` and the plots."""
    (out / "precache").mkdir(parents=True, exist_ok=True)
    (out / "precache" / "precache.json").write_text(json.dumps(data, indent=1))
    plot(data, out / "precache")
    (out / "precache.md").write_text(
        report(data, data.get("command", "python -m hf_kvshare.bench.studies.precache"))
    )


if __name__ == "__main__":
    sys.exit(main())
