import pytest

from blackboxbench import registry
from blackboxbench.errors import BenchError
from blackboxbench.registry import (FAMILY, PERTURB, Interval, ParamError, Registry, block_params, check_params,
                                    is_numeric, restore, snapshot, value_problem)


def test_register_get_and_names():
    reg = Registry("thing")

    @reg.register("alpha", paper="x")
    def alpha(x, *, k=1):
        return x + k

    assert reg.get("alpha") is alpha and "alpha" in reg and reg.names() == ["alpha"]
    assert alpha.registry_meta["paper"] == "x"


def test_duplicate_names_both_places():
    reg = Registry("thing")

    @reg.register("a")
    def first():
        pass

    with pytest.raises(BenchError) as e:
        @reg.register("a")
        def second():
            pass
    msg = str(e.value)
    assert "duplicate thing 'a'" in msg and msg.count("test_registry.py") == 2


def test_unknown_lists_close_matches():
    reg = Registry("thing")
    reg.register("square_linf")(lambda: None)
    with pytest.raises(BenchError, match="did you mean: square_linf"):
        reg.get("square_lnf")


def test_unknown_without_close_matches_names_the_known_ones_or_the_listing():
    from blackboxbench.catalog import find

    few, many = Registry("thing"), Registry("thing")
    for name in ("rnd", "jpeg"):
        few.register(name)(lambda: None)
    for i in range(20):
        many.register(f"block{i}")(lambda: None)
    with pytest.raises(BenchError, match=r"unknown thing 'zzz' \(known: jpeg, rnd\)$"):
        few.get("zzz")
    with pytest.raises(BenchError, match=r"unknown thing 'zzz' \(`blackboxbench list blocks` lists them\)$"):
        many.get("zzz")
    with pytest.raises(BenchError, match=r"unknown attack recipe 'zzz' \(`blackboxbench list attacks` lists them\)$"):
        find("zzz")
    with pytest.raises(BenchError, match=r"unknown analysis recipe 'zzz' \(known: adm, aev_bar, .*, path_tsne\)$"):
        find("zzz", "analysis")


def test_params_are_keyword_only_and_checked():
    def block(problem, state, *, p_init=0.05, size):
        pass

    assert block_params(block) == {"p_init": 0.05, "size": block_params(block)["size"]}
    check_params(block, {"size": 2})
    with pytest.raises(BenchError, match="unknown parameter.*did you mean: p_init"):
        check_params(block, {"size": 2, "p_nit": 1})
    with pytest.raises(BenchError, match="missing parameter"):
        check_params(block, {})
    with pytest.raises(BenchError, match="unknown parameter"):
        check_params(block, {"size": 2, "state": 1})  # positional (pipeline-owned) arguments are not tunable


# ---------------------------------------------------------------- parameter types and declared ranges

def _block(ranges, name="b"):
    reg = Registry("thing")

    @reg.register(name, ranges=ranges)
    def block(ctx, state, *, p=0.5, n=3, flag=True, mode="a", anything=None, count=None, odd=3, w=None):
        pass

    return block


def _problem(fn, **params):
    try:
        check_params(fn, params)
    except ParamError as e:
        return e.param, e.message
    return None


@pytest.mark.parametrize("text,inside,outside", [
    ("(0, 1]", [1e-9, 0.5, 1], [0, -1, 1.0001, float("nan")]),
    ("[0, 1)", [0, 0.999], [1, -1e-9]),
    ("[1, inf)", [1, 10 ** 12], [0.999, float("inf")]),
    ("(-inf, 0]", [-1e300, 0], [1e-300, float("-inf")]),
])
def test_interval_parse_and_contains(text, inside, outside):
    iv = Interval.parse(text)
    assert str(iv) == text and iv.kind == "real"
    assert all(v in iv for v in inside) and not any(v in iv for v in outside)


@pytest.mark.parametrize("text", ["(0, 1", "0, 1", "[1, 0]", "[0, inf]", "[-inf, 0)", "(a, 1]", "float (0, 1]",
                                  "(0; 1]", "", 5])
def test_bad_interval_fails_at_registration(text):
    with pytest.raises(BenchError, match="range"):
        _block({"p": text})


def test_range_for_unknown_param_fails_at_registration():
    with pytest.raises(BenchError, match="not a keyword-only parameter.*did you mean: p"):
        _block({"pp": "(0, 1]"})


def test_a_refused_registration_leaves_the_name_free():
    """A registration refused for its ranges (or its agree) registers nothing: the name stays unknown, and the
    corrected block registers under it (not 'duplicate')."""
    reg = Registry("thing")
    with pytest.raises(BenchError, match="range"):
        reg.register("a", ranges={"p": "(1, 0]"})(lambda *, p=0.5: None)
    with pytest.raises(BenchError, match="agree names"):
        reg.register("a", agree={"q": "perturb"})(lambda *, p=0.5: None)
    assert "a" not in reg and reg.names() == []
    fixed = reg.register("a", ranges={"p": "(0, 1]"})(lambda *, p=0.5: None)
    assert reg.get("a") is fixed


def test_agree_names_a_parameter_of_the_entry():
    reg = Registry("thing")
    with pytest.raises(BenchError, match="agree names 'levels', which is not one of its parameters"):
        reg.register("a", agree={"levels": "perturb"})(lambda *, num_levels=3: None)
    reg.register("b", agree={"num_levels": "perturb"})(lambda *, num_levels=3: None)
    assert reg.get("b").registry_meta["agree"] == {"num_levels": "perturb"}


def test_ranges_are_parsed_once_into_meta():
    fn = _block({"p": "(0, 1]", "odd": "odd [1, inf)", "mode": ("a", "b")})
    ranges = fn.registry_meta["ranges"]
    assert ranges["p"] == Interval(0, 1, True, False) and ranges["odd"].kind == "odd" and ranges["mode"] == ("a", "b")


def test_types_from_defaults():
    fn = _block({})
    assert _problem(fn, p=1) is None and _problem(fn, p=0.25) is None  # float default: int or float
    assert _problem(fn, p=True) == ("p", "expected a number, got bool True")
    assert _problem(fn, p="abc") == ("p", "expected a number, got str 'abc'")
    assert _problem(fn, n=2.0) == ("n", "expected an integer, got float 2.0")
    assert _problem(fn, n=False)[0] == "n"
    assert _problem(fn, flag=1) == ("flag", "expected a boolean, got int 1")
    assert _problem(fn, mode=3) == ("mode", "expected a string, got int 3")
    assert _problem(fn, anything=[1, "x", None]) is None and _problem(fn, anything="x") is None
    assert _problem(fn, p=float("inf"))[1] == "must be finite, got inf"
    assert "64-bit" in _problem(fn, n=2 ** 63)[1]


def test_declared_ranges_are_checked():
    fn = _block({"p": "(0, 1]", "n": "int [1, inf)", "count": "int [0, 10]", "odd": "odd [1, inf)",
                 "w": "list [0, inf)", "mode": ("a", "b"), "anything": "[0, 1]"})
    assert _problem(fn, p=-1) == ("p", "must be in (0, 1], got -1")
    assert _problem(fn, p=0) == ("p", "must be in (0, 1], got 0") and _problem(fn, p=1) is None
    assert _problem(fn, n=0) == ("n", "must be in [1, inf), got 0")
    assert _problem(fn, count=None) is None and _problem(fn, count=10) is None  # a None default allows None
    assert _problem(fn, count=2.5) == ("count", "expected an integer, got float 2.5")  # the declared kind types it
    assert _problem(fn, count=11) == ("count", "must be in [0, 10], got 11")
    assert _problem(fn, odd=4) == ("odd", "must be an odd integer in [1, inf), got 4") and _problem(fn, odd=5) is None
    assert _problem(fn, w=[0, 2.5]) is None
    assert _problem(fn, w=[1, -1]) == ("w", "each value must be a number in [0, inf), got [1, -1]")
    assert _problem(fn, w=[True]) is not None and _problem(fn, w=3)[1] == "expected a list, got int 3"
    assert _problem(fn, mode="c") == ("mode", "must be one of a, b, got 'c'")
    assert _problem(fn, anything="x") == ("anything", "expected a number, got str 'x'")  # interval on None default
    assert _problem(fn, anything=float("nan"))[0] == "anything"


def test_choices_of_a_list_parameter_apply_to_each_item():
    reg = Registry("thing")

    @reg.register("b", ranges={"sides": (8, 16, 32)})
    def block(ctx, state, *, sides=(8, 32)):
        pass

    assert _problem(block, sides=[32, 8]) is None and _problem(block, sides=(16,)) is None
    assert _problem(block, sides=[8, 12]) == ("sides", "each item must be one of 8, 16, 32, got 12")
    assert _problem(block, sides=[]) == ("sides", "expected a non-empty list of 8, 16, 32, got []")
    assert _problem(block, sides=16)[1] == "expected a non-empty list of 8, 16, 32, got 16"


def test_param_error_names_the_param():
    fn = _block({"p": "(0, 1]"})
    with pytest.raises(ParamError) as e:
        check_params(fn, {"p": 2}, where="block 'b': ")
    assert e.value.param == "p" and str(e.value) == "block 'b': p: must be in (0, 1], got 2"
    assert is_numeric(fn, "p") and is_numeric(fn, "n") and not is_numeric(fn, "mode")
    assert not is_numeric(fn, "anything") and not is_numeric(fn, "nope")


def test_snapshot_and_restore_every_registry():
    reg = Registry("thing")
    reg.register("a")(lambda: None)
    snap = snapshot()
    reg.register("b")(lambda: None)
    PERTURB.register("snapshot_test_block")(lambda ctx, state: state)
    restore(snap)
    assert reg.names() == ["a"] and "snapshot_test_block" not in PERTURB


# Every registered entry of the package (timm style: one case per entry, so a new block without ranges fails):
# each numeric keyword parameter (an int or float default) declares its range, and every default lies inside.
ENTRIES = [(reg, name) for reg in vars(registry).values() if isinstance(reg, Registry) and reg is not FAMILY
           for name in reg.names() if reg.get(name).__module__.startswith("blackboxbench.")]


@pytest.mark.parametrize("reg,name", ENTRIES, ids=[f"{reg.kind}-{name}" for reg, name in ENTRIES])
def test_numeric_params_declare_ranges(reg, name):
    fn = reg.get(name)
    ranges = fn.registry_meta["ranges"]
    params = block_params(fn)
    numeric = [p for p, d in params.items() if type(d) in (int, float)]
    assert not [p for p in numeric if p not in ranges], f"{reg.kind} '{name}': declare ranges= for these"
    for p in ranges:
        if params[p] is not None:
            assert value_problem(fn, p, params[p]) is None, f"default of {p} outside its declared range"


def test_every_kind_is_covered():
    kinds = {reg.kind for reg, _ in ENTRIES}
    assert kinds >= {"init", "perturb", "accept", "transform", "loss", "gradient", "direction", "update", "refine",
                     "target_label", "model", "dataset", "asset"}


@pytest.mark.parametrize("source,problem", [
    ("def blk(ctx, state, frac=0.1):\n    return state", "parameter 'frac' must be keyword-only (after *)"),
    ("def blk(state, ctx, frac=0.1):\n    return state", "parameter 'frac' must be keyword-only (after *)"),
    ("def blk(ctx):\n    return None", "it takes 1 positional argument(s), the pipeline passes 2"),
    ("def blk(ctx, state, extra):\n    return state", "it takes 3 positional argument(s), the pipeline passes 2"),
    ("def blk(ctx, state, **params):\n    return state", "*args / **kwargs would swallow misspelt parameters")])
def test_a_block_with_the_wrong_signature_fails_at_registration(source, problem):
    """A pipeline block must take the arguments its pipeline passes, then keyword-only parameters: otherwise one line
    at registration (a plugin's import), naming the block, its file and the contract, not a run that dies in its
    first step or a YAML parameter reported as unknown."""
    reg = Registry("perturb_test", ("ctx", "state"))
    namespace = {}
    exec(source, namespace)  # noqa: S102 - a block defined in the test
    with pytest.raises(BenchError) as e:
        reg.register("blk", paper="test")(namespace["blk"])
    text = str(e.value)
    assert "\n" not in text and text.startswith("perturb_test block 'blk' (") and problem in text, text
    assert text.endswith("the contract is def blk(ctx, state, *, <parameters>)"), text
    assert "blk" not in reg.names()
