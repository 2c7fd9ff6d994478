"""The README's Python examples run as written (on a tiny random Llama with the embedded tokenizer)
and print no deprecation warning: `generate` gets the cache under the keyword of this transformers."""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import pytest

import hf_kvshare
from hf_kvshare import CACHE_KWARG

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def test_generate_calls_in_readme_and_notebooks_use_the_current_keyword():
    sources = {"README.md": README}
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        cells = json.loads(path.read_text())["cells"]
        sources[path.name] = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
    for name, text in sources.items():
        for call in re.findall(r"\.generate\((.*?)\)", text, flags=re.S):
            assert "past_key_values=" not in call, f"{name}: generate({call}) uses the deprecated keyword"


def test_readme_python_examples_run_without_future_warnings(tiny_llama, tokenizer, monkeypatch):
    blocks = python_blocks(README)
    ten_lines = blocks[0]  # the first screen's example
    keywords = next(b for b in blocks if "cache=shared_cache" in b)  # generate's two keyword forms
    session_example = next(b for b in blocks[1:] if "load_model()" in b)
    assert "model.generate(" in ten_lines and "load_model()" in ten_lines
    assert len([line for line in ten_lines.strip().splitlines() if line.strip()]) <= 10
    assert "model.generate(" in keywords and "build_cache(" in session_example
    monkeypatch.setattr(hf_kvshare, "load_model", lambda *a, **k: (tiny_llama, tokenizer))
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        warnings.simplefilter("error", DeprecationWarning)
        first: dict = {}
        exec(compile(ten_lines, "README.md (ten lines)", "exec"), first)
        assert first["out"].shape[1] > first["ids"].shape[1]
        namespace: dict = {}
        exec(compile(session_example, "README.md (Python)", "exec"), namespace)
        # the keyword example's lines, with its names bound to this session's cache and prompt
        for line in keywords.strip().splitlines():
            if "cache=" in line and CACHE_KWARG != "cache":
                continue  # the `cache=` line is for transformers >= 5.24
            cache, ids = namespace["s"].build_cache("reviewer", [hf_kvshare.PH("coder")])
            namespace.update(shared_cache=cache, prompt_ids=ids)
            exec(compile(line, "README.md (generate keywords)", "exec"), namespace)
    assert namespace["out"].shape[1] > namespace["ids"].shape[1]


@pytest.mark.skipif(CACHE_KWARG != "cache", reason="past_key_values= is the only keyword before 5.24")
def test_the_old_keyword_still_warns_here(tiny_llama, tokenizer):
    """What the examples avoid (so the test above can fail): past_key_values= warns from 5.24 on."""
    session = hf_kvshare.Session(tiny_llama, tokenizer, method="fullshared")
    cache, ids = session.build_cache("a", [hf_kvshare.PF("Hello there, agent.")])
    with pytest.warns(FutureWarning):
        tiny_llama.generate(input_ids=ids, past_key_values=cache, max_new_tokens=2, do_sample=False)


def test_readme_tells_a_new_user_what_the_first_load_and_the_tests_cost():
    from hf_kvshare.models import _cache_root

    assert "~/.cache/hf_kvshare" in README and "HF_KVSHARE_CACHE" in README and " MB" in README
    assert "--index-url https://download.pytorch.org/whl/cpu" in README
    assert "fast lane" in README and "min" in README
    # the variable the README names is the one load_model reads
    import os

    old = os.environ.get("HF_KVSHARE_CACHE")
    os.environ["HF_KVSHARE_CACHE"] = "/elsewhere/cache"
    try:
        assert str(_cache_root()) == "/elsewhere/cache"
    finally:
        os.environ.pop("HF_KVSHARE_CACHE") if old is None else os.environ.update(HF_KVSHARE_CACHE=old)


def test_readme_demo_lines_differ_and_name_runnable_methods():
    from hf_kvshare.cli import demo_methods

    lines = [line.split("#")[0].split() for line in README.splitlines() if line.startswith("hf-kvshare demo")]
    assert len(lines) == 2 and lines[0] != lines[1]
    methods = lines[1][lines[1].index("--methods") + 1 :]
    methods = methods[: next((i for i, m in enumerate(methods) if m.startswith("--")), len(methods))]
    assert len(methods) >= 2 and all(m.partition(":")[0] in demo_methods() for m in methods)
