"""The training run: setup, the optimizer step, evaluation, the loop and shutdown, on a validated RunPlan.

    plan = nano_hybrid.runconfig.validate(cfg)
    trainer = Trainer.build(cfg, plan)        # process groups, run folder, data, model, optimizer, resume
    trainer.start_data(); trainer.checkpointer.restore_rng()
    trainer.fit(stop)                         # train_step, evaluate, log, checkpoint until train.train_iters
    shutdown(trainer)

One step = ``global_batch_size`` samples: megatron's ``get_forward_backward_func`` runs the micro-batches
(grad accumulation, pipeline schedule when PP > 1) with ``finalize_model_grads`` (DP grad reduction, MoE
router expert-bias update), then the optimizer step (grad clipping inside), then the scheduler step. Tools
(benchmarks, equivalence checks) use the same public pieces: ``Trainer.build``, ``Trainer.train_step``,
``Trainer.forward_backward``, ``build_model_and_optimizer``, ``cpu_compat_mode``, ``sync``, ``shutdown``.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from functools import partial
from pathlib import Path
from typing import Any

from nano_hybrid.errors import RunError, decided_on_rank0, filter_startup_warnings

filter_startup_warnings()  # known harmless megatron-core start-up warnings (no TE/Apex): nano_hybrid/errors.py

import torch  # noqa: E402
from omegaconf import DictConfig, OmegaConf, open_dict  # noqa: E402

from nano_hybrid.checkpoint import Checkpointer  # noqa: E402
from nano_hybrid.data import (  # noqa: E402
    DataPreparationError,
    build_data_iterator,
    build_datasets,
    ensure_corpus,
    missing_paths,
)
from nano_hybrid.runconfig import RunPlan  # noqa: E402


@dataclass
class TrainState:
    """Loop position; the checkpointer saves and restores it (and the data position follows from it)."""

    step: int = 0  # optimizer steps completed
    consumed_samples: int = 0  # global samples consumed (= data position)
    consumed_tokens: int = 0  # global tokens consumed (W&B x-axis)

    def advance(self, samples: int, seq_length: int) -> None:
        self.step += 1
        self.consumed_samples += samples
        self.consumed_tokens += samples * seq_length

    def as_dict(self) -> dict:
        return asdict(self)



def init_distributed(plan: RunPlan, cfg: DictConfig) -> None:
    """Process group (NCCL on GPU, gloo on CPU), megatron's model-parallel groups and RNG streams."""
    from nano_hybrid.parallel import initialize_parallel

    initialize_parallel(cfg, dims=plan.dims, backend="nccl" if plan.device.type == "cuda" else "gloo")


def resolve_run_dir(cfg: DictConfig, plan: RunPlan) -> Path:
    """``cfg.run_dir`` or runs/<model>-<backend>-<UTC time>, taken from rank 0 so all ranks agree."""
    import torch.distributed as dist

    if cfg.run_dir is not None:
        run_dir = str(cfg.run_dir)
    else:
        stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
        box = [f"runs/{cfg.model.name}-{plan.backend_name}-{stamp}"]
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(box, src=0)
        run_dir = box[0]
    with open_dict(cfg):
        cfg.run_dir = run_dir  # later interpolations (e.g. checkpoint.dir) see the resolved path
    return Path(run_dir)


_RUN_LOCK: list = []  # rank 0's lock on run_dir, held until the process exits
_CLAIMED_DIRS: list[Path] = []  # directories claim_run_dir created (removed again when the start is refused)


def claim_run_dir(run_dir: Path, ckpt_dir: Path) -> None:
    """Rank 0: write probes in run_dir and checkpoint.dir, then the exclusive run-dir lock (one line if not)."""
    from nano_hybrid.runlock import RunLock
    from nano_hybrid.storage import check_writable

    for d in (run_dir, ckpt_dir):
        new = [p for p in (d, *d.parents) if not p.exists()]
        _CLAIMED_DIRS.extend(p for p in reversed(new) if p not in _CLAIMED_DIRS)
    check_writable(run_dir, "run_dir")
    check_writable(ckpt_dir, "checkpoint.dir")
    _RUN_LOCK.append(RunLock(run_dir).acquire())


def release_refused_start() -> None:
    """A start refused before its first step leaves the run directory as it found it: the lock goes, and the
    directories the claim created go again when they are still empty."""
    while _RUN_LOCK:
        _RUN_LOCK.pop().release()
    for d in sorted(_CLAIMED_DIRS, key=lambda p: len(p.parts), reverse=True):
        try:
            d.rmdir()
        except OSError:
            pass  # not empty (something was written there) or already gone
    _CLAIMED_DIRS.clear()


def prepare_data(plan: RunPlan, cfg: DictConfig, log) -> None:
    """Build a missing default corpus on rank 0 (others wait); fail loudly if that is impossible."""
    def build() -> None:
        try:
            ensure_corpus(plan.data.paths[0], cfg.data.prepare_if_missing, log=log,
                          tokenizer=plan.tokenizer_spec, workers=int(cfg.data.prepare_workers))
        except DataPreparationError as e:  # shared with the waiting ranks, printed once
            raise RunError(str(e)) from None

    if plan.data.kind == "indexed":
        decided_on_rank0(build)
    missing = missing_paths(plan.data) if plan.data.kind == "indexed" else []
    if missing:  # e.g. rank 0 wrote to a node-local path this rank cannot see
        raise DataPreparationError(f"data path(s) not visible on rank {plan.dims.rank}: {missing}")


def build_dataset(plan: RunPlan, cfg: DictConfig):
    """(train, valid) datasets, built on every rank at once: megatron's builder builds the index cache on rank 0
    first (its own barrier), then the others read it. ``valid`` holds ``eval_iters x global_batch_size`` samples
    (None without validation). A split too small for the run is the same DataConfigError on every rank."""
    gbs = int(cfg.train.global_batch_size)
    num_samples = int(cfg.train.train_iters) * gbs
    return build_datasets(plan.data, plan.tokenizer, plan.seq_length, num_samples, int(cfg.seed), plan.eval_iters * gbs)



def build_model_and_optimizer(plan: RunPlan, cfg: DictConfig, *, init_from_hf: str | None = None,
                              with_optimizer: bool = True):
    """Model -> (Float16Module on bf16) -> Megatron DDP; Megatron optimizer; OptimizerParamScheduler.

    ``init_from_hf``: a Hugging Face Nemotron-H folder whose weights replace the initial ones (each rank
    its own slice), before the optimizer takes its copy of them. ``with_optimizer=False`` (forward+backward
    measurements of models whose optimizer states do not fit) returns ``(ddp, None, None)``: no fp32 main
    weights, no Adam states."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.transformer.module import Float16Module

    from nano_hybrid.model import build_model

    if plan.backend is not None and plan.backend_name != str(cfg.kernels.backend):
        raise ValueError(f"the plan holds kernel backend {plan.backend_name!r} but cfg.kernels.backend is "
                         f"{cfg.kernels.backend!r}: pass plan.for_backend(cfg)")
    model = build_model(cfg, device=plan.device, dtype=plan.dtype, backend=plan.backend)
    if init_from_hf:
        from nano_hybrid.hf import load_hf_weights

        info = load_hf_weights(model, init_from_hf, cfg)
        if plan.dims.is_main:
            print(f"init_from_hf: {info['tensors']} tensors from {init_from_hf} in {info['seconds']:.1f}s", flush=True)
    config = model.config
    if plan.dtype == torch.bfloat16:
        model = Float16Module(config, model)
    use_dist_opt = bool(cfg.parallel.use_distributed_optimizer)
    ddp = DistributedDataParallel(
        config,
        DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            # overlap_param_gather stays off (megatron's default): its per-module forward pre-hooks wait for a module's
            # gathered weights, and with model.mamba_fused_norm the mixer reads its norm's weight without calling the norm
            use_distributed_optimizer=use_dist_opt,
            check_for_nan_in_grad=False,
        ),
        model,
    )
    # What megatron's schedule calls around the micro-batches: DP no_sync for all but the last
    # micro-batch, then finalize_model_grads (grad all-reduce / reduce-scatter, MoE expert-bias update).
    config.no_sync_func = ddp.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    if not with_optimizer:
        return ddp, None, None
    optimizer, scheduler = build_optimizer(plan, cfg, ddp)
    config.grad_scale_func = optimizer.scale_loss
    return ddp, optimizer, scheduler


def build_optimizer(plan: RunPlan, cfg: DictConfig, ddp):
    """Megatron's (distributed) Adam over ``ddp``'s parameters and its OptimizerParamScheduler, from ``cfg.optim``."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from nano_hybrid.optim import lr_schedule, set_adam_fused

    o = cfg.optim
    use_dist_opt = bool(cfg.parallel.use_distributed_optimizer)
    opt_config = OptimizerConfig(
        optimizer="adam",
        lr=float(o.lr),
        min_lr=float(o.min_lr),
        weight_decay=float(o.weight_decay),
        adam_beta1=float(o.adam_beta1),
        adam_beta2=float(o.adam_beta2),
        adam_eps=float(o.adam_eps),
        clip_grad=float(o.clip_grad),
        bf16=plan.dtype == torch.bfloat16,
        params_dtype=plan.dtype,
        use_distributed_optimizer=use_dist_opt,
    )
    with cpu_compat_mode(plan):
        optimizer = get_megatron_optimizer(opt_config, [ddp])
    set_adam_fused(optimizer, bool(o.fused))  # optim.fused: torch's fused AdamW kernel
    sched = lr_schedule(cfg)
    # On resume the checkpoint's schedule must equal this one (Checkpointer.check_resume refuses a difference before
    # any work unless optim.override_scheduler): megatron asserts the equality as a last check, or with the override
    # takes this config's values (its state_dict holds neither init_lr nor the WSD fields, which always come from here).
    override = bool(o.get("override_scheduler", False))
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=sched["init_lr"],
        max_lr=sched["lr"],
        min_lr=sched["min_lr"],
        lr_warmup_steps=sched["warmup_iters"],
        lr_decay_steps=sched["decay_iters"],
        lr_decay_style=sched["decay_style"],
        start_wd=sched["weight_decay"],
        end_wd=sched["weight_decay"],
        wd_incr_steps=sched["decay_iters"],
        wd_incr_style="constant",
        wsd_decay_steps=sched["wsd_decay_iters"],
        lr_wsd_decay_style=sched["wsd_decay_style"],
        use_checkpoint_opt_param_scheduler=False,
        override_opt_param_scheduler=override,
    )
    return optimizer, scheduler


def cpu_compat_mode(plan: RunPlan):
    """megatron's optimizer and schedules hard-code device='cuda' in places; on CPU run them under CudaToCpuMode."""
    if plan.device.type == "cuda":
        return contextlib.nullcontext()
    from nano_hybrid.mcore_compat import CudaToCpuMode

    return CudaToCpuMode()




def sync(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on CPU): what step timings are measured between."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ------------------------------------------------------------------------------------------- step
def _forward_step(data_iterator, model, *, device: torch.device, attention_mask):
    batch = next(data_iterator)
    tokens = batch["tokens"].to(device, non_blocking=True)
    labels = batch["labels"].to(device, non_blocking=True)
    position_ids = batch["position_ids"].to(device, non_blocking=True)
    loss_mask = batch["loss_mask"].to(device, non_blocking=True)
    output = model(tokens, position_ids, attention_mask, labels=labels)  # per-token loss [b, s]
    return output, partial(_loss_func, loss_mask)


def _loss_func(loss_mask: torch.Tensor, output: torch.Tensor):
    losses = output.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss_sum = torch.sum(losses * mask)
    num_tokens = mask.sum().to(torch.int)
    # (loss summed over the micro-batch, its token count, values to report)
    return loss_sum, num_tokens, {"lm loss": torch.stack([loss_sum.detach(), mask.sum()])}


def causal_mask_for(cfg: DictConfig, seq_length: int, device: torch.device):
    """None when core attention applies causal masking itself (sdpa); else megatron's bool mask (True = masked)."""
    from nano_hybrid.model.config import model_dict

    if model_dict(cfg.model)["attention_impl"] == "sdpa" or "*" not in str(cfg.model.hybrid_override_pattern):
        return None
    return torch.triu(torch.ones(seq_length, seq_length, dtype=torch.bool, device=device), diagonal=1)[None, None]


def report_data_epochs(dataset, num_samples: int, seq_length: int, consumed_samples: int, say) -> float | None:
    """Say how many passes over the training split the run reads (and warn when it repeats data); returns it."""
    from nano_hybrid.data import train_split_tokens

    tokens = train_split_tokens(dataset)
    if not tokens:
        return None  # synthetic data (data=mock)
    epochs = num_samples * seq_length / tokens
    left = (num_samples - consumed_samples) * seq_length / tokens
    say(f"data: the training split holds {tokens:,} tokens; the run reads {num_samples:,} samples x {seq_length} "
        f"tokens = {epochs:.3g} epochs" + (f" ({left:.3g} from this start)" if consumed_samples else ""))
    if epochs > 1:
        say(f"warning: the run repeats its training data ({epochs:.1f} epochs): the loss then measures memorisation; "
            "use a larger corpus or fewer train.train_iters for a pretraining curve")
    return epochs


def report_validation_size(valid_dataset, eval_iters: int, global_batch_size: int, seq_length: int, say) -> bool:
    """Warn when one validation reads more tokens than the validation split holds (its samples then repeat within
    an evaluation); returns whether it does."""
    from nano_hybrid.data import train_split_tokens

    tokens = train_split_tokens(valid_dataset)
    need = eval_iters * global_batch_size * seq_length
    if not tokens or need <= tokens:
        return False
    fits = tokens // (global_batch_size * seq_length)
    say(f"warning: each validation reads {need:,} tokens ({eval_iters} x {global_batch_size} samples x {seq_length}) "
        f"but the validation split holds {tokens:,}, so its samples repeat within an evaluation; "
        + (f"set train.eval_iters <= {fits}" if fits else "the split holds less than one global batch: use more "
           "validation data (data.split, data.valid_paths)") + " for a validation loss without repeats")
    return True


def _reduced_loss(reports: list, device: torch.device) -> float:
    """Loss over the global batch: sum(loss), sum(tokens) over micro-batches, then over all ranks (ratios are
    unchanged by TP replicas; PP stages other than the last contribute zeros)."""
    import torch.distributed as dist

    acc = torch.zeros(2, dtype=torch.float64, device=device)
    for r in reports:
        acc += r["lm loss"].to(torch.float64)
    dist.all_reduce(acc)
    return (acc[0] / acc[1].clamp(min=1)).item()


# ---------------------------------------------------------------------------------------- trainer
@dataclass
class Trainer:
    """One training run's live objects; ``Trainer.build`` makes it, ``fit`` trains, ``shutdown`` ends it."""

    cfg: DictConfig
    plan: RunPlan
    run_dir: Path
    model: Any
    optimizer: Any
    scheduler: Any
    dataset: Any
    state: TrainState
    logger: Any
    flops_per_token: float
    attention_mask: Any = None
    data_iterator: Any = None
    checkpointer: Any = None  # nano_hybrid.checkpoint.Checkpointer
    valid_dataset: Any = None  # eval_iters global batches of the validation split (None: no validation)

    @classmethod
    def build(cls, cfg: DictConfig, plan: RunPlan, *, with_optimizer: bool = True, resume: bool = True) -> "Trainer":
        """Distributed state, run folder, data, model (and, unless ``with_optimizer=False``, optimizer and schedule),
        then the checkpoint to resume (``resume``). Nothing is written into the run directory before every check
        and the resume have passed: ``config.yaml``, ``metrics.jsonl`` and W&B start last."""
        return _build(cls, cfg, plan, with_optimizer=with_optimizer, resume=resume)

    @property
    def dp_rank(self) -> int:
        return self.plan.dims.dp_rank

    def start_data(self) -> None:
        """(Re)start the data stream at ``state.consumed_samples`` (call after a checkpoint load)."""
        self.data_iterator = build_data_iterator(
            self.dataset,
            self.state.consumed_samples,
            self.plan.run.train.micro_batch_size,
            self.dp_rank,
            self.plan.dims.dp,
            self.plan.data.num_workers,
        )

    def sync(self) -> None:
        sync(self.plan.device)

    def run_schedule(self, data_iterator, *, forward_only: bool) -> list:
        """Megatron's forward(-backward) schedule over one global batch from ``data_iterator``: the per-micro-batch
        loss reports. The caller provides the context (``cpu_compat_mode``, ``no_grad`` for evaluation)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        plan = self.plan
        return get_forward_backward_func()(
            forward_step_func=partial(_forward_step, device=plan.device, attention_mask=self.attention_mask),
            data_iterator=data_iterator,
            model=[self.model],
            num_microbatches=plan.num_microbatches,
            seq_length=plan.seq_length,
            micro_batch_size=plan.run.train.micro_batch_size,
            decoder_seq_length=plan.seq_length,
            forward_only=forward_only,
        )

    def forward_backward(self) -> list:
        """Zeroed gradients, then forward and backward over one global batch (``num_microbatches`` micro-batches
        from ``data_iterator``); the gradients are left in megatron DDP's buffers (``param.main_grad``).
        Returns the schedule's per-micro-batch loss reports."""
        self.model.zero_grad_buffer()
        if self.optimizer is not None:
            self.optimizer.zero_grad()
        # On CPU the schedule needs CudaToCpuMode too: schedules.py:596 allocates its token counter with
        # device="cuda" (forward_backward_no_pipelining; same in the pipelined schedules).
        with cpu_compat_mode(self.plan):
            return self.run_schedule(self.data_iterator, forward_only=False)

    def train_step(self) -> dict[str, float]:
        """One optimizer step over ``global_batch_size`` samples; returns loss, grad norm, lr and aux losses."""
        from megatron.core.transformer.moe.moe_utils import (
            clear_aux_losses_tracker,
            get_moe_layer_wise_logging_tracker,
            reduce_aux_losses_tracker_across_ranks,
        )

        from nano_hybrid.optim import multi_tensor_ops
        from nano_hybrid.stepguard import guarded_step

        plan = self.plan
        loss = _reduced_loss(self.forward_backward(), plan.device)
        # a non-finite loss or gradient norm skips the update (same on all ranks); optim.multi_tensor picks the ops of
        # the norm, the clipping and the parameter copies
        with cpu_compat_mode(plan), multi_tensor_ops(str(self.cfg.optim.multi_tensor)):
            update_ok, grad_norm = guarded_step(self.optimizer, loss)
        if update_ok:
            self.scheduler.step(increment=1)
        out = {
            "loss": loss,
            "grad_norm": grad_norm,
            "lr": float(self.optimizer.param_groups[0]["lr"]),
            "skipped": 0 if update_ok else 1,
        }
        tracker = get_moe_layer_wise_logging_tracker()
        if tracker:
            reduce_aux_losses_tracker_across_ranks()
            n_moe = max(1, str(self.cfg.model.hybrid_override_pattern).count("E"))
            for name, entry in tracker.items():
                # summed over layers and micro-batches -> mean per MoE layer and micro-batch
                out[name.replace(" ", "_")] = entry["values"].float().sum().item() / n_moe / plan.num_microbatches
            clear_aux_losses_tracker()
        return out

    def evaluate(self) -> dict[str, float]:
        """Validation loss over the first ``eval_iters`` global batches of the validation split, the same batches
        at every evaluation (so the curve compares like with like and a resumed run sees what the uninterrupted
        one saw). Forward only through megatron's schedule (any DP/TP/PP/EP layout; this rank's DP slice of each
        global batch), under no_grad (the MoE router keeps no token counts), the model in eval mode, and the RNG
        state (DataLoader seeds) restored afterwards so training draws the same numbers with or without it."""
        from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

        plan = self.plan
        t0 = time.perf_counter()
        devices = [plan.device] if plan.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            iterator = build_data_iterator(self.valid_dataset, 0, plan.run.train.micro_batch_size, self.dp_rank,
                                           plan.dims.dp, 0)
            self.model.eval()
            reports = []
            try:
                with torch.no_grad(), cpu_compat_mode(plan):
                    for _ in range(plan.eval_iters):
                        reports.extend(self.run_schedule(iterator, forward_only=True))
            finally:
                self.model.train()
                clear_aux_losses_tracker()
        val_loss = _reduced_loss(reports, plan.device)
        self.sync()
        return {
            "val_loss": val_loss,
            "val_ppl": math.exp(min(val_loss, 700.0)),
            "val_tokens": plan.eval_iters * plan.run.train.global_batch_size * plan.seq_length,
            "eval_time_s": time.perf_counter() - t0,
        }

    def eval_due(self, step: int) -> bool:
        every = self.plan.eval_interval
        return every > 0 and (step % every == 0 or step == self.plan.run.train.train_iters)

    def timed_step(self) -> dict[str, Any]:
        """One ``train_step`` between device syncs, the state advanced: the step's metrics record."""
        from nano_hybrid.metrics import peak_memory_gb

        plan, state = self.plan, self.state
        gbs = plan.run.train.global_batch_size
        tokens_per_step = gbs * plan.seq_length
        self.sync()
        t0 = time.perf_counter()
        out = self.train_step()  # .item() inside syncs with the device
        self.sync()
        dt = time.perf_counter() - t0
        state.advance(gbs, plan.seq_length)
        tps = tokens_per_step / dt
        return {
            "step": state.step,
            "tokens": state.consumed_tokens,
            "consumed_samples": state.consumed_samples,
            "loss": out.pop("loss"),
            "lr": out.pop("lr"),
            "grad_norm": out.pop("grad_norm"),
            "step_time_s": dt,
            "tokens_per_step": tokens_per_step,
            "tokens_per_s": tps,
            "tokens_per_s_per_gpu": tps / plan.dims.world_size,
            "tflops_per_gpu": self.flops_per_token * tps / plan.dims.world_size / 1e12,
            "mem_gb": peak_memory_gb(),
            "world_size": plan.dims.world_size,
            **out,
        }

    def fit(self, stop=None) -> str | None:
        """Train until ``train.train_iters``, or until ``stop`` (an ExitRequest) asks; returns the stop reason."""
        from nano_hybrid.stepguard import SkipCounter

        t, state = self.plan.run.train, self.state
        iters, log_every = t.train_iters, t.log_interval
        skips = SkipCounter(t.max_skipped_steps)
        while state.step < iters:
            rec = self.timed_step()
            if self.eval_due(state.step):  # validation keys join this step's record (and console line)
                rec.update(self.evaluate())
            self.logger.log_step(rec, console=state.step % log_every == 0 or state.step in (1, iters) or "val_loss" in rec)
            skips.update(bool(rec["skipped"]), state.step, rec)  # too many in a row: TrainingDivergedError
            if self.checkpointer is not None and not rec["skipped"]:  # a skipped step is never checkpointed
                self.checkpointer.maybe_save(state, self.model, self.optimizer, self.scheduler,
                                             wandb_run_id=self.logger.wandb_run_id)
            reason = stop.should_exit() if stop is not None else None  # collective: all ranks stop after the same step
            if reason is not None:
                self.logger.print(f"stopping after step {state.step} ({reason})")
                return reason
        return None

    def save_final(self) -> None:
        """The checkpoint of the run's last step (checkpoint.save_on_exit / the final interval)."""
        self.checkpointer.save_final(self.state, self.model, self.optimizer, self.scheduler,
                                     wandb_run_id=self.logger.wandb_run_id)


def _build(cls, cfg: DictConfig, plan: RunPlan, *, with_optimizer: bool, resume: bool) -> Trainer:
    from nano_hybrid.arch import HybridArch
    from nano_hybrid.flops import training_flops_per_token

    t = plan.run.train
    if t.torch_threads is not None:
        torch.set_num_threads(t.torch_threads)
    if t.deterministic:  # before the first CUDA matmul: cuBLAS reads its workspace setting when a handle is made
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    init_distributed(plan, cfg)
    run_dir = resolve_run_dir(cfg, plan)
    # Before any work: run_dir and checkpoint.dir take a write, and no other trainer uses run_dir.
    decided_on_rank0(claim_run_dir, run_dir, Path(str(cfg.checkpoint.dir)))
    # Find the checkpoint to resume now (a bad checkpoint.load fails before any work) and continue its W&B run.
    checkpointer = Checkpointer(cfg)
    if checkpointer.locate() is not None and cfg.logger.wandb.id is None:
        with open_dict(cfg):
            cfg.logger.wandb.id = checkpointer.resume_wandb_run_id
    say = (lambda msg: print(msg, flush=True)) if plan.dims.is_main else (lambda msg: None)
    if resume:  # the checkpoint's LR schedule and training data against this run's, before any work
        for note in decided_on_rank0(checkpointer.check_resume, cfg):
            say(note)
    prepare_data(plan, cfg, say)
    dataset, valid_dataset = build_dataset(plan, cfg)
    # checkpoint.init_from_hf starts a fresh run only; a run that resumes loads its own checkpoint
    init_hf = cfg.checkpoint.init_from_hf if checkpointer.load_path is None else None
    init_hf = str(init_hf) if init_hf else None
    pretune_kernels(cfg, plan, lambda msg: print(msg, flush=True))  # every rank: only the one that tunes says so
    model, optimizer, scheduler = build_model_and_optimizer(plan, cfg, init_from_hf=init_hf,
                                                            with_optimizer=with_optimizer)
    if (with_optimizer and bool(cfg.checkpoint.check_free_space)
            and (checkpointer.interval or checkpointer.save_on_exit)):
        decided_on_rank0(checkpointer.check_free_space, model, optimizer, t.train_iters)
    state = TrainState()
    if resume:  # a checkpoint this model cannot load is refused here, before the run directory changes
        checkpointer.resume(model, optimizer, scheduler, state, init_from_hf=init_hf)
    unwrapped = model.module.module if plan.dtype == torch.bfloat16 else model.module
    flops = training_flops_per_token(HybridArch.from_megatron(unwrapped), plan.seq_length)
    if plan.dims.is_main:
        report_data_epochs(dataset, t.train_iters * t.global_batch_size, plan.seq_length,
                           state.consumed_samples, say)
        if valid_dataset is not None:
            report_validation_size(valid_dataset, plan.eval_iters, t.global_batch_size, plan.seq_length, say)
        run_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(cfg, run_dir / "config.yaml", resolve=True)
    logger = _start_logger(cfg, plan, run_dir, checkpointer.resume_step, unwrapped)
    return cls(cfg=cfg, plan=plan, run_dir=run_dir, model=model, optimizer=optimizer, scheduler=scheduler,
               dataset=dataset, valid_dataset=valid_dataset, state=state, logger=logger, flops_per_token=flops,
               attention_mask=causal_mask_for(cfg, plan.seq_length, plan.device), checkpointer=checkpointer)


def pretune_kernels(cfg: DictConfig, plan: RunPlan, say) -> list[str]:
    """With ``kernels.helion.autotune`` on a GPU: the helion kernels without an exact config at this run's Mamba mixer
    shape are tuned now, several at a time, before the first step (``nano_hybrid.kernel_search.pretune``).
    Every process of the run calls it; one tunes while the others wait on its lock. Returns the failed searches."""
    settings = plan.backend.settings if plan.backend is not None else None
    if settings is None or not settings.autotune or plan.device.type != "cuda":
        return []
    if "M" not in str(cfg.model.hybrid_override_pattern):
        return []  # no Mamba mixer: no helion kernel runs
    from nano_hybrid.kernel_search import pretune
    from nano_hybrid.model.config import mixer_dims, model_dict

    return pretune(mixer_dims(cfg), settings, say, fused_norm=model_dict(cfg.model)["mamba_fused_norm"])


def _start_logger(cfg: DictConfig, plan: RunPlan, run_dir: Path, resume_step, unwrapped):
    """metrics.jsonl (and W&B) for the run, and the start line naming model, layout and batch."""
    from nano_hybrid.metrics import MetricsLogger

    logger = MetricsLogger(
        run_dir,
        rank=plan.dims.rank,
        train_iters=plan.run.train.train_iters,
        backend=plan.backend_name,
        wandb_cfg=cfg.logger.wandb,
        run_config=OmegaConf.to_container(cfg, resolve=True),
        start_step=resume_step,  # records after it (a crashed segment's) are re-run: dropped
    )
    n_params = sum(p.numel() for p in unwrapped.parameters())
    logger.print(
        f"nano-hybrid: model={cfg.model.name} ({n_params / 1e6:.2f}M params on rank 0) backend={plan.backend_name} "
        f"device={plan.device.type} dtype={str(plan.dtype).removeprefix('torch.')} world={plan.dims.world_size} "
        f"dp={plan.dims.dp} mbs={plan.run.train.micro_batch_size} gbs={plan.run.train.global_batch_size} "
        f"seq={plan.seq_length} run_dir={run_dir}"
    )
    return logger


def release_run_dir() -> None:
    """Give up rank 0's run-dir lock at the end of a run, so the next trainer (also in this process) may take
    run_dir."""
    while _RUN_LOCK:
        _RUN_LOCK.pop().release()
    _CLAIMED_DIRS.clear()


def shutdown(trainer: Trainer | None) -> None:
    """Close the trainer's logger (if any) and tear down the process groups."""
    from nano_hybrid.parallel import destroy_parallel

    if trainer is not None:
        trainer.logger.close()
    destroy_parallel()
