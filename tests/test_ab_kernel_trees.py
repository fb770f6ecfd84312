"""scripts/ab_kernel_trees.py on CPU: each process imports the kernels of its tree, a process that imported another
tree's is refused, the summary's ratios and control, and the refusals before any work (the timing needs CUDA)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from nano_hybrid.bench import ab_kernel_trees as ab
from nano_hybrid.bench import environment

ROOT = Path(__file__).resolve().parents[1]


def _tree(tmp_path: Path, name: str) -> Path:
    (tmp_path / name / "kernels").mkdir(parents=True)
    (tmp_path / name / "kernels" / "__init__.py").write_text("")
    return tmp_path / name


def test_a_process_imports_the_kernels_of_its_tree(tmp_path, monkeypatch):
    """The environment and interpreter flags of a tree's process put that tree's kernels ahead of this repository's,
    also when it runs from this repository's folder, and nothing else of the tree (a whole checkout's nano_hybrid
    stays behind); the variables that change kernel settings are not passed on, and the config cache is its own."""
    tree = _tree(tmp_path, "ref")
    (tree / "nano_hybrid").mkdir()
    (tree / "nano_hybrid" / "__init__.py").write_text("raise ImportError('the tree nano_hybrid was imported')")
    monkeypatch.setenv("NANO_HELION_DEBUG_SOMETHING", "1")
    link = ab.link_folder(tree, tmp_path / "path")
    assert ab.link_folder(tree, tmp_path / "path") == link  # again: the link is replaced
    env = ab.worker_env(link, tmp_path / "cache")
    assert "NANO_HELION_DEBUG_SOMETHING" not in env and env["XDG_CACHE_HOME"] == str(tmp_path / "cache")
    assert env["PYTHONPATH"].split(":")[:2] == [str(link), str(environment.REPO_ROOT)]
    cmd = ab.bench_command("nano", 1, 1, tmp_path / "o")
    assert cmd[1] == "-P" and cmd[2].endswith("scripts/bench_kernels.py")
    code = ("from nano_hybrid.bench import environment; import kernels; "
            "print(kernels.__file__); print(environment._kernels_dir())")
    r = subprocess.run([sys.executable, "-P", "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, check=True)
    got, where = r.stdout.split()
    assert Path(got).resolve() == tree / "kernels" / "__init__.py" and Path(where).resolve() == tree / "kernels"
    # without -P the working directory (this repository) would come first
    r = subprocess.run([sys.executable, "-c", "import kernels; print(kernels.__file__)"], env=env, cwd=ROOT,
                       capture_output=True, text=True, check=True)
    assert Path(r.stdout.strip()) == ROOT / "kernels" / "__init__.py"


def test_the_order_alternates_by_pairs():
    assert ab.order(3) == [(1, "reference"), (1, "current"), (2, "current"), (2, "reference"),
                           (3, "reference"), (3, "current")]


# a stand-in for scripts/bench_kernels.py: its JSON, with device times from the kernels package it imports
_STUB = """
import argparse, json, sys
from pathlib import Path
import kernels
from nano_hybrid.bench import environment
p = argparse.ArgumentParser()
for k in ("--backend", "--compare", "--shape", "--rounds", "--iters", "--out"):
    p.add_argument(k)
a = p.parse_args()
if getattr(kernels, "FAIL", False):
    sys.exit(3)
rows = [{"kernel": "k", "us_per_iter": kernels.US}]
res = {"env": environment.env_info(),
       "times_ms": {"helion": {"mixer_fwdbwd": {"median": kernels.US / 1000}},
                    "mamba_ssm": {"mixer_fwdbwd": {"median": 5.0}}},
       "kernels": {"helion": {"total_us_per_iter": kernels.US, "rows": rows},
                   "mamba_ssm": {"total_us_per_iter": 6000.0, "rows": []}}}
Path(a.out).mkdir(parents=True, exist_ok=True)
(Path(a.out) / f"kernels_mamba_ssm_vs_helion_{a.shape}.json").write_text(json.dumps(res))
"""


def test_the_whole_run_with_a_stand_in_for_the_bench(tmp_path, monkeypatch, capsys):
    """main() end to end (a stand-in for bench_kernels, no GPU): each tree's processes run its kernels, the summary
    and report are written; a failing process stops the run with one line and exit 1."""
    import torch

    stub = tmp_path / "bench_stub.py"
    stub.write_text(_STUB)
    monkeypatch.setattr(ab, "_BENCH", stub)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(environment, "env_info", lambda: {"gpu": "stand-in"})  # this process's own env
    ref, cur = _tree(tmp_path, "ref"), _tree(tmp_path, "cur")
    (ref / "kernels" / "__init__.py").write_text("US = 3000.0\n")
    (cur / "kernels" / "__init__.py").write_text("US = 2500.0\n")
    out = tmp_path / "out"
    assert ab.main(["--reference-tree", str(ref), "--current-tree", str(cur), "--processes", "2", "--out", str(out)]) == 0
    res = json.loads((out / "ab_kernel_trees_nano.json").read_text())
    assert res["summary"]["helion_device_x"] == pytest.approx(1.2)
    assert res["summary"]["control_mamba_ssm_device_x"] == pytest.approx(1.0)
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(("reference_", "current_"))) == \
        ["current_1", "current_2", "reference_1", "reference_2"]
    assert "| `k` | 3000.0 | 2500.0 |" in (out / "ab_kernel_trees_nano.md").read_text()
    capsys.readouterr()
    (cur / "kernels" / "__init__.py").write_text("US = 2500.0\nFAIL = True\n")
    assert ab.main(["--reference-tree", str(ref), "--current-tree", str(cur), "--out", str(tmp_path / "o2")]) == 1
    err = capsys.readouterr().err
    assert "the current process 1 failed (rc 3)" in err and err.count("\n") == 1


def _result(helion_us: float, mamba_us: float, helion_ms: float, mamba_ms: float, kernels_dir: str,
            rows: dict[str, float]) -> dict:
    return {"env": {"kernels_dir": kernels_dir},
            "times_ms": {"helion": {"mixer_fwdbwd": {"median": helion_ms}},
                         "mamba_ssm": {"mixer_fwdbwd": {"median": mamba_ms}}},
            "kernels": {"helion": {"total_us_per_iter": helion_us,
                                   "rows": [{"kernel": k, "us_per_iter": v} for k, v in rows.items()]},
                        "mamba_ssm": {"total_us_per_iter": mamba_us, "rows": []}}}


def test_a_run_of_another_tree_is_refused(tmp_path):
    tree, other = _tree(tmp_path, "ref"), _tree(tmp_path, "other")
    out = tmp_path / "o"
    out.mkdir()
    f = out / "kernels_mamba_ssm_vs_helion_nano.json"
    f.write_text(json.dumps(_result(1, 1, 1, 1, str(other / "kernels"), {})))
    with pytest.raises(RuntimeError, match="imported kernels from .*other/kernels, not from that tree"):
        ab.read_run(out, "nano", tree)
    f.write_text(json.dumps(_result(1, 1, 1, 1, str(tree / "kernels"), {})))
    assert ab.read_run(out, "nano", tree)["kernels"]["helion"]["total_us_per_iter"] == 1


def test_summary_ratios_control_and_kernels_side_by_side():
    runs = {
        "reference": [_result(3200, 6000, 3.0, 5.0, "r", {"dx": 560, "dc_dcb": 322, "old_only": 5}),
                      _result(3160, 6060, 3.2, 5.2, "r", {"dx": 558, "dc_dcb": 324, "old_only": 5})],
        "current": [_result(3100, 6030, 2.9, 5.1, "c", {"dx": 560, "dc_dcb": 280, "new_only": 7}),
                    _result(3060, 6030, 3.1, 5.1, "c", {"dx": 562, "dc_dcb": 282, "new_only": 7})],
    }
    s = ab.summarize(runs)
    assert s["helion_device_x"] == pytest.approx(3180 / 3080)
    assert s["control_mamba_ssm_device_x"] == pytest.approx(1.0)
    assert s["helion_per_call_x"] == pytest.approx(3.1 / 3.0)
    assert s["control_mamba_ssm_per_call_x"] == pytest.approx(5.1 / 5.1)
    assert s["trees"]["reference"]["device_us"]["helion"] == [3200, 3160]
    k = {r["kernel"]: r for r in s["kernels"]}
    assert [r["kernel"] for r in s["kernels"]][:2] == ["dx", "dc_dcb"]  # the largest first
    assert k["dc_dcb"]["reference_us"] == pytest.approx(323) and k["dc_dcb"]["current_us"] == pytest.approx(281)
    assert k["old_only"]["current_us"] is None and k["new_only"]["reference_us"] is None
    md = ab.markdown({"summary": s, "shape": "nano", "env": {"gpu": "GPU"}, "reference_tree": "r", "current_tree": "c",
                      "processes": 2, "command": "ab_kernel_trees.py"})
    assert "| helion device us per fwd+bwd | 3200.0, 3160.0 | 3100.0, 3060.0 | 1.032x |" in md
    assert "| `dc_dcb` | 323.0 | 281.0 |" in md and "| `new_only` | - | 7.0 |" in md


@pytest.mark.parametrize("args, says", [
    ([], "--reference-tree DIR is required"),
    (["--reference-tree", "{missing}"], "has no kernels/ package"),
    (["--reference-tree", str(ROOT)], "the reference tree's kernels/ is the current tree's"),
    (["--reference-tree", "{ref}", "--processes", "x"], "argument --processes: invalid int value: 'x'"),
    (["--reference-tree", "{ref}", "--shape", "huge"], "--shape: unknown 'huge'"),
    (["--reference-tree", "{ref}", "--processes", "0"], "--processes must be at least 1"),
])
def test_bad_arguments_fail_before_any_work(tmp_path, capsys, args, says):
    ref = _tree(tmp_path, "ref")
    args = [a.format(missing=tmp_path / "nope", ref=ref) for a in args]
    try:
        rc = ab.main(args + ["--out", str(tmp_path / "out")])
    except SystemExit as e:  # argparse's own errors
        rc = e.code
    assert rc == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the refusal of a host without CUDA")
def test_no_cuda_is_refused_with_one_line(tmp_path, capsys):
    assert ab.main(["--reference-tree", str(_tree(tmp_path, "ref")), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "needs a CUDA GPU" in err and err.count("\n") == 1


def test_report_headers_say_when_the_tree_is_not_the_commit(tmp_path):
    """A benchmark's header line names a tree whose files differ from git_commit, and kernels imported from
    another tree; the repository's own kernels at its commit add nothing."""
    from nano_hybrid.bench import reporting

    env = {"gpu": "GPU", "git_commit": "abc1234", "git_dirty": False, "kernels_dir": str(ROOT / "kernels")}
    assert reporting.env_markdown(env) == "gpu GPU, git_commit abc1234"
    other = _tree(tmp_path, "ref") / "kernels"
    line = reporting.env_markdown(dict(env, git_dirty=True, kernels_dir=str(other)))
    assert line == f"gpu GPU, git_commit abc1234, files differ from git_commit, kernels from {other}"
    line = reporting.env_markdown(dict(env, git_dirty=True, git_tree="1d7020907c"))
    assert line == "gpu GPU, git_commit abc1234, files differ from git_commit (their git tree 1d7020907c)"


def test_git_tree_names_the_files_as_they_are(tmp_path):
    """git_tree is the tree id of the files git does not ignore, as they are on disk: HEAD's tree when nothing
    differs, and after edits the tree of the commit that would hold them (the checkout's metadata lagging behind);
    ignored files do not count, untracked ones do; the checkout's own index is left as it was."""
    import os
    import shutil
    import subprocess

    from nano_hybrid.bench import environment

    if shutil.which("git") is None:
        pytest.skip("needs git")
    # the machine's git configuration (signing, hooks, status defaults) stays out of it
    env = dict(os.environ, GIT_CONFIG_GLOBAL=os.devnull, GIT_CONFIG_NOSYSTEM="1")

    def git(*a):
        return subprocess.run(["git", "-C", str(tmp_path), *a], check=True, capture_output=True, text=True,
                              env=env).stdout.strip()

    git("init", "-q")
    git("config", "user.email", "t@example.com")
    git("config", "user.name", "t")
    (tmp_path / ".gitignore").write_text("/runs/\n")
    (tmp_path / "a.py").write_text("x = 1\n")
    git("add", "-A")
    git("commit", "-q", "-m", "one")
    head_tree = git("rev-parse", "HEAD^{tree}")
    assert head_tree.startswith(environment.git_tree(tmp_path))
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "result.json").write_text("{}")
    assert head_tree.startswith(environment.git_tree(tmp_path))  # ignored
    (tmp_path / "a.py").write_text("x = 2\n")
    (tmp_path / "b.py").write_text("y = 1\n")
    edited = environment.git_tree(tmp_path)
    assert not head_tree.startswith(edited)
    status = git("status", "--porcelain", "--untracked-files=all")
    assert status == "M a.py\n?? b.py"  # the checkout's index untouched
    assert git("rev-parse", "HEAD^{tree}") == head_tree  # and HEAD
    git("add", "-A")
    git("commit", "-q", "-m", "two")
    assert git("rev-parse", "HEAD^{tree}").startswith(edited)
    assert environment.git_tree(tmp_path / "nowhere") is None
