"""Model configs of ``load_model("random:NAME")`` (JSON, the published model cards' numbers)."""
