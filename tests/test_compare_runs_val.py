"""compare_runs.py compares validation loss when every run has it (val_loss records from train.eval_interval)."""

from nano_hybrid.bench import compare_runs as cr


def records(losses, vals, every=5):
    out = []
    for i, loss in enumerate(losses, start=1):
        rec = {"step": i, "loss": loss, "step_time_s": 0.1, "tokens": 100 * i, "tokens_per_s_per_gpu": 1000.0}
        if i % every == 0:
            rec.update(val_loss=vals[i // every - 1], val_ppl=2.0)
        out.append(rec)
    return out


def test_val_loss_compared():
    a = cr.run_from_records("a", records([3.0 - 0.01 * i for i in range(20)], [2.9, 2.8, 2.7, 2.6]))
    b = cr.run_from_records("b", records([3.0 - 0.01 * i for i in range(20)], [2.9, 2.8, 2.7, 2.652]))
    assert a.val_steps.tolist() == [5, 10, 15, 20] and a.val_loss.tolist() == [2.9, 2.8, 2.7, 2.6]
    result = cr.compare([a, b], warmup=0)
    (d,) = result["val_loss_diff"]
    assert d["matching_evals"] == 4 and d["last_step"] == 20
    assert abs(d["final_rel_diff"] - 0.02) < 1e-12 and abs(d["max_abs_rel_diff"] - 0.02) < 1e-12
    assert "val loss b vs a over 4 common evaluations" in cr.format_report(result)
    # W&B names (val/loss) are read too; a run without validation leaves the comparison out
    wb = cr.run_from_records("w", [{"train/step": 1, "train/loss": 1.0, "train/step_time_s": 0.1, "train/tokens": 10,
                                    "val/loss": 0.9}])
    assert wb.val_loss.tolist() == [0.9]
    plain = cr.run_from_records("p", records([3.0] * 20, [], every=100))
    assert "val_loss_diff" not in cr.compare([a, plain], warmup=0)
