"""4-bit (nf4, fp32 compute) and 8-bit vs fp32 on the embedded SmolLM2-135M-Instruct, NonShared, CPU:
weights memory (``get_memory_footprint``), KV cache bytes per turn, the TTFT ratio (one run, same process:
a shared machine makes it indicative only), and the agreement of the quantized model with fp32 on 3 short
prompts x 32 new tokens (free-running: greedy tokens equal position by position; teacher-forced: fp32's
outputs fed through the quantized model, top-1 equal).

    OMP_NUM_THREADS=1 python benchmarks/quantization.py
"""

import torch

from hf_kvshare import PF, PH, Session, load_model

torch.set_num_threads(1)
PROMPTS = [
    "Name three primary colors and explain why they are called primary.",
    "Write a Python function that returns the factorial of n.",
    "What is the capital of France? Answer in one sentence.",
]
N = 32


def cache_bytes(cache) -> int:
    return sum(t.nbytes for layer in range(cache.num_layers) for t in cache.layer_kv(layer))


results = {}
for name, kwargs in (("fp32", {}), ("nf4", dict(load_in_4bit=True)), ("8bit", dict(load_in_8bit=True))):
    model, tok = load_model("smollm2-135m", **kwargs)
    session = Session(model, tok, "nonshared")
    turns = [
        session.run_turn(f"agent{i}", [PF("You are a helpful assistant.\n"), PH(f"q{i}", p)], max_new_tokens=N,
                         keep_cache=True)
        for i, p in enumerate(PROMPTS)
    ]  # fmt: skip
    results[name] = dict(model=model, turns=turns, ttft=sum(t.ttft_s for t in turns))
    per_token = {cache_bytes(t.cache) / t.cache.get_seq_length() for t in turns}
    print(
        f"{name}: weights {model.get_memory_footprint() / 2**20:.1f} MiB, KV cache "
        f"{[round(cache_bytes(t.cache) / 2**20, 2) for t in turns]} MiB per turn ({per_token} bytes/token)"
    )
ref = results["fp32"]
for name in ("nf4", "8bit"):
    q = results[name]
    same = total = agree = forced = 0
    for a, b in zip(ref["turns"], q["turns"]):
        x, y = a.output_ids.tolist(), b.output_ids.tolist()
        total += max(len(x), len(y))
        same += sum(i == j for i, j in zip(x, y))
        ids = torch.cat([a.prompt_ids, a.output_ids])[None]
        with torch.no_grad():
            top1 = q["model"](input_ids=ids).logits[0, a.prompt_ids.numel() - 1 : -1].argmax(-1)
        agree += int((top1 == a.output_ids).sum())
        forced += a.output_ids.numel()
    print(
        f"{name}: weights {q['model'].get_memory_footprint() / ref['model'].get_memory_footprint():.3f} of fp32; "
        f"free-running tokens equal {same}/{total} = {same / total:.3f}; teacher-forced top-1 {agree}/{forced} "
        f"= {agree / forced:.3f}; TTFT fp32/{name} = {ref['ttft'] / q['ttft']:.2f}"
    )
