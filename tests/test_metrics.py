"""MetricsLogger: metrics.jsonl records, console line, rank-0-only writing, W&B offline run."""

import json

import pytest

from nano_hybrid.metrics import MetricsLogger, format_console_line

REC = {"step": 3, "tokens": 3072, "loss": 2.5, "lr": 1e-3, "grad_norm": 0.7, "step_time_s": 0.25,
       "tokens_per_s": 4096.0, "tflops_per_gpu": 0.01, "mem_gb": 0.9, "seq_load_balancing_loss": 1.02}


def test_jsonl_and_console(tmp_path):
    lines = []
    log = MetricsLogger(tmp_path, rank=0, train_iters=10, backend="torch", print_fn=lambda m, **k: lines.append(m))
    log.log_step(dict(REC))
    log.close()
    rec = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert rec["backend"] == "torch" and rec["loss"] == 2.5 and rec["tokens"] == 3072
    assert lines and lines[0].startswith("step  3/10 | loss 2.5000") and "seq_load_balancing_loss 1.0200" in lines[0]
    assert "eta" in lines[0]


def test_other_ranks_write_nothing(tmp_path):
    log = MetricsLogger(tmp_path / "r1", rank=1, train_iters=10, backend="torch", print_fn=pytest.fail)
    log.log_step(dict(REC))
    log.close()
    assert not (tmp_path / "r1").exists()


def test_eta_ignores_warmup_steps():
    log = MetricsLogger("unused", rank=1, train_iters=10, backend="torch")
    for dt in (30.0, 20.0, 1.0, 1.0):
        log.log_step({**REC, "step_time_s": dt})
    assert log.eta_seconds(4) == pytest.approx(6.0)
    assert "eta 6s" in format_console_line(REC, 10, 6.0)


def test_bad_wandb_mode(tmp_path):
    with pytest.raises(ValueError, match="logger.wandb.mode"):
        MetricsLogger(tmp_path, rank=0, train_iters=1, backend="torch", wandb_cfg={"mode": "cloud"})


def test_wandb_offline_run(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    wcfg = {"mode": "offline", "project": "nano-hybrid-test", "group": "ab", "name": "arm-a", "tags": ["x"], "id": None}
    log = MetricsLogger(tmp_path, rank=0, train_iters=2, backend="torch", wandb_cfg=wcfg, run_config={"a": 1},
                        print_fn=lambda *a, **k: None)
    run_id = log.wandb_run_id
    assert run_id
    log.log_step(dict(REC))
    log.close()
    runs = list((tmp_path / "wandb").glob(f"offline-run-*-{run_id}"))
    assert len(runs) == 1, list((tmp_path / "wandb").iterdir())
