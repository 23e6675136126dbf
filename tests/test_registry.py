import pytest

from blackboxbench.errors import BenchError
from blackboxbench.registry import Registry, block_params, check_params


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
