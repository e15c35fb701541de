"""Config input is bounded (issue 26, part 4): a hostile or broken YAML file or `--set`
value is refused with one short line naming its source and the limit it breaks, before
it is expanded into memory; values quoted back in an error line are cut short. The
bounds are structural (counted while composing), so no test here measures time."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshforge import config as config_module
from meshforge.config import (
    MAX_CONFIG_BYTES,
    MAX_CONFIG_DEPTH,
    MAX_CONFIG_NODES,
    dump_config,
    load_config,
    read_yaml_file,
)
from meshforge.errors import MAX_ERROR_CHARS, ConfigError, MeshforgeError, quote, shorten

# The classic "billion laughs": nine levels of lists of nine aliases of the level below,
# 9**9 (387 million) strings once expanded, in under a kilobyte.
BILLION_LAUGHS = "\n".join(
    ['a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    + [
        f"{b}: &{b} [{','.join(['*' + a] * 9)}]"
        for a, b in zip("abcdefgh", "bcdefghi", strict=True)
    ]
)
SHORT_LINE = 300  # an error line a person reads in one glance


@pytest.fixture(params=["libyaml", "python"])
def parser(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each bound holds with libyaml's parser (used where installed) and PyYAML's own."""
    if request.param == "python":
        monkeypatch.setattr(config_module, "_BoundedLoader", config_module._PyBoundedLoader)
    elif not hasattr(config_module, "_CBoundedLoader"):
        pytest.skip("PyYAML without libyaml here")
    return request.param


def _refusal(excinfo: pytest.ExceptionInfo[ConfigError]) -> str:
    line = str(excinfo.value)
    assert "\n" not in line
    assert len(line) < SHORT_LINE, line
    return line


def test_the_billion_laughs_file_is_refused_in_one_short_line(tmp_path: Path, parser: str) -> None:
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(BILLION_LAUGHS)
    assert bomb.stat().st_size < 1024
    with pytest.raises(ConfigError) as excinfo:
        load_config(bomb)
    line = _refusal(excinfo)
    assert str(bomb) in line and "MAX_CONFIG_NODES" in line
    assert f"{MAX_CONFIG_NODES:,}" in line


def test_an_alias_bomb_in_set_model_kwargs_is_refused_naming_the_option(parser: str) -> None:
    flow = "{" + BILLION_LAUGHS.replace("\n", ", ") + "}"
    with pytest.raises(ConfigError) as excinfo:
        load_config(None, ["model.name=pkg.mod:build", f"model.kwargs={flow}"])
    line = _refusal(excinfo)
    assert line.startswith("--set model.kwargs:") and "MAX_CONFIG_NODES" in line


def test_aliases_are_counted_where_they_are_used_not_where_they_are_defined(
    tmp_path: Path,
) -> None:
    # 101 values defined once, used 100 times: ~10,100 values for whoever reads them
    items = ", ".join(["1"] * 100)
    uses = ", ".join([f"u{i}: *v" for i in range(100)])
    path = tmp_path / "job.yaml"
    path.write_text(f"model: {{name: 'pkg.mod:build', kwargs: {{v: &v [{items}], {uses}}}}}\n")
    with pytest.raises(ConfigError, match="MAX_CONFIG_NODES"):
        load_config(path)


def test_a_few_aliases_still_load_as_yaml_gives_them(tmp_path: Path, parser: str) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(
        "defaults: &d {steps: 3, lr: 0.01}\n"
        "train: *d\n"
        "model: {name: 'pkg.mod:build', kwargs: {widths: &w [8, 16], again: *w}}\n"
    )
    raw = read_yaml_file(path)
    assert raw["train"] == {"steps": 3, "lr": 0.01}
    assert raw["model"]["kwargs"] == {"widths": [8, 16], "again": [8, 16]}


def test_an_alias_inside_the_value_it_names_is_refused(parser: str) -> None:
    with pytest.raises(ConfigError) as excinfo:
        load_config(None, ["model.name=pkg.mod:build", "model.kwargs=&loop {me: *loop}"])
    assert "*loop" in _refusal(excinfo)


@pytest.mark.parametrize("brackets", ["[]", "{}"])
def test_deep_nesting_is_refused_in_one_line_not_a_recursion_error(
    tmp_path: Path, brackets: str, parser: str
) -> None:
    opening, closing = brackets
    deep = tmp_path / "deep.yaml"
    deep.write_text("model:\n  kwargs: " + (opening + "a: " * (closing == "}")) * 5000 + "1"
                    + closing * 5000 + "\n")  # fmt: skip
    with pytest.raises(ConfigError) as excinfo:
        load_config(deep)
    line = _refusal(excinfo)
    assert str(deep) in line and "MAX_CONFIG_DEPTH" in line


def test_block_style_nesting_is_bounded_too(tmp_path: Path, parser: str) -> None:
    deep = tmp_path / "deep.yaml"
    deep.write_text("".join(f"{'  ' * i}k{i}:\n" for i in range(MAX_CONFIG_DEPTH + 5)) + "\n")
    with pytest.raises(ConfigError, match="MAX_CONFIG_DEPTH"):
        read_yaml_file(deep)


def test_nesting_within_the_limit_loads(tmp_path: Path, parser: str) -> None:
    depth = MAX_CONFIG_DEPTH - 3  # the job's mapping, model, kwargs, then this
    path = tmp_path / "job.yaml"
    path.write_text("model: {name: 'pkg.mod:build', kwargs: " + "{a: " * depth + "1"
                    + "}" * depth + "}\n")  # fmt: skip
    cfg = load_config(path)
    node = cfg.model.kwargs
    for _ in range(depth - 1):
        node = node["a"]
    assert node == {"a": 1}


def test_a_file_larger_than_the_limit_is_refused_unread(tmp_path: Path) -> None:
    big = tmp_path / "big.yaml"
    big.write_text("name: big\n" + "#" * MAX_CONFIG_BYTES + "\n")
    with pytest.raises(ConfigError) as excinfo:
        load_config(big)
    line = _refusal(excinfo)
    assert str(big) in line and "MAX_CONFIG_BYTES" in line


def test_a_file_of_exactly_the_limit_is_read(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    head = "name: edge\n"
    path.write_text(head + "#" * (MAX_CONFIG_BYTES - len(head) - 1) + "\n")
    assert path.stat().st_size == MAX_CONFIG_BYTES
    assert load_config(path).name == "edge"


def test_a_set_value_larger_than_the_limit_is_refused() -> None:
    with pytest.raises(ConfigError) as excinfo:
        load_config(None, ["name=" + "x" * (MAX_CONFIG_BYTES + 1)])
    line = _refusal(excinfo)
    assert line.startswith("--set name:") and "MAX_CONFIG_BYTES" in line


def test_a_huge_value_is_quoted_short_in_the_error_line() -> None:
    with pytest.raises(ConfigError) as excinfo:
        load_config(None, ["train.steps=" + "9x" * 200_000])
    line = _refusal(excinfo)
    assert line.startswith("train.steps:") and "..." in line and line.count("9x") < 50


def test_a_huge_value_that_a_validator_quotes_is_cut_short_too() -> None:
    with pytest.raises(ConfigError) as excinfo:  # ModelConfig quotes model.name itself
        load_config(None, ["model.name=" + "n" * 500_000])
    line = _refusal(excinfo)
    assert line.startswith("model.name=") and "use gpt, llama" in line


def test_an_unparsable_set_value_stays_text_as_before() -> None:
    cfg = load_config(None, ["data.source=[not yaml", "train.steps=3"])
    assert cfg.data.source == "[not yaml" and cfg.train.steps == 3


def test_the_saved_config_of_an_accepted_alias_is_bounded_by_the_node_limit() -> None:
    # aliases expanding to just under the limit: the resolved config.yaml holds them
    # all, expanded, and is still small (the 40 MB config.yaml of the finding was this)
    row = "[" + ", ".join(["0"] * 99) + "]"
    kwargs = (
        f"{{r: &r {row}, m: &m [{', '.join(['*r'] * 9)}], t: [*m, *m, *m, *m, *m, *m, *m, *m]}}"
    )
    cfg = load_config(None, ["model.name=pkg.mod:build", f"model.kwargs={kwargs}"])
    assert len(dump_config(cfg)) < 40 * MAX_CONFIG_NODES


def test_every_error_line_is_bounded_whatever_it_quotes() -> None:
    assert len(str(MeshforgeError("x" * 10**6))) <= MAX_ERROR_CHARS
    assert len(quote(list(range(10**6)))) <= 80
    assert len(quote("y" * 10**6)) <= 80
    assert shorten("short") == "short"
    cut = shorten("a" * 5000 + "END", 100)
    assert len(cut) <= 100 and cut.endswith("END") and cut.startswith("aaa")


def test_the_limits_are_stated_and_documented() -> None:
    docs = (Path(__file__).resolve().parents[2] / "docs" / "job-config.md").read_text()
    for name in ("MAX_CONFIG_BYTES", "MAX_CONFIG_NODES", "MAX_CONFIG_DEPTH"):
        assert isinstance(getattr(config_module, name), int)
        assert name in docs


def test_deep_nesting_in_set_is_refused_naming_the_option(parser: str) -> None:
    deep = "[" * 5000 + "]" * 5000
    with pytest.raises(ConfigError) as excinfo:
        load_config(None, ["model.name=pkg.mod:build", f"model.kwargs={deep}"])
    line = _refusal(excinfo)
    assert line.startswith("--set model.kwargs:") and "MAX_CONFIG_DEPTH" in line


def test_a_huge_set_key_is_quoted_short() -> None:
    with pytest.raises(ConfigError) as excinfo:
        load_config(None, ["train." + "k" * 500_000 + "=1"])
    line = _refusal(excinfo)
    assert line.startswith("--set train.kkk") and "no key 'kkk" in line
