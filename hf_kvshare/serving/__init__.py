"""Serving on vLLM: the client helper (``client``: a multi-agent trajectory as OpenAI chat requests)
and the concurrent-serving benchmark (``bench``: ``hf-kvshare bench serve``); docs/serving.md."""
