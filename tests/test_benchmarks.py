import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_harness_runs_one_quick_case_and_writes_three_files(tmp_path):
    command = [sys.executable, "-m", "benchmarks.run", "--only", "demo", "--quick", "--out", str(tmp_path)]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    for ext in ("md", "json", "png"):
        assert (tmp_path / f"demo.{ext}").stat().st_size > 0
    payload = json.loads((tmp_path / "demo.json").read_text())
    baseline = payload["results"]["baseline"]
    assert baseline["optimizer_state_bytes"] > 0 and baseline["step_time_s"] > 0
    assert payload["ratios"]["baseline"]["step_time_s"] == 1.0
    assert "| baseline | tokens_per_s |" in (tmp_path / "demo.md").read_text()


def test_rounds_merge_into_medians_with_their_spread():
    sys.path.insert(0, str(REPO))
    from benchmarks.harness import median_over_rounds

    merged = median_over_rounds([{"samples_per_s": 9.0, "note": "a"}, {"samples_per_s": 3.0, "note": "b"},
                                 {"samples_per_s": 5.0, "note": "c"}])
    assert merged == {"samples_per_s": 5.0, "samples_per_s_min": 3.0, "samples_per_s_max": 9.0,
                      "samples_per_s_rounds": [9.0, 3.0, 5.0], "note": "c"}
    assert median_over_rounds([{"x": 1.0}]) == {"x": 1.0}
    assert "error" in median_over_rounds([{"x": 1.0}, {"error": "exit 1"}])


def test_charts_have_one_panel_per_model_and_redraw_from_saved_results(tmp_path):
    """Each chart is drawn per model (ratios within the model, never across models of different sizes)."""
    import shutil

    import matplotlib.image

    from benchmarks.harness import model_groups, redraw

    for name in ("activations", "balance", "tokens_quality"):
        saved = REPO / "benchmarks" / "results" / f"{name}.json"
        shutil.copy(saved, tmp_path / saved.name)
        models = model_groups(json.loads(saved.read_text())["results"])
        assert len(models) == 2, (name, list(models))
        height, width, _ = matplotlib.image.imread(redraw(name, tmp_path)).shape
        assert width >= 2 * height, (name, width, height)  # two side-by-side panels
