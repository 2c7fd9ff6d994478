"""Serving on vLLM: the KV connector (``connector``, ``paged``), the per-task host that drives a method's
contract (``host``), the layout convention (``layout``), the server (``server``, ``middleware``,
``models``: ``hf-kvshare serve``) and the client helper (``client``: a multi-agent trajectory as OpenAI
chat requests). The concurrent-serving benchmark is ``hf_kvshare.bench.serve`` (``hf-kvshare bench
serve``); see docs/serving-bench.md."""
