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
