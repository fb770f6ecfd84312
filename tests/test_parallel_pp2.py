"""Pipeline parallel 2 (``parallel=pp2``) trains step for step like one process.

Two spawned jobs on CPU/gloo run ``nano_hybrid.train``'s own step (``train_step``: megatron's pipeline
schedule, ``finalize_model_grads``, the Megatron optimizer and scheduler) on model=tiny with all layer
kinds on both stages (``M*EM*E``): first one process (``parallel=single``), then two pipeline stages
that start from the one-process initial weights (stage r holds layers 3r..3r+2). Over three steps of
two micro-batches each (1F1B with warm-up and cool-down), the loss, grad norm, lr and MoE aux loss of
every step and every final weight must equal the one-process run's.
"""

from __future__ import annotations

import json
import os
import warnings

import torch
from gloo_ranks import spawn_ranks

warnings.filterwarnings("ignore", message=".*Transformer Engine.*")

OVERRIDES = ["model=tiny", "model.hybrid_override_pattern=M*EM*E", "kernels.backend=torch", "data=mock",
             "model.seq_length=32", "train.seq_length=32", "train.micro_batch_size=2", "train.global_batch_size=4",
             "train.train_iters=3", "train.device=cpu", "optim.warmup_iters=1", "optim.lr=3e-3",
             "logger.wandb.mode=disabled"]
STEPS = 3


def _batches(n, mbs=2, s=32):
    g = torch.Generator().manual_seed(7)
    for _ in range(n):
        tok = torch.randint(0, 256, (mbs, s + 1), generator=g)
        yield {"tokens": tok[:, :-1], "labels": tok[:, 1:], "position_ids": torch.arange(s)[None].expand(mbs, s),
               "loss_mask": torch.ones(mbs, s)}


def _worker(rank, world, out_dir, layout):
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")

    from megatron.core import parallel_state as ps

    from nano_hybrid.config import compose
    from nano_hybrid.parallel import destroy_parallel
    from nano_hybrid.runconfig import validate
    from nano_hybrid.trainer import Trainer, TrainState, build_model_and_optimizer, init_distributed

    cfg = compose([*OVERRIDES, f"parallel={layout}"])
    plan = validate(cfg)
    init_distributed(plan, cfg)
    model, optimizer, scheduler = build_model_and_optimizer(plan, cfg)
    module = model.module
    init_path = os.path.join(out_dir, "init.pt")
    pp_rank, pp = ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size()
    offset = pp_rank * (len(cfg.model.hybrid_override_pattern) // pp)

    def global_name(k):  # this stage's layer j is layer offset + j of the one-process model
        if k.startswith("decoder.layers."):
            j, rest = k[len("decoder.layers."):].split(".", 1)
            return f"decoder.layers.{int(j) + offset}.{rest}"
        return k

    if layout == "single":
        torch.save({k: v.clone() for k, v in module.state_dict().items() if v is not None}, init_path)
    else:
        full = torch.load(init_path)
        local = {k: full[global_name(k)] for k, v in module.state_dict().items() if v is not None}
        module.load_state_dict(local, strict=False)
        assert all(torch.equal(v, local[k]) for k, v in module.state_dict().items() if v is not None)
    ctx = Trainer(cfg=cfg, plan=plan, run_dir=None, model=model, optimizer=optimizer, scheduler=scheduler,
                  dataset=None, state=TrainState(), logger=None, flops_per_token=0.0,
                  data_iterator=_batches(STEPS * plan.num_microbatches), attention_mask=None)
    steps = [ctx.train_step() for _ in range(STEPS)]
    weights = {global_name(k): v.detach().clone() for k, v in module.state_dict().items() if v is not None}
    torch.save(weights, os.path.join(out_dir, f"{layout}_weights_{rank}.pt"))
    if rank == 0:
        with open(os.path.join(out_dir, f"{layout}_steps.json"), "w") as f:
            json.dump({"steps": steps, "pp": pp, "layers": [len(module.decoder.layers)]}, f)
    destroy_parallel()


def test_pp2_trains_like_one_process(tmp_path):
    for layout, world in (("single", 1), ("pp2", 2)):
        spawn_ranks(_worker, world, str(tmp_path), layout)
    ref = json.loads((tmp_path / "single_steps.json").read_text())
    pp2 = json.loads((tmp_path / "pp2_steps.json").read_text())
    assert (ref["pp"], pp2["pp"]) == (1, 2) and pp2["layers"] == [3]
    assert len(pp2["steps"]) == STEPS
    for a, b in zip(ref["steps"], pp2["steps"]):
        assert set(a) == set(b) and "seq_load_balancing_loss" in a
        for key in a:
            assert abs(a[key] - b[key]) <= 1e-6 * max(1.0, abs(a[key])), (key, a[key], b[key])
    assert ref["steps"][-1]["loss"] < ref["steps"][0]["loss"]  # it trains
    one = torch.load(tmp_path / "single_weights_0.pt")
    stages = [torch.load(tmp_path / f"pp2_weights_{r}.pt") for r in range(2)]
    assert not set(stages[0]) & {k for k in stages[1] if k.startswith("decoder.layers.")}
    merged = {**stages[0], **stages[1]}
    assert set(merged) == set(one)
    for k, v in one.items():
        torch.testing.assert_close(merged[k], v, rtol=1e-5, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}")
