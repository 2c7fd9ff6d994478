"""What ``Session.run_turn`` passes to ``generate``: the caller's generation options, checked before
any work.

:func:`generate_options` reads ``run_turn``'s keyword arguments (a ``generation_config`` and/or
``GenerationConfig`` fields, ``generate``'s own arguments, model inputs the model's forward names)
and returns what reaches ``generate`` exactly as given (sampling, temperature, ``top_p``, stopping
criteria, a streamer, ...), with the session's default of one greedy sequence where the caller set
nothing. Refused with ``ValueError`` (saying what was expected and what was given) before the cache
is built: what ``run_turn`` cannot record (beams or several sequences: one output is recorded as the
slot; ``return_dict_in_generate`` and the ``output_*`` flags: a ``TurnResult`` has no place for
them), what the session sets itself (the prompt, the cache, positions), a ``max_length`` (use
``max_new_tokens``; in a ``generation_config`` too), an attention mask that is not all ones over the
prompt (the prompt is one unpadded sequence), decoding that cannot run over the built cache
(assisted / prompt-lookup decoding while transformers re-feeds the cached prompt, classifier-free
guidance's second prompt, forced words and constraints: beam search), sampling knobs ``generate``
would refuse or misuse only after the cache is built (``temperature <= 0``, ``top_p`` outside
``(0, 1]``, a ``do_sample`` that is not a bool, ...), logits processors / stopping criteria that are
not lists, a streamer without ``put`` / ``end``, and a name that is neither a generation option nor
an argument of ``generate`` or of the model's forward (a typo). ``stop_strings`` get the session's
tokenizer (``generate`` needs one). :func:`check_attention_mask` checks a given mask once the
prompt's length is known.
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import GenerationConfig

from ._compat import ASSISTED_DECODING_REFEEDS_CACHED_PROMPT

#: what ``run_turn`` passes itself (the prompt, the cache it built, positions)
SET_BY_SESSION = (
    "inputs",
    "input_ids",
    "inputs_embeds",
    "past_key_values",
    "cache",
    "cache_position",
    "position_ids",
    "use_cache",
)
#: outputs ``generate`` returns only in a dict, which a ``TurnResult`` has no place for
DICT_OUTPUTS = (
    "return_dict_in_generate",
    "output_scores",
    "output_logits",
    "output_attentions",
    "output_hidden_states",
)
#: the session's default where the caller sets nothing: one greedy sequence
DEFAULTS = {"do_sample": False, "num_beams": 1, "num_return_sequences": 1}
DEFAULT_MAX_NEW_TOKENS = 64
#: what transformers does wrong with assisted decoding over a prefilled cache (``_compat``)
_REFEEDS = "re-feeds the whole prompt over a cache that already holds it (transformers)"
#: decoding that feeds the prompt again beside the built cache, a second prompt, or needs several
#: beams: refused
UNSUPPORTED = {
    **(
        {
            "assistant_model": f"assisted decoding {_REFEEDS}",
            "prompt_lookup_num_tokens": f"prompt-lookup decoding {_REFEEDS}",
            "assistant_early_exit": f"self-speculative decoding {_REFEEDS}",
        }
        if ASSISTED_DECODING_REFEEDS_CACHED_PROMPT
        else {}
    ),
    "negative_prompt_ids": "classifier-free guidance runs a second, unconditional prompt the session did not build",
    "negative_prompt_attention_mask": "classifier-free guidance runs a second prompt the session did not build",
    "force_words_ids": "forced words need constrained beam search (several beams)",
    "constraints": "constraints need constrained beam search (several beams)",
}
#: list-like arguments of ``generate`` (a list, a tuple, or transformers' list classes)
LISTS = ("logits_processor", "stopping_criteria")


@dataclass
class GenerateOptions:
    """What reaches ``generate``: ``kwargs`` (``max_new_tokens`` and the session's defaults for what
    the caller left unset among them; with a ``generation_config`` given, a copy of it holding every
    generation setting), the caller's logits processors, the caller's attention mask (checked against
    the prompt by :func:`check_attention_mask`) and the number of new tokens."""

    kwargs: dict[str, Any] = field(default_factory=dict)
    processors: list[Any] = field(default_factory=list)
    attention_mask: Any = None
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    given: tuple[str, ...] = ()


def generate_options(
    model: torch.nn.Module, max_new_tokens: Any, kwargs: dict[str, Any], tokenizer: Any = None
) -> GenerateOptions:
    """Check ``run_turn``'s generation arguments (``max_new_tokens``: ``None`` means the
    ``generation_config``'s, else 64) and return what reaches ``generate``; raise ``ValueError``.
    ``tokenizer``: the session's, passed to ``generate`` for ``stop_strings`` when none is given."""
    kwargs = dict(kwargs)
    given = tuple(sorted(kwargs))
    config = kwargs.pop("generation_config", None)
    if config is not None and not isinstance(config, GenerationConfig):
        raise ValueError(
            f"run_turn: generation_config must be a transformers.GenerationConfig, got {type(config).__name__}"
            + (f" {config.__name__}" if isinstance(config, type) else "")
        )
    for name in LISTS:
        value = kwargs.get(name)
        if value is not None and not isinstance(value, (list, tuple)):
            raise ValueError(
                f"run_turn: {name} must be a list of callables (or transformers' {name} list), got "
                f"{type(value).__name__} {value!r:.60}"
            )
    streamer = kwargs.get("streamer")
    if streamer is not None and not (
        callable(getattr(streamer, "put", None)) and callable(getattr(streamer, "end", None))
    ):
        raise ValueError(
            f"run_turn: a streamer must have put(token_ids) and end() methods (transformers' BaseStreamer); "
            f"got {type(streamer).__name__}"
        )
    ours = sorted(set(kwargs) & set(SET_BY_SESSION))
    if ours:
        raise ValueError(
            f"run_turn sets {', '.join(ours)} itself (the prompt it built, its cache, their positions); got "
            f"{', '.join(f'{k}=' for k in ours)}. To drive generate yourself use Session.build_cache + model.generate"
        )
    length = kwargs["max_length"] if "max_length" in kwargs else getattr(config, "max_length", None)
    if "max_length" in kwargs or length is not None:
        where = "" if "max_length" in kwargs else " (in the generation_config)"
        raise ValueError(
            f"run_turn counts new tokens: pass max_new_tokens=, not max_length={length!r}{where}"
        )
    processors = list(kwargs.pop("logits_processor", None) or [])
    attention_mask = kwargs.pop("attention_mask", None)
    unused = GenerationConfig().update(**copy.copy(kwargs))  # names that are not GenerationConfig fields
    unknown = sorted(set(unused) - _accepted_arguments(model))
    if unknown:
        raise ValueError(
            f"run_turn: {', '.join(map(repr, unknown))} is neither a GenerationConfig field nor an argument of "
            "generate or of the model's forward (a typo?)"
        )

    def setting(name: str) -> Any:
        if name in kwargs:
            return kwargs[name]
        if config is not None and getattr(config, name, None) is not None:
            return getattr(config, name)
        return None

    call = dict(kwargs)
    for name, default in DEFAULTS.items():
        if setting(name) is None:
            call[name] = default  # not the model's generation_config: the session decodes one greedy sequence
    for name in ("num_beams", "num_return_sequences"):
        value = setting(name)
        if value is not None and value != 1:
            where = f"{name}={value!r}" + ("" if name in kwargs else " (in the generation_config)")
            raise ValueError(
                f"run_turn generates and records one sequence as the output slot; got {where}. For beam search or "
                "several samples use Session.build_cache + model.generate (the cache follows generate's batch)"
            )
    unsupported = [name for name in UNSUPPORTED if setting(name) is not None]
    if unsupported:
        raise ValueError(
            f"run_turn cannot honour {', '.join(f'{n}=' for n in unsupported)}: "
            f"{'; '.join(UNSUPPORTED[n] for n in unsupported)}. Leave it out: run_turn decodes one "
            "sequence over the cache it built"
        )
    _check_decoding(setting)
    flags = [name for name in DICT_OUTPUTS if setting(name)]
    if flags:
        raise ValueError(
            f"run_turn returns a TurnResult (output ids, text, and with force_output= the logits), not generate's "
            f"dict outputs; got {', '.join(f'{n}=True' for n in flags)}. For scores use "
            "Session.build_cache + model.generate"
        )
    if max_new_tokens is None:
        max_new_tokens = setting("max_new_tokens")
        max_new_tokens = DEFAULT_MAX_NEW_TOKENS if max_new_tokens is None else max_new_tokens
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(
            f"max_new_tokens must be an int >= 1, got {max_new_tokens!r} ({type(max_new_tokens).__name__})"
        )
    call["max_new_tokens"] = max_new_tokens
    if setting("stop_strings") is not None and "tokenizer" not in call and tokenizer is not None:
        call["tokenizer"] = tokenizer  # generate needs it to find stop strings
    if config is not None:  # one GenerationConfig holding every generation setting, as generate wants it
        config = copy.deepcopy(config)
        rest = config.update(**call)
        call = {**rest, "generation_config": config}
    return GenerateOptions(call, processors, attention_mask, max_new_tokens, given)


def _check_decoding(setting) -> None:
    """The decoding knobs ``generate`` would refuse (or misuse) only after the cache is built."""
    import math

    def number(name: str, low: float, high: float, low_open: bool, high_open: bool = False) -> None:
        value = setting(name)
        if value is None:
            return
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        ok = (
            ok
            and (value > low if low_open else value >= low)
            and (value < high if high_open else value <= high)
        )
        if not ok:
            bounds = f"{'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
            raise ValueError(f"run_turn: {name} must be a finite number in {bounds}, got {value!r}")

    sample = setting("do_sample")
    if sample is not None and not isinstance(sample, bool):
        raise ValueError(
            f"run_turn: do_sample must be True or False, got {sample!r} ({type(sample).__name__})"
        )
    if sample:
        number("temperature", 0.0, math.inf, True, True)
        number("top_p", 0.0, 1.0, True)
        number("typical_p", 0.0, 1.0, True)
        number("min_p", 0.0, 1.0, False)
        top_k = setting("top_k")
        if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0):
            raise ValueError(f"run_turn: top_k must be an int >= 0, got {top_k!r}")
    number("repetition_penalty", 0.0, math.inf, True, True)
    for name in ("min_new_tokens", "no_repeat_ngram_size"):
        value = setting(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise ValueError(f"run_turn: {name} must be an int >= 0, got {value!r}")


def check_attention_mask(mask: Any, batch: int, length: int) -> None:
    """A caller's ``attention_mask`` for ``run_turn``'s prompt (``batch`` rows of ``length`` tokens,
    unpadded) must be all ones of shape ``[length]``, ``[1, length]`` or ``[batch, length]``."""
    if mask is None:
        return
    try:
        values = torch.as_tensor(mask)
    except (TypeError, ValueError, RuntimeError) as error:
        raise ValueError(f"run_turn: attention_mask must be a tensor of ones, got {mask!r:.80}") from error
    shapes = {(length,), (1, length), (batch, length)}
    if tuple(values.shape) not in shapes or not bool((values == 1).all()):
        zeros = int((values == 0).sum()) if values.numel() else 0
        raise ValueError(
            f"run_turn feeds one unpadded prompt of {length} tokens: an attention_mask, if given, must be all ones "
            f"of shape [1, {length}]; got shape {list(values.shape)} with {zeros} zeros. Leave it out (the session "
            "builds it), or pass a prompt without the masked tokens"
        )


def _accepted_arguments(model: torch.nn.Module) -> set[str]:
    """Names ``generate`` or the model's forward take by name (less what the session sets)."""
    # here, not at the top: transformers' generation module pulls accelerate (and boto3) with it
    from transformers import GenerationMixin

    names: set[str] = set()
    functions = [GenerationMixin.generate, getattr(model, "generate", None), getattr(model, "forward", None)]
    base = getattr(model, "get_base_model", None)
    if callable(base):
        functions.append(getattr(base(), "forward", None))
    for function in functions:
        if function is None:
            continue
        try:
            parameters = inspect.signature(function).parameters.values()
        except (TypeError, ValueError):
            continue
        names.update(
            p.name for p in parameters if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and p.name != "self"
        )
    return names - set(SET_BY_SESSION)
