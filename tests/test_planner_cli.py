"""tools/plan_schedule.py as a user meets it: counts written as people write them, and advice that
says what it rests on and how far beyond its study points the model asked about lies."""

import json
import math
import re

import pytest

from launch_helpers import load_tool
from megatron_multilevel.study.planner import StudyPoint, plan

SCHEDULE = {"cycle": "f", "num_levels": 2, "coarse_share": 0.8, "revisit": 0.5, "ea": 0.1}


def _tool():
    return load_tool("plan_schedule")


def _point(name, parameters, tpp, saving):
    return StudyPoint(point=name, study="made-up", shape="4x64", parameters=parameters, tokens_per_parameter=tpp,
                      method="fcycle2", saving=saving, schedule=SCHEDULE, control_seeds=None)


# two sizes (no size term), 0.1 to 100 tokens per parameter
POINTS = [_point("a", 1e5, 0.1, 0.40), _point("b", 7e6, 1.0, 0.30), _point("c", 1e5, 10.0, 0.20),
          _point("d", 7e6, 100.0, 0.10)]


@pytest.mark.parametrize("text, value", [("1.3B", 1.3e9), ("350M", 350e6), ("20B", 20e9), ("125k", 125e3),
                                         ("1.3e9", 1.3e9), ("2T", 2e12), ("350m", 350e6), ("124_000_000", 124e6),
                                         (" 7 B ", 7e9), ("236928", 236928.0)])
def test_counts_as_people_write_them(text, value):
    assert _tool().parse_count(text) == pytest.approx(value)


@pytest.mark.parametrize("text", ["1.3X", "abc", "", "1.2.3M", "-5", "0", "1e999", "M"])
def test_a_garbled_count_is_a_clear_error(text, capsys):
    tool = _tool()
    with pytest.raises(ValueError, match=r"is not a positive count; give a number with an optional suffix k, M, B "
                                         r"or T .* e\.g\. 350M, 1\.3B, 125k or 1\.3e9"):
        tool.parse_count(text)
    with pytest.raises(SystemExit):
        tool.main(["--params", text, "--tokens", "1B"])
    assert f"argument --params: {text!r} is not a positive count" in capsys.readouterr().err


def test_the_advice_says_how_far_beyond_its_points_it_reaches():
    """A model 50 times the largest study point, at 5 times the most tokens per parameter: the
    advice names both ranges and both factors; inside the ranges, neither is said."""
    tool = _tool()
    far = plan(POINTS, 350e6, 350e6 * 500)
    assert far["parameters_range"] == [1e5, 7e6] and not far["size_term"]
    assert far["beyond"] == {"parameters": pytest.approx(50.0), "tokens_per_parameter": pytest.approx(5.0),
                             "layers": None}  # no depth given
    assert far["from_point_size"] == {"parameters": 7e6, "tokens_per_parameter": 100.0}
    said = tool.describe(far)
    assert "model: 350M parameters (embedding counted), 175B tokens: 500.0 tokens per parameter" in said
    assert "law fitted to 4 study points of 100k to 7M parameters and 0.10 to 100.0 tokens per parameter" in said
    assert ("model size beyond the study points: 50 times the largest (7M parameters); the law has no size term"
            in said)
    assert "its saving is that of models of 100k to 7M parameters: an extrapolation, not a measurement" in said
    assert "tokens per parameter beyond the study points: 5 times the most (100)" in said
    assert "nearest measured point, d: 7M parameters at 100.0 tokens per parameter" in said
    small = tool.describe(plan(POINTS, 1e4, 1e4 * 0.01))
    assert "1/10 of the smallest (100k parameters)" in small and "1/10 of the fewest (0.1)" in small
    inside = plan(POINTS, 1e6, 1e6 * 5)
    assert inside["beyond"] == {"parameters": 1.0, "tokens_per_parameter": 1.0, "layers": None}
    assert "beyond the study points" not in tool.describe(inside)


def test_the_tool_takes_suffixed_counts(tmp_path, capsys):
    rows = [{"point": p.point, "shape": p.shape, "parameters": p.parameters,
             "tokens_per_parameter": p.tokens_per_parameter,
             "methods": {"fcycle2": {"family": "fcycle", "equal_quality": {"median": p.saving},
                                     "schedule": SCHEDULE, "smaller_model_suffices": None}}} for p in POINTS]
    (tmp_path / "regime.json").write_text(json.dumps({"commit": "a" * 40, "points": rows, "leads": []}))
    tool = _tool()
    assert tool.main(["--params", "350M", "--tokens", "7B", "--benchmarks", str(tmp_path), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert (result["parameters"], result["tokens"]) == (350e6, 7e9)
    assert result["beyond"]["parameters"] == pytest.approx(50.0)
    assert math.isclose(result["tokens_per_parameter"], 20.0)


def _lines(capsys, *argv) -> list[str]:
    assert _tool().main(list(argv)) == 0
    return capsys.readouterr().out.splitlines()


@pytest.mark.parametrize("params, tokens, law", [
    ("1.3B", "26B", "at 20 tokens per parameter the full model is near compute-optimal (Hoffmann et al. 2022: "
                    "about 20 tokens per parameter): train it from scratch; nothing measured here at this size"),
    ("124M", "2.5B", "at 20.2 tokens per parameter the full model is near compute-optimal"),
    ("1.3B", "2.6B", "at 2 tokens per parameter the model is larger than compute-optimal for its compute: Hoffmann "
                     "et al. (2022) put the compute-optimal model for the same FLOPs at about 411M parameters on "
                     "8.22B tokens"),
])
def test_beyond_the_measured_sizes_it_says_what_was_measured_and_what_published_laws_say(capsys, params, tokens, law):
    """The committed study points (models of at most a few million parameters): at a GPT-2 or a 1.3B
    size no line advises; the measured sizes, budgets and seeds are said, then the published laws;
    every line that carries the points' verdicts to this size says it is an extrapolation."""
    lines = _lines(capsys, "--params", params, "--tokens", tokens)
    assert not any(line.startswith(("advice:", "candidate:")) for line in lines), lines
    measured = next(line for line in lines if line.startswith("no advice: nothing was measured at this size: "))
    assert re.search(r"the study's \d+ points are models of [\d.]+k to [\d.]+M parameters at [\d.]+ to [\d.]+ tokens "
                     r"per parameter, \d+ to \d+ seeds each, and this model is [\d.]+ times the largest", measured)
    assert any(line.startswith("published scaling laws: ") and law in line for line in lines), lines
    carried = [line for line in lines if "smaller (half-depth) model" in line or "best schedule" in line
               or line.startswith(("expected FLOPs saving", "extrapolated"))]
    assert carried and all(line.startswith("extrapolated, not measured at this size: ") for line in carried), carried


def test_inside_the_measured_sizes_it_advises(capsys):
    lines = _lines(capsys, "--params", "237k", "--tokens", "19M", "--layers", "4")
    assert any(line.startswith("advice: ") for line in lines) and not any("no advice" in line for line in lines)
    assert not any(line.startswith("extrapolated") for line in lines)
