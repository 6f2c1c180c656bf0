"""scripts/compare.py, CI-sized: a 2-loss x 1-lr x 1-seed grid of a few steps on the tiny random checkpoint.
Checks the outputs exist and parse, a rerun skips finished cells, the table is rebuilt from results.json, a cell
run in the grid's process equals the same command line run alone, and every configs/tiny_<loss>.py recipe is
exactly the grid cell it cites."""
import json
import re
import subprocess
import sys

import pytest

from conftest import BUILTIN_LOSSES, ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import compare  # noqa: E402

pytestmark = pytest.mark.slow
SMALL = ["--grpo.rollout.prompts_per_step=8", "--grpo.rollout.group_size=4", "--grpo.rollout.max_tokens=16",
         "--grpo.eval.num_problems=20"]


def grid(out_dir, *args):
    res = subprocess.run([sys.executable, "scripts/compare.py", f"--out_dir={out_dir}", "--seeds=0", "--staleness=1",
                          "--steps=2", "--eval_every=1", *SMALL, *args], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res.stdout


def test_grid_outputs_resume_and_table_from_results(tmp_path, tiny_ckpt):
    (tmp_path / "demo" / "sft").mkdir(parents=True)
    (tmp_path / "demo" / "sft" / "hf").symlink_to(tiny_ckpt)  # the start checkpoint compare looks for first
    out = tmp_path / "compare"
    said = grid(tmp_path, "--losses=grpo,cispo", "--lrs=1e-3")
    assert "2 cells to run, 0 already" in said
    results = json.loads((out / "results.json").read_text())
    cells = results["cells"]
    assert [(c["loss"], c["lr"], c["staleness"], c["seed"]) for c in cells] == [("grpo", 1e-3, 1, 0),
                                                                                 ("cispo", 1e-3, 1, 0)]
    for c in cells:
        assert [s for s, _ in c["evals"]] == [0, 1, 2] and len(c["reward_curve"]) == 2 and c["steps_done"] == 2
        assert c["error"] is None and c["seconds"] > 0 and isinstance(c["diverged"], bool)
        assert c["gain"] == pytest.approx(c["final_accuracy"] - c["start_accuracy"])
    assert results["wall_s"] == pytest.approx(sum(c["seconds"] for c in cells), abs=0.2)
    for png in ("gain_vs_lr.png", "best_curves.png"):
        assert (out / png).stat().st_size > 10_000
    assert (out / "table.md").read_text() == compare.table(cells)

    # resume: nothing left to run; a second lr runs only its two new cells
    assert "0 cells to run, 2 already" in grid(tmp_path, "--losses=grpo,cispo", "--lrs=1e-3")
    assert "2 cells to run, 2 already" in grid(tmp_path, "--losses=grpo,cispo", "--lrs=1e-3,1e-4")
    results = json.loads((out / "results.json").read_text())
    assert len(results["cells"]) == 4 and results["cells"][:2] == cells

    # the table is a function of results.json: edit a cell's gain and rerun with nothing to do
    results["cells"][1]["gain"] = 0.4321
    (out / "results.json").write_text(json.dumps(results))
    grid(tmp_path, "--losses=grpo,cispo", "--lrs=1e-3,1e-4")
    table = (out / "table.md").read_text()
    assert re.search(r"\| cispo \| 0\.001 \| 1 \| 1 \| .* \| \+0\.432 ± 0\.000 \|", table), table

    # a grid cell (run inside compare's process) equals the same command line run alone
    cell = dict(cells[0])
    argv = compare.cell_args(cell, tmp_path / "demo" / "sft" / "hf", tmp_path / "alone", 1,
                             [a.replace("--grpo.", "--") for a in SMALL])
    res = subprocess.run([sys.executable, "train_grpo.py", *argv], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    timing = ("perf/", "sync/seconds", "sync/gbps")  # wall-clock figures; everything else must match exactly
    strip = lambda rows: [{k: v for k, v in r.items() if not k.startswith(timing)} for r in rows]  # noqa: E731
    alone = [json.loads(line) for line in open(tmp_path / "alone" / cell["id"] / "metrics.jsonl")]
    in_grid = [json.loads(line) for line in open(out / "runs" / cell["id"] / "metrics.jsonl")]
    assert strip(alone) == strip(in_grid)


def recipe_cell(text):
    """The cell a recipe cites: `# cell: <loss> lr=<lr> staleness=<s> seed=<seed> steps=<n>`."""
    m = re.search(r"# cell: (\S+) lr=(\S+) staleness=(\d) seed=(\d+) steps=(\d+)", text)
    assert m, "a recipe names its grid cell"
    return dict(loss=m[1], lr=float(m[2]), staleness=int(m[3]), seed=int(m[4]), steps=int(m[5]), id="x")


@pytest.mark.parametrize("name", BUILTIN_LOSSES)
def test_tiny_recipe_is_its_grid_cell(name, monkeypatch):
    """configs/tiny_<loss>.py parses to exactly the config of the grid cell it cites (log fields
    aside): a built-in's (conftest.BUILTIN_LOSSES), since a loss a fork adds runs in the grid with
    its defaults and needs no recipe."""
    import train_grpo
    monkeypatch.chdir(ROOT)
    path = ROOT / "configs" / f"tiny_{name}.py"
    text = path.read_text()
    assert "scripts/compare.py" in text
    cell = recipe_cell(text)
    assert compare.KNOBS[cell["loss"]][0] == name
    start = "out/demo/sft/hf" if (ROOT / "out/demo/sft/hf/config.json").exists() else "tiny:out/tiny/init"
    mine = vars(train_grpo.parse_config([f"configs/tiny_{name}.py"]))
    grid_cfg = vars(train_grpo.parse_config(compare.cell_args(cell, start, "out", compare.EVAL_EVERY, [])))
    for section in mine:
        if section != "log":
            assert mine[section] == grid_cfg[section], (name, section)
    assert mine["log"].run == f"tiny_{name}"
