"""README.md against the code: its tables of recipes and defenses against the catalogs and registries, its config
block against the config schema, its command lines against the command line's parser, and the files, tests, library
objects and identifiers it (and the recipes' notes) name against the checkout. A user reads the README, not the code;
these checks keep the two from drifting apart."""
import fnmatch
import functools
import importlib
import re
import shlex
from pathlib import Path

import pytest
import yaml

from blackboxbench import catalog, registry
from blackboxbench.cli import build_parser
from blackboxbench.config import DEVICES, FILE_KEYS, load_config, threat_keys, top_keys

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text()


def _tables(text, first_header):
    """The body rows (lists of stripped cells) of every markdown table of ``text`` whose first header cell is
    ``first_header``."""
    rows, inside = [], False
    for line in text.splitlines():
        if not line.startswith("|"):
            inside = False
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not inside:
            inside = cells[0] == first_header
            header = True
            continue
        if header:  # the |---| line
            header = False
            continue
        rows.append(cells)
    return rows


def _names(cell):
    return re.findall(r"`([^`]+)`", cell)


def _expand(names, known):
    """Names as written, a glob such as ``tog_*`` standing for every known name it matches (at least one)."""
    out = set()
    for n in names:
        if "*" in n:
            hits = fnmatch.filter(known, n)
            assert hits, f"README names {n!r}, which matches no recipe"
            out |= set(hits)
        else:
            out.add(n)
    return out


def _section(title):
    start = README.index(f"\n## {title}\n")
    end = README.find("\n## ", start + 1)
    return README[start:end if end > 0 else None]


def test_attack_tables_list_every_recipe_and_only_recipes():
    recipes = set(catalog.entries("attacks"))
    rows = _tables(README, "attack")
    assert rows
    named = _expand([n for r in rows for n in _names(r[1])], recipes)
    assert named - recipes == set(), "README attack tables name recipes that attacks/ does not hold"
    assert recipes - named == set(), "recipes of attacks/ missing from the README attack tables"


def test_attack_tables_give_each_recipes_family():
    for row in _tables(README, "attack"):
        for name in _expand(_names(row[1]), set(catalog.entries("attacks"))):
            family = yaml.safe_load(Path(catalog.entries("attacks")[name]).read_text())["family"]
            assert row[2].split(",")[0].strip() == family, (name, row[2], family)


def test_defense_tables_match_the_registry():
    # defenses a test file registers (paper 'test', e.g. test_defenses' plugin) are not the catalog's
    defenses = {n for n in registry.DEFENSE.names()
                if not registry.DEFENSE.get(n).registry_meta.get("paper", "").startswith("test")}
    for text, header in ((README, "defense"), ((REPO / "defenses" / "README.md").read_text(), "name")):
        rows = _tables(text, header)
        named = {n for r in rows for n in _names(r[0]) if " " not in n}  # a row of models, not a defense, has none
        assert named == defenses, (header, named ^ defenses)


def test_analysis_catalog_table_and_readme_name_every_analysis_recipe():
    recipes = set(catalog.entries("analysis"))
    table = {n for r in _tables((REPO / "analysis" / "README.md").read_text(), "recipe") for n in _names(r[0])}
    assert table == recipes, table ^ recipes
    mentioned = set(re.findall(r"`([a-z_]+)`", README))
    assert recipes - mentioned == set(), "analysis recipes README.md never names"


def test_block_kinds_sentence_names_every_kind_and_registry():
    sentence = README[README.index("Block kinds:"):]
    sentence = sentence[:sentence.index(". ")]
    named = set(_names(sentence))
    kinds = {k for n in registry.FAMILY.names() for k in registry.FAMILY.get(n).blocks}
    block_registries = {b.registry.kind for n in registry.FAMILY.names() for b in registry.FAMILY.get(n).blocks.values()}
    others = {r.kind for r in vars(registry).values() if isinstance(r, registry.Registry)} - block_registries
    assert named == kinds | others, named ^ (kinds | others)


def _config_block():
    section = _section("Experiment configs")
    block = section[section.index("```yaml") + len("```yaml"):]
    return block[:block.index("```")]


def test_config_block_keys_are_the_schemas():
    cfg = yaml.safe_load(_config_block())
    schema = {**top_keys(), **FILE_KEYS}
    assert set(cfg) - set(schema) == set(), "keys in README's config block the schema does not know"
    assert set(cfg["threat"]) <= set(threat_keys())
    # every key of the schema is documented somewhere in the README
    undocumented = [k for k in [*schema, *threat_keys()] if not re.search(rf"`[^`]*\b{k}\b[^`]*`|\b{k}:", README)]
    assert not undocumented, f"config keys README.md never names: {undocumented}"


def test_config_block_comments_name_valid_choices():
    block = _config_block()
    device = re.search(r"^device:.*#\s*(.*)$", block, re.M).group(1)
    assert {d.strip() for d in device.split("|")} == set(DEVICES)
    backends = [yaml.safe_load(b) for b in re.search(r"^backend:.*execute: (.*)$", block, re.M).group(1).split(" | ")]
    backends = {b["name"] if isinstance(b, dict) else b for b in backends}
    run = next(a for a in build_parser()._subparsers._group_actions[0].choices["run"]._actions
               if a.dest == "backend")
    assert backends == set(run.choices)
    datasets = re.search(r"^dataset:.*#\s*(.*)$", block, re.M).group(1)
    names = {d.split()[0] for d in datasets.split("|")}
    assert names <= set(registry.DATASET.names()), names - set(registry.DATASET.names())


def test_config_block_validates_with_its_commented_examples(tmp_path):
    """The block as written (with its comments' examples of plots, grid and each backend) is a valid config."""
    cfg = yaml.safe_load(_config_block())
    cfg.pop("runs")  # [...]: a placeholder
    block = _config_block()
    cfg.update(output_dir=str(tmp_path / "results"), leaderboard=str(tmp_path / "results" / "board.csv"))
    plots = re.search(r"^plots:.*e\.g\. (\[.*\])\s*$", block, re.M).group(1)
    cfg["plots"] = [{**p, "output": str(tmp_path / p["output"])} for p in yaml.safe_load(plots)]
    cfg["grid"] = yaml.safe_load(re.search(r"^grid:.*e\.g\. (\{.*\})\s*$", block, re.M).group(1))
    backends = re.search(r"^backend:.*execute: (.*)$", block, re.M).group(1).split(" | ")
    for backend in backends:
        cfg["backend"] = yaml.safe_load(backend)
        path = tmp_path / "c.yaml"
        path.write_text(yaml.safe_dump(cfg))
        experiments, opts = load_config(path)
        name = cfg["backend"]["name"] if isinstance(cfg["backend"], dict) else cfg["backend"]
        assert len(experiments) == 4 and opts["backend"]["name"] == name  # 2 eps x 2 seeds


def _subcommands():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "cmd")
    return sub.choices


def _flags(subparser):
    return {o for a in subparser._actions for o in a.option_strings} - {"-h", "--help"}


def _command_lines():
    """(subcommand, words) of every ``blackboxbench ...`` or ``python scripts/run.py ...`` command in README.md's
    inline code and code blocks."""
    spans = re.findall(r"```[a-z]*\n(.*?)```", README, re.S)
    lines = [line for s in spans for line in s.replace("\\\n", " ").splitlines()]
    lines += re.findall(r"(?<!`)`([^`\n]+)`(?!`)", re.sub(r"```.*?```", "", README, flags=re.S))
    out = []
    for line in lines:
        line = line.split("  #")[0]
        for m in re.finditer(r"(?:blackboxbench|python -m blackboxbench|python scripts/run\.py)\s+(.*)", line):
            try:
                words = shlex.split(m.group(1))
            except ValueError:
                words = m.group(1).split()
            if "scripts/run.py" in m.group(0):
                words = ["run", *words]
            out.append(words)
    return out


def test_readme_commands_use_existing_subcommands_and_flags():
    subs = _subcommands()
    lines = _command_lines()
    assert len(lines) > 10
    for words in lines:
        if not words or words[0] in ("--version",) or not re.match(r"^[a-z-]+$", words[0]):
            continue
        assert words[0] in subs, f"README runs `blackboxbench {words[0]}`, not a subcommand: {words}"
        flags = {w.split("=")[0] for w in words[1:] if re.match(r"^--?[a-z]", w)}
        assert flags <= _flags(subs[words[0]]), (words[0], flags - _flags(subs[words[0]]))


def test_readme_documents_every_subcommand_and_flag():
    subs = _subcommands()
    for name, parser in subs.items():
        assert re.search(rf"`blackboxbench {name}\b", README), f"README never shows `blackboxbench {name}`"
        missing = [a.option_strings for a in parser._actions if a.option_strings and a.dest != "help"
                   and not any(re.search(rf"(?<![\w-]){re.escape(o)}(?![\w-])", README) for o in a.option_strings)]
        assert not missing, f"options of `blackboxbench {name}` README.md never names: {missing}"
    assert "--version" in README


def _asset_kinds(recipe):
    """The asset kinds the blocks of a query recipe read (``train_images`` for a trained generator or prior)."""
    kinds = set()
    for spec in yaml.safe_load(Path(catalog.entries("attacks")[recipe]).read_text())["blocks"].values():
        for s in spec if isinstance(spec, list) else [spec]:
            name = s["name"] if isinstance(s, dict) else s
            for reg in (registry.INIT, registry.PERTURB, registry.ACCEPT):
                if name in reg:
                    kinds |= set(reg.get(name).registry_meta.get("asset_params", {}).values())
    return kinds


def test_defenses_config_runs_what_the_readme_says():
    """configs/cifar10_defenses.yaml: every query recipe without a trained prior, under each of the five settings
    (none, RND, AAA-Linear, AAA-Sine, the AT target), and README.md's counts of it."""
    query = {n for n, p in catalog.entries("attacks").items()
             if yaml.safe_load(Path(p).read_text())["family"] in ("score", "decision")}
    untrained = {n for n in query if "train_images" not in _asset_kinds(n)}
    runs = yaml.safe_load((REPO / "configs" / "cifar10_defenses.yaml").read_text())["runs"]
    settings = {}
    for r in runs:
        attack = r["attack"] if isinstance(r["attack"], str) else r["attack"]["recipe"]
        defense = r.get("defense")
        settings.setdefault(attack, []).append(
            r.get("model") or (defense if isinstance(defense, str) or defense is None else defense["name"]))
    assert set(settings) == untrained, set(settings) ^ untrained
    for attack, got in settings.items():
        assert sorted(map(str, got)) == sorted(["None", "rnd", "aaa_linear", "aaa_sine", "cifar_resnet4b_adv"]), attack
    text = " ".join(README.split())
    assert f"({len(untrained)} of the {len(query)} query recipes: not " in text
    assert f"{len(untrained)} attacks x {{none, RND, AAA-Linear, AAA-Sine, the AT target}}: {len(runs)} runs" in text
    trained = re.search(r"query recipes: not ([^)]*)\)", text).group(1)
    assert set(_names(trained)) == query - untrained


def test_the_contract_test_runs_a_plugins_block():
    """"The contract test runs every registered block": a block of a plugin file (the README's example, whose
    ``paper`` starts with "example") is composed onto I-FGSM and run by tests/test_contract.py when the file is
    named in ``BLACKBOXBENCH_PLUGINS``."""
    import os
    import subprocess
    import sys
    env = dict(os.environ, BLACKBOXBENCH_PLUGINS=str(REPO / "examples" / "gaussian_noise.py"),
               PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0",
                          str(REPO / "tests" / "test_contract.py"), "-k", "gaussian_noise and (linf-u or context)"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and "2 passed" in out.stdout, out.stdout[-2000:] + out.stderr[-2000:]
    assert "BLACKBOXBENCH_PLUGINS" in README


# ---- references by name: files, tests, library objects and identifiers the README and the recipes' notes name ----
# A reference goes stale silently when the thing it names is renamed or removed; these tests extract them with a few
# explicit rules and check that each still exists. Not checked (too fuzzy to check by rule): bare file names without
# a directory (``square.py``, the authors' ``NPAttack_targeted.py``), files of the data root or the cache
# (``models/...``, ``BLACKBOXBENCH_CACHE/priors``), dotted names whose first part is no module (``ctx.pool``,
# ``torch.fx``), and the meaning of a name: a record or summary field must be named somewhere in the code, not
# declared in its family's schema (the README's prose does not say reliably which field belongs to which file).

TOP = {p.name for p in REPO.iterdir() if not p.name.startswith(".")} - {"results"}  # results/: a run's output
PACKAGE = REPO / "blackboxbench"
SUBPACKAGES = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}  # query/geoda.py: in the package
# Other code the recipes' notes cite by path, whose first part is also one of this repository's: the original
# BlackboxBench's query/attacks/score/*.py, DRA's authors' examples/attacks/dra/attack.py, MCG's authors' square.py.
OTHERS = ("query/attacks/", "examples/attacks/", "attacks/square.py")
PATH = re.compile(r"[\w.<>{}*-]+(?:/[\w.<>{}*-]*)+(?:::[\w\[\]-]+)?|[\w-]+\.(?:py|yaml|md|sh|csv|png|ini|in)")
TEST = re.compile(r"test_\w+(?:\[.*)?")  # test_x or a parametrized test_x[id]
DOTTED = re.compile(r"[a-z_]\w*(?:\.[A-Za-z_]\w*)+")
IDENT = re.compile(r"[a-z][a-z0-9]*_[a-z0-9_]+")  # snake_case with at least one underscore: keys, fields, names
WORD = re.compile(r"[a-z][a-z0-9]*")  # a one-word span (`rnd`, `psba`), not a word of a command line (`pip install`)


def _tokens(text):
    """Whitespace-separated words of ``text``, stripped of the punctuation of the prose around them; a word
    ``key: value`` or ``key=value`` also yields ``key``."""
    for word in text.split():
        for part in re.split(r"[=:](?!:)", word) if "::" not in word else [word]:
            part = part.lstrip("([\"'").rstrip(".,;:)]\"'")
            if part:
                yield part


def _code_spans(text):
    """(line number, text) of every inline code span of a markdown text, outside its fenced code blocks (blanked
    out, lines kept); a span may run over a line break, as in the README's wrapped paragraphs."""
    text = re.sub(r"```.*?```", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S)
    return [(text.count("\n", 0, m.start()) + 1, " ".join(m.group(1).split()))
            for m in re.finditer(r"`([^`]+)`", text)]


@functools.lru_cache(maxsize=None)
def _defined_tests():
    """The ``test_...`` names of tests/: its test functions (parametrized ids are prefixed by them), its modules
    (``test_engine``) and the names its tests register (the model ``"test_digits_mlp_f64"``)."""
    names = set()
    for f in (REPO / "tests").glob("*.py"):
        text = f.read_text()
        names |= {f.stem, *re.findall(r"^\s*(?:async\s+)?def (test_\w+)", text, re.M)}
        names |= set(re.findall(r"[\"'](test_\w+)[\"']", text))
    return names


@functools.lru_cache(maxsize=None)
def _code_words():
    """Every identifier of the code, recipes and configs (not of the markdown docs, which would make the check
    below a tautology)."""
    words = set()
    for pattern in ("blackboxbench/**/*.py", "tests/*.py", "benchmarks/**/*.py", "benchmarks/**/*.sh", "scripts/*.py",
                    "examples/*.py", "setup.py", "pytest.ini", "attacks/**/*.yaml", "defenses/**/*.yaml",
                    "analysis/*.yaml", "configs/*.yaml"):
        for f in REPO.glob(pattern):
            words |= set(re.findall(r"\w+", f.read_text()))
    return words


def _glob(path):
    """A README path with placeholders (``<name>``, ``{a,b}``, ``*``) as a glob pattern."""
    return re.sub(r"<[^>]*>|\{[^}]*\}", "*", path)


def _path_problem(token):
    """Why a path-like token names no file of the checkout (None when it does, or is no repository path)."""
    path, _, test = token.partition("::")
    first = path.split("/")[0]
    if path.startswith(OTHERS):
        return None
    roots = []  # analysis/ is both a folder of the repository and a subpackage
    if first in TOP:
        roots.append(REPO)
    if first in SUBPACKAGES and "/" in path:
        roots.append(PACKAGE)
    if not roots:
        return None  # not a repository path: a run's output (adv/<index>.png), an authors' file, a cache folder
    pattern = _glob(path.rstrip("/"))
    hits = [f for root in roots for f in (root.glob(pattern) if "*" in pattern else [root / pattern]) if f.exists()]
    if not hits:
        return f"{path}: no such file or folder"
    defines = rf"^\s*def {re.escape(test.split('[')[0])}\("
    if test and not any(re.search(defines, f.read_text(), re.M) for f in hits):
        return f"{path} defines no {test}"
    return None


def _resolve(dotted):
    """Whether ``family.audit_logits``, ``prep.inference.FixedBatch`` or ``blackboxbench.oracle.Oracle`` names an
    object of the library: the longest importable module prefix, then attributes. None: the first part is not a
    module of the package (``ctx.pool``, ``torch.fx``)."""
    parts = dotted.split(".")
    if parts[0] == "blackboxbench":
        parts = parts[1:]
    modules = {p.stem for p in PACKAGE.glob("*.py")} | SUBPACKAGES
    if not parts or parts[0] not in modules:
        return None
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module("blackboxbench." + ".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def reference_problems(text, spans=None, check_words=True):
    """Stale references of a text: [(where, reference, why)]. ``spans``: (where, text) pieces to read, ``where`` a
    line number or a label (default: the whole text, unlabelled). Paths must exist (placeholders match at least one
    file), ``file::test`` must define the test, a ``test_...`` name must be a test of tests/, a dotted name whose
    first part is a module of the package must name an object of it, unless it is a config key (``dataset.n``;
    ``threat.X``: X a threat key), and, with ``check_words``, a snake_case identifier (or a span of one lowercase
    word) must occur in the code, recipes or configs."""
    spans = [("", text)] if spans is None else spans
    tests, words = _defined_tests(), _code_words() if check_words else set()
    config_keys, threat = {**top_keys(), **FILE_KEYS}, threat_keys()
    problems = []
    for line, span in spans:
        for token in _tokens(span):
            if PATH.fullmatch(token):
                why = _path_problem(token)
            elif TEST.fullmatch(token):
                why = None if token.split("[")[0] in tests else "no test of tests/ has this name"
            elif DOTTED.fullmatch(token):  # dataset.n, threat.success_rule (keys); threat.quantize_l2 (a function)
                first, second = token.split(".")[:2]
                key = first in config_keys and (first != "threat" or second in threat)
                why = (None if key or _resolve(token) is not False
                       else "neither a config key nor an object of the library")
            elif check_words and (IDENT.fullmatch(token) or WORD.fullmatch(token) and token == span):
                why = None if token in words else "no code, recipe or config names it"
            else:
                why = None
            if why:
                problems.append((line, token, why))
    return problems


def _report(problems, where):
    return f"stale references in {where}:\n" + "\n".join(
        f"  {'line ' if isinstance(n, int) else ''}{n}: `{ref}`: {why}" for n, ref, why in problems)


def test_readme_references_exist():
    """Every file, test, library object and identifier README.md names in backticks still exists."""
    problems = reference_problems(README, _code_spans(README))
    assert not problems, _report(problems, "README.md")


RECIPES = sorted(p for d in ("attacks", "defenses", "analysis") for p in (REPO / d).rglob("*.yaml"))


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: str(p.relative_to(REPO)))
def test_recipe_notes_references_exist(recipe):
    """The files and tests a recipe's ``notes`` and ``defaults`` cite (plain prose: identifiers there are often the
    authors' code's, so only paths, test names and dotted names of the library are checked)."""
    spec = yaml.safe_load(recipe.read_text())
    fields = [(key, str(spec[key])) for key in ("notes", "defaults") if key in spec]
    problems = reference_problems("", fields, check_words=False)
    assert not problems, _report(problems, recipe.relative_to(REPO))
