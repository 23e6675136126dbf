"""The recipe catalogs are found from any working directory, from a checkout or after ``pip install .``."""
import subprocess
import sys
from pathlib import Path

from blackboxbench import catalog
from blackboxbench.cli import main

REPO = Path(__file__).resolve().parent.parent


def test_catalog_lists_every_recipe_file():
    files = {p.stem for p in (REPO / "attacks").rglob("*.yaml")}
    assert set(catalog.entries("attacks")) == files and files
    for kind in catalog.KINDS:
        assert catalog.catalog_dir(kind).is_dir()


def test_catalog_from_another_directory(tmp_path):
    """Run from an unrelated directory: the installed package (or the checkout on PYTHONPATH) finds the recipes."""
    code = "from blackboxbench import catalog; print(sorted(catalog.entries('attacks')))"
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert eval(out.stdout) == sorted(catalog.entries("attacks"))


def test_installed_copy_when_installed(tmp_path):
    """When the package is installed (not from this checkout), its bundled catalog equals the repository's."""
    code = "import blackboxbench, pathlib; print(pathlib.Path(blackboxbench.__file__).parent)"
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin"})
    if out.returncode != 0 or Path(out.stdout.strip()).parent.name not in ("site-packages", "dist-packages"):
        import pytest  # a checkout, or an editable install of it (of this one or another clone): no bundled copy
        pytest.skip("blackboxbench is not installed outside this checkout")
    for kind in ("attacks", "defenses", "analysis"):
        bundled = Path(out.stdout.strip()) / "_catalogs" / kind
        assert {p.stem for p in bundled.rglob("*.yaml")} == {p.stem for p in (REPO / kind).rglob("*.yaml")}, kind


def test_cli_list(capsys):
    assert main(["list", "attacks"]) == 0
    out = capsys.readouterr().out
    assert "square_linf" in out and "mi_fgsm" in out
    assert main(["list", "blocks"]) == 0
    assert "perturb:" in capsys.readouterr().out
    assert main(["list", "analysis"]) == 0
    assert "aev_heatmap" in capsys.readouterr().out


def test_cli_list_defenses(capsys):
    """The defense catalog is the registry (no YAML recipes): ``list defenses`` prints each with its defaults."""
    assert main(["list", "defenses"]) == 0
    out = capsys.readouterr().out
    assert "rnd" in out and "'sigma': 0.02" in out and "aaa_sine" in out and "jpeg" in out


def test_version_and_python_m(tmp_path, capsys):
    """``blackboxbench --version`` and ``python -m blackboxbench`` (the command without its script) work."""
    import blackboxbench
    import pytest
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"blackboxbench {blackboxbench.__version__}"
    out = subprocess.run([sys.executable, "-m", "blackboxbench", "list", "defenses"], cwd=tmp_path, text=True,
                         capture_output=True, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)})
    assert out.returncode == 0 and "rnd" in out.stdout, out.stderr


# A new user's walkthrough from ``pip install .`` (2026-12-05): what it found.

def test_the_installed_copy_of_a_catalog_comes_first(tmp_path, monkeypatch):
    """Installed, the package's parent is site-packages, where another distribution may have put a top-level
    ``analysis`` (or ``attacks``) folder: the bundled copy is read, not that folder."""
    pkg = tmp_path / "site-packages" / "blackboxbench"
    (pkg / "_catalogs" / "analysis").mkdir(parents=True)
    (pkg / "_catalogs" / "analysis" / "aev_bar.yaml").write_text("tool: aev_bar\n")
    (tmp_path / "site-packages" / "analysis").mkdir()  # someone else's package
    (tmp_path / "site-packages" / "analysis" / "__init__.py").write_text("")
    monkeypatch.setattr(catalog, "_PKG", pkg)
    assert catalog.catalog_dir("analysis") == pkg / "_catalogs" / "analysis"
    assert list(catalog.entries("analysis")) == ["aev_bar"]
    checkout = tmp_path / "checkout" / "blackboxbench"  # a checkout has no _catalogs: its top-level folder
    (checkout.parent / "attacks").mkdir(parents=True)
    monkeypatch.setattr(catalog, "_PKG", checkout)
    assert catalog.catalog_dir("attacks") == checkout.parent / "attacks"


def test_a_build_does_not_keep_files_deleted_from_the_checkout(tmp_path):
    """setuptools reuses ``build/lib`` across ``pip install .``: setup.py's build_py empties it first, so a recipe
    or module deleted (or moved) since an earlier install is not installed again."""
    lib = tmp_path / "lib"
    (lib / "blackboxbench" / "_catalogs" / "attacks").mkdir(parents=True)
    (lib / "blackboxbench" / "gone.py").write_text("")
    (lib / "blackboxbench" / "_catalogs" / "attacks" / "moved.yaml").write_text("")
    out = subprocess.run([sys.executable, "setup.py", "-q", "build_py", "-d", str(lib)], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert not (lib / "blackboxbench" / "gone.py").exists()
    assert not (lib / "blackboxbench" / "_catalogs" / "attacks" / "moved.yaml").exists()
    assert (lib / "blackboxbench" / "cli.py").is_file()
    assert (lib / "blackboxbench" / "_catalogs" / "attacks" / "score" / "square_linf.yaml").is_file()


def test_the_source_distribution_holds_what_the_tests_read(tmp_path):
    """The sdist (MANIFEST.in) carries the whole tests folder, pytest.ini and the configs, examples and script the
    tests read; setuptools alone took tests/test_*.py without conftest.py and the helpers."""
    out = subprocess.run([sys.executable, "setup.py", "-q", "egg_info", "--egg-base", str(tmp_path)], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    sources = set((tmp_path / "blackboxbench.egg-info" / "SOURCES.txt").read_text().split())
    want = {"pytest.ini", "scripts/run.py", "examples/gaussian_noise.py"}
    want |= {p.relative_to(REPO).as_posix() for p in (REPO / "tests").glob("*.py")}
    want |= {p.relative_to(REPO).as_posix() for p in (REPO / "configs").glob("*.yaml")}
    assert want <= sources, sorted(want - sources)


def test_pytest_imports_the_checkout_however_it_is_started(tmp_path):
    """``pytest`` (no working directory on sys.path, as ``python -P``) imports the checkout's package, as
    ``python -m pytest`` does (pytest.ini's pythonpath), not an installed copy."""
    import os
    probe = tmp_path / "test_probe.py"
    probe.write_text("import pathlib\nimport blackboxbench\n\n\ndef test_where():\n"
                     f"    assert pathlib.Path(blackboxbench.__file__).resolve().parent == pathlib.Path({str(REPO)!r})"
                     " / 'blackboxbench'\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-P", "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0",
                          "-c", str(REPO / "pytest.ini"), "--rootdir", str(REPO), str(probe)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "1 passed" in out.stdout, out.stdout[-2000:] + out.stderr[-2000:]


def test_analyze_without_a_data_root_names_its_flag(tmp_path, monkeypatch, capsys):
    """``blackboxbench analyze`` has no config: its missing data root names ``--data-root``, not ``data_root in
    the config``."""
    monkeypatch.delenv("BLACKBOXBENCH_DATA", raising=False)
    assert main(["analyze", "-r", "fsm", "--model", "cifar_resnet20", "--dataset", "cifar10",
                 "-o", str(tmp_path / "f.png")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: no data root: give --data-root or set BLACKBOXBENCH_DATA"], err


def test_relative_paths_of_a_config_run_from_another_directory(tmp_path, monkeypatch, fresh_registries):
    """README, "Relative paths": a config run from another directory writes its output_dir and leaderboard under
    the working directory and finds its plugins next to itself."""
    proj, cwd = tmp_path / "proj", tmp_path / "elsewhere"
    proj.mkdir()
    cwd.mkdir()
    # a block of its own name: examples/gaussian_noise.py may be registered already in this process (another test)
    (proj / "shift.py").write_text(
        "from blackboxbench.registry import TRANSFORM\n\n\n"
        "@TRANSFORM.register('relative_paths_probe', paper='test plugin')\n"
        "def relative_paths_probe(ctx, x):\n    return x\n")
    (proj / "c.yaml").write_text(
        "plugins: [shift.py]\ndataset: {name: digits, n: 4}\nsurrogates: [digits_cnn]\ntargets: [digits_mlp]\n"
        "attack: {recipe: i_fgsm, hyper: {iterations: 2}, blocks: {transform: [{name: relative_paths_probe}]}}\n"
        "threat: {norm: linf, eps: 0.2}\ndevice: cpu\noutput_dir: out\nleaderboard: out/board.csv\n")
    monkeypatch.chdir(cwd)
    assert main(["run", str(proj / "c.yaml"), "--quiet"]) == 0
    assert (cwd / "out" / "board.csv").is_file() and not (proj / "out").exists()


def test_every_option_and_argument_of_every_subcommand_has_help():
    """``blackboxbench SUBCOMMAND --help`` explains each of its options and arguments (a bare ``-o OUTPUT`` did not
    say what it writes or where by default)."""
    from blackboxbench.cli import build_parser
    subs = next(a for a in build_parser()._actions if a.choices and isinstance(a.choices, dict)).choices
    for name, parser in subs.items():
        bare = [a.dest for a in parser._actions if a.dest != "help" and not a.help]
        assert not bare, f"blackboxbench {name}: no help for {bare}"
