"""Bad method options say what was expected: refused when the method is built, when a session binds
it to the model, or at the latest before a turn does any work; the command line's ``name:opt=val``
specs parsed and checked the same way; legitimate options run."""

from __future__ import annotations

import pytest
from adversarial import Case, assert_holds, cached_model, cached_tokenizer
from tiny import STEPS

from hf_kvshare import METHODS, Session
from hf_kvshare.method import option_names


@pytest.mark.parametrize(
    "name, options, message",
    [
        ("kvcmas", {"tau": "0.3"}, r"tau must be a real number in \[0, 1\], got '0.3' \(str\)"),
        ("kvcmas", {"tau": True}, r"tau must be a real number in \[0, 1\], got True \(bool\)"),
        ("kvcmas", {"temperature": float("nan")}, r"temperature must be a finite real number > 0, got nan"),
        (
            "kvcomm",
            {"token_temperature": float("inf")},
            r"token_temperature must be a finite real number > 0",
        ),
        ("graphflow", {"rank": True}, r"rank must be a positive int or None \(dense\), got True"),
        ("graphflow", {"calibration_requests": True}, r"calibration_requests must be an int >= 1, got True"),
        ("droidspeak", {"layer_profile": [1.0, float("inf"), 0.0]}, r"finite numbers \(no NaN or inf\)"),
        ("kvcmas", {"max_pools": 0}, r"max_pools must be an int >= 1, got 0"),
        (
            "cacheblend",
            {"rhoo": 0.5},
            r"method 'cacheblend' has no option 'rhoo'; its options: rho, check_layers",
        ),
    ],
)
def test_bad_method_options_say_what_was_expected(name, options, message):
    from hf_kvshare.method import get_method

    with pytest.raises(ValueError, match=message):
        get_method(name, **options)


@pytest.mark.parametrize("name, option", [("kvcmas", "eviction_window"), ("kvcomm", "eviction_window")])
def test_a_bool_is_not_an_int_option(name, option):
    with pytest.raises(ValueError, match=f"{option} must be an int.*got True"):
        METHODS[name](**{option: True})


def test_a_repeated_method_option_is_refused():
    from hf_kvshare.bench.methods import MethodSpec

    with pytest.raises(ValueError, match="method option 'tau' is given twice in 'kvcmas:tau=0.3,tau=0.9'"):
        MethodSpec.parse("kvcmas:tau=0.3,tau=0.9")
    assert MethodSpec.parse("kvcmas:tau=0.3,capacity=4").kwargs == {"tau": 0.3, "capacity": 4}


# ---------------------------------------------------------------- the adversarial re-run (tests/adversarial.py): method options
_OPTIONS = "method options"


def _runs(name, options, layers=4):
    """A method built from ``options`` runs a two-turn workflow on a tiny model of ``layers`` layers."""
    model = cached_model(layers=layers)
    session = Session(model, cached_tokenizer(), METHODS[name](**options))
    return [
        session.run_turn(agent, segments, max_new_tokens=2).output_ids.tolist()
        for agent, segments in STEPS[:2]
    ]


def _option_refused(name, options, match, layers=4):
    """Refused when constructed, or when the session binds it to the model, or at the latest before a
    turn does any work; the model-free part first."""
    label = f"{name}:" + ",".join(f"{k}={v!r}" for k, v in options.items())
    return Case(_OPTIONS, label, lambda: _runs(name, options, layers), match)


def _option_runs(name, options, layers=4):
    label = f"{name}:" + ",".join(f"{k}={v!r}" for k, v in options.items()) + " (runs)"
    return Case(_OPTIONS, label, lambda: _runs(name, options, layers), None, lambda got: len(got) == 2)


def _spec(text, match=None, kwargs=None):
    """A ``name:opt=val`` string as the command line takes it: parsed, then the method constructed."""
    from hf_kvshare.bench.methods import MethodSpec

    def run():
        spec = MethodSpec.parse(text)
        spec.cls(**spec.kwargs)
        return spec.kwargs

    return Case(
        _OPTIONS,
        f"parse {text!r}",
        run,
        match,
        None if kwargs is None else (lambda got: got == kwargs),
    )


def _options_cases():
    nan = float("nan")
    return [
        _option_refused("kvcmas", {"tau": -0.1}, r"tau .*in \[0, 1\], got -0.1"),
        _option_refused("kvcmas", {"tau": 1.5}, r"tau .*in \[0, 1\], got 1.5"),
        _option_refused("kvcmas", {"tau": nan}, r"tau must be a real number in \[0, 1\], got nan"),
        _option_refused("kvcmas", {"tau": None}, r"tau must be a real number in \[0, 1\], got None"),
        _option_refused("kvcmas", {"capacity": 0}, r"capacity must be an int >= 2 .*got 0"),
        _option_refused("kvcmas", {"capacity": 2.5}, r"capacity must be an int >= 2 .*got 2.5"),
        _option_refused("kvcmas", {"capacity": True}, r"capacity must be an int >= 2 .*got True"),
        _option_refused(
            "kvcmas", {"base_rank": 0}, r"base_rank must be a positive int or None \(dense\), got 0"
        ),
        _option_refused(
            "kvcmas", {"delta_rank": "32"}, r"delta_rank must be a positive int or None \(dense\), got '32'"
        ),
        _option_refused("kvcmas", {"temperature": 0}, r"temperature must be a finite real number > 0, got 0"),
        _option_refused(
            "kvcmas",
            {"token_temperature": -1.0},
            r"token_temperature must be a finite real number > 0, got -1.0",
        ),
        _option_refused("kvcmas", {"eviction_window": 0}, r"eviction_window must be an int >= 1, got 0"),
        _option_refused("kvcmas", {"gate_scope": "bogus"}, r"gate_scope.*'bogus'"),
        _option_refused("kvcmas", {"output_source": "bogus"}, r"output_source.*'bogus'"),
        _option_refused("kvcmas", {"text_source": 3}, r"text_source.*3"),
        _option_refused("kvcmas", {"gating": "bogus"}, r"gating.*'bogus'"),
        _option_refused("kvcmas", {"match": "bogus"}, r"match.*'bogus'"),
        _option_refused("kvcmas", {"svd": "bogus"}, r"svd.*'bogus'"),
        _option_refused("kvcmas", {"pool_peak": "bogus"}, r"pool_peak.*'bogus'"),
        _option_refused("kvcmas", {"delta_frame": "bogus"}, r"delta_frame.*'bogus'"),
        _option_refused("kvcmas", {"key_frame": None}, r"key_frame.*None"),
        _option_refused("kvcmas", {"prefix_scope": "bogus"}, r"prefix_scope.*'bogus'"),
        _option_refused("kvcmas", {"prefix_reuse": "yes"}, r"prefix_reuse.*'yes'"),
        _option_refused("kvcmas", {"partial_coverage": 1}, r"partial_coverage.*1"),
        _option_refused("kvcmas", {"guard": "no"}, r"guard.*'no'"),
        _option_refused("kvcmas", {"skip_layer0": None}, r"skip_layer0.*None"),
        _option_refused("kvcmas", {"weights_cache": 0}, r"weights_cache.*0"),
        _option_refused("kvcmas", {"lead_in": -1}, r"lead_in.*-1"),
        _option_refused("kvcmas", {"max_pools": 2.0}, r"max_pools must be an int >= 1, got 2.0"),
        _option_refused("kvcmas", {"turn_fallback": "bogus"}, r"turn_fallback.*'bogus'"),
        _option_refused("kvcmas", {"observation_source": "bogus"}, r"observation_source.*'bogus'"),
        _option_runs("kvcmas", {"base_rank": 4, "delta_rank": 2, "capacity": 2, "tau": 1.0}),
        _option_runs("kvcmas", {"gate_scope": "edge", "tau": 0.0}),
        _option_runs("kvcomm", {"base_rank": 10**6}),
        _option_refused("cacheblend", {"rho": 1.5}, r"rho.*\[0, 1\].*1.5"),
        _option_refused("cacheblend", {"rho": nan}, r"rho.*nan"),
        _option_refused("cacheblend", {"check_layers": ()}, r"check_layers must name at least one layer"),
        _option_refused("cacheblend", {"check_layers": (99,)}, r"check_layers.*99.*4 layers|layer 99"),
        _option_refused("cacheblend", {"check_layers": "1"}, r"check_layers.*'1'"),
        _option_refused("cacheblend", {"check_layers": (1.5,)}, r"check_layers.*1.5"),
        _option_refused("droidspeak", {"max_groups": 0}, r"max_groups must be an int >= 1; got 0"),
        _option_refused(
            "droidspeak",
            {"layer_profile": [0.1, 0.2]},
            r"layer profile has 2 entries but the model has 4 layers",
        ),
        _option_refused("droidspeak", {"layer_profile": []}, r"layer_profile.*\[\]|at least one"),
        _option_refused("droidspeak", {"layer_profile": "0.1,0.2"}, r"layer_profile.*'0.1,0.2'|path|file"),
        _option_refused("droidspeak", {"rho": -0.5}, r"rho.*-0.5"),
        _option_refused("relaycaching", {"band": (0.8, 0.2)}, r"band.*\(0.8, 0.2\)"),
        _option_refused("relaycaching", {"band": (0.0, 2.0)}, r"band.*2.0"),
        _option_refused("relaycaching", {"band": "x"}, r"band.*'x'"),
        _option_refused(
            "relaycaching",
            {"band": (0.25, 0.75)},
            r"band \(0.25, 0.75\) covers layers \[1, 2\) of 3.*at least two layers",
            layers=3,
        ),
        _option_refused(
            "graphflow", {"calibration_requests": 0}, r"calibration_requests must be an int >= 1, got 0"
        ),
        _option_refused("graphflow", {"rank": 0}, r"rank must be a positive int or None \(dense\), got 0"),
        _option_refused("graphflow", {"max_profiles": -1}, r"max_profiles must be an int >= 1, got -1"),
        _option_refused("fullshared", {"prefix_scope": "bogus"}, r"prefix_scope.*'bogus'"),
        _option_refused("fullshared", {"prefix_reuse": 1}, r"prefix_reuse.*1"),
        _option_runs("fullshared", {"prefix_reuse": True, "prefix_scope": "request"}),
        Case(
            _OPTIONS,
            "get_method('KVCMAS')",
            lambda: METHODS.get("KVCMAS") or __import__("hf_kvshare").get_method("KVCMAS"),
            r"unknown method 'KVCMAS'; registered methods: .*kvcmas",
        ),
        Case(
            _OPTIONS,
            "get_method(None)",
            lambda: __import__("hf_kvshare").get_method(None),
            r"registry name or a Method instance, got NoneType",
        ),
        Case(
            _OPTIONS,
            "an instance with options",
            lambda: __import__("hf_kvshare").get_method(METHODS["kvcmas"](), tau=0.5),
            r"options \['tau'\] were given with a KVCMAS instance",
        ),
        Case(
            _OPTIONS,
            "Session(method=..., unknown option)",
            lambda: Session(cached_model(), cached_tokenizer(), "kvcmas", colour=1),
            r"method 'kvcmas' has no option 'colour'",
        ),
        Case(
            _OPTIONS,
            "a positional option is its field",
            lambda: METHODS["kvcmas"](4),
            None,
            lambda m: m.base_rank == 4,
        ),
        _spec("kvcmas:tau=abc", r"tau must be a real number in \[0, 1\], got 'abc'"),
        _spec("kvcmas:", kwargs={}),
        _spec("kvcmas:tau", r"'tau' in 'kvcmas:tau' is not of the form key=value"),
        _spec("kvcmas:=3", r"'=3' in 'kvcmas:=3' is not of the form key=value"),
        _spec(":tau=1", r"unknown method ''"),
        _spec("kvcmas:tau=0.3,", kwargs={"tau": 0.3}),
        _spec("kvcmas:bogus=1", r"method 'kvcmas' has no option bogus; its options: base_rank"),
        _spec("kvcmas:tau=nan", r"tau must be a real number in \[0, 1\], got 'nan' \(str\)"),
        _spec("kvcmas:tau=inf", r"tau must be a real number in \[0, 1\], got 'inf' \(str\)"),
        _spec("kvcmas:capacity=1e3", r"capacity must be an int >= 2 .*got 1000.0"),
        _spec("kvcmas:base_rank=none", kwargs={"base_rank": None}),
        _spec("cacheblend:check_layers=0", r"check_layers.*0|layer"),
        _spec("KVCMAS:tau=0.3", r"unknown method 'KVCMAS'"),
        _spec(" kvcmas : tau = 0.4 ", kwargs={"tau": 0.4}),
    ]


ADVERSARIAL_OPTIONS = _options_cases()


@pytest.mark.parametrize("case", ADVERSARIAL_OPTIONS, ids=lambda c: c.name)
def test_adversarial_method_options(case):
    assert_holds(case)


ADVERSARIAL = ADVERSARIAL_OPTIONS


# ------------------------------------------------------------ issue 52: inputs (options and paths)
def _profile_paths(tmp_path):
    import os

    (tmp_path / "dir").mkdir()
    os.mkfifo(tmp_path / "fifo")
    with open(tmp_path / "huge.json", "wb") as file:  # sparse: 2 GiB of nothing, never read
        file.truncate(2 << 30)
    (tmp_path / "binary.json").write_bytes(b"\xff\xfe\x00")
    (tmp_path / "overflow.json").write_text("[0.5, " + "9" * 400 + "]")
    return [
        ("", "an empty path"),
        ("   ", "an empty path"),
        (str(tmp_path / "dir"), "is a directory"),
        ("/dev/zero", "not a regular file"),
        (str(tmp_path / "fifo"), "not a regular file"),
        (str(tmp_path / "huge.json"), "is over 1048576 bytes"),
        (str(tmp_path / "binary.json"), "is not JSON"),
        (str(tmp_path / "overflow.json"), "sequence of numbers"),
        (str(tmp_path / "none.json"), "no such file"),
        ("a\x00b", "cannot be read"),
    ]


def test_a_layer_profile_path_that_is_no_small_regular_file_is_refused_without_reading_it(tmp_path):
    """Issue 52 (inputs): ``droidspeak:layer_profile=`` an empty path, a directory, ``/dev/zero``, a FIFO
    (opened without blocking: never waited on), a huge file (never read past the bound): one clear
    ``ValueError`` naming the option, fast; also through the bench's option string."""
    import time

    from hf_kvshare.bench.methods import MethodSpec

    for value, message in _profile_paths(tmp_path):
        start = time.monotonic()
        with pytest.raises(ValueError, match=f"layer_profile.*{message}"):
            METHODS["droidspeak"](layer_profile=value)
        assert time.monotonic() - start < 5, value
    with pytest.raises(ValueError, match="creating method droidspeak.*layer_profile is an empty path"):
        MethodSpec.parse("droidspeak:layer_profile=").create()
    with pytest.raises(ValueError, match="layer_profile '/dev/zero' is not a regular file"):
        MethodSpec.parse("droidspeak:layer_profile=/dev/zero").create()


@pytest.mark.parametrize(
    "name, options, message",
    [
        (
            "cacheblend",
            {"check_layers": 1.5},
            r"cacheblend: check_layers must be a layer index .*got 1.5 \(float\)",
        ),
        ("cacheblend", {"check_layers": None}, r"check_layers must be .*got None \(NoneType\)"),
        ("cacheblend", {"check_layers": {1, 2}}, r"check_layers must be .*\(set\)"),
        ("relaycaching", {"band": 0.5}, r"relaycaching: band must be two fractions .*got 0.5 \(float\)"),
        ("relaycaching", {"band": 3}, r"band must be two fractions .*got 3 \(int\)"),
        ("relaycaching", {"band": None}, r"band must be two fractions .*got None"),
    ],
)
def test_a_number_where_layers_or_a_band_are_expected_is_a_clear_type_error(name, options, message):
    """Issue 52 (inputs): ``cacheblend:check_layers`` / ``relaycaching:band`` given a number (or another
    wrong type): a ``TypeError`` at construction naming the option, what it expects and what it got."""
    with pytest.raises(TypeError, match=message):
        METHODS[name](**options)


@pytest.mark.parametrize("name", sorted(name for name, cls in METHODS.items() if option_names(cls)))
def test_an_option_assigned_after_construction_is_checked(name):
    """Issue 52 (inputs): an option set to a wrong value after construction (``m.tau = "x"``) is refused
    there, as the constructor refuses it, naming the option; the instance keeps its value. A right
    value is taken as the constructor would keep it."""
    method = METHODS[name]()
    before = method.state_options()
    for option in before:
        for bad in (object(), "surely not a valid value"):
            if bad == before[option]:
                continue
            try:
                setattr(method, option, bad)
            except (TypeError, ValueError) as error:
                assert option in str(error), (name, option, str(error))
            else:
                assert isinstance(bad, str), f"{name}.{option} = object() was accepted"
                setattr(method, option, before[option])
            assert method.state_options() == before, (name, option)
    for option, value in before.items():
        setattr(method, option, value)  # every value the constructor kept is taken again
    assert method.state_options() == before


def test_kvcmas_tau_set_to_a_string_after_construction_is_refused():
    method = METHODS["kvcmas"](tau=0.3)
    with pytest.raises(ValueError, match=r"KVCMAS.tau = 'x' refused: kvcmas: tau must be a real number"):
        method.tau = "x"
    assert method.tau == 0.3
    method.tau = 1
    assert method.tau == 1


@pytest.mark.parametrize(
    "text",
    [
        "kvcmas:lead_in=" + "x" * 200_000,
        "kvcmas:" + ",".join(f"tau=0.{i % 9}" for i in range(20_000)),
        "cacheblend:check_layers=" + "1" * 100_000,
    ],
    ids=["long-option-value", "many-options", "long-number"],
)
def test_a_method_spec_is_bounded_in_length(text):
    """Issue 52 (inputs): a method option string of 100 KB or more is one short error (not echoed whole)."""
    from hf_kvshare.bench.methods import MethodSpec

    with pytest.raises(
        ValueError, match=r"method spec '.{60}'\.\.\. is [\d,]+ characters; at most 4096"
    ) as error:
        MethodSpec.parse(text)
    assert len(str(error.value)) < 300
