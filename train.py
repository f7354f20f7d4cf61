#!/usr/bin/env python
"""Train a face recognition model: `python train.py configs/x [--key value ...]`, or under
`torchrun --nproc_per_node N train.py configs/x` for N ranks (NCCL on GPUs, gloo on CPU).

One step: backbone (ZeRO-2 or DDP) -> class-sharded margin head -> loss -> backward ->
[fp16 unscale] -> global-norm clip over backbone and head -> both optimizers -> EMA.
With a teacher the loss adds distillation's term; label-free (num_classes 0) it is that term alone,
and there is no head.
"""
from __future__ import annotations

import contextlib
import os
import sys

import torch

from builders import (build_backbone, build_data_parallel, build_distillation, build_head, build_head_optimizer,
                      build_train_dataset,                      init_backbone)
from configs import format_config, get_config, save_config
from configs.compat import compat_notes
from configs.describe import describe_keys
from configs.per_rank import SECRET_KEYS, rank_independent
from configs.validate import warmup_problem
from dataset import ResumableDistributedSampler, get_dataloader, normalize_images
from dataset.errors import DataError
from eval.callback import VerificationCallback
from parallel import DynamicLossScaler, ShardedEMA, init_distributed, setup_logging
from parallel.agreement import check_same_on_every_rank
from parallel.dist import open_log_file
from parallel.stop import StopSignal
from parallel.user_errors import exits_on_user_error
from utils.checkpoint import atomic_write_text
from utils.checkpoint_changes import log_resume_changes
from utils.checkpoint_foreign import refuse_arcface_torch_output
from utils.checkpointer import Checkpointer
from utils.data_position import follow_data
from utils.divergence import TrainingStopped, check_labels, check_loss
from utils.progress import ProgressLogger, SkipReport
from utils.run_lock import RunLock
from utils.schedule import lr_factor, schedule_steps, set_lr
from utils.seed import seed_everything
from utils.wandb_logging import check_wandb_login, finish_wandb, start_wandb, tee_writer


def main(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__ + "\nConfig keys (defaults from configs/base.py):" + describe_keys())
        return 0
    if not argv or argv[0].startswith("--"):
        print(__doc__)
        return 2
    cfg = get_config(argv[0], argv[1:])
    refuse_arcface_torch_output(cfg.output, argv[0], argv[1:])  # before anything is written there
    stop = StopSignal()  # before any thread starts (see its docstring)
    lock = RunLock()  # taken once the config and data are accepted; released on every way out
    try:
        return train(cfg, argv[0], stop, lock)
    finally:
        lock.release()
        stop.restore()


def train(cfg, config_path: str, stop: StopSignal, lock: RunLock) -> int:
    info = init_distributed(cfg.dist_timeout_min)
    if info.device.type == "cuda":  # fixed 112x112 inputs: let cuDNN pick its fastest kernels once
        torch.backends.cudnn.benchmark = True
    # training.log is held in memory until the run is accepted (a refused start writes no log), so
    # what building the run says (photos left out, compat notes) reaches it too
    logger = setup_logging(info.rank, os.path.join(cfg.output, "training.log"), held=True)
    check_same_on_every_rank(rank_independent(cfg), "the config", SECRET_KEYS)  # before any rank acts on it
    check_wandb_login(cfg, info.rank)  # wandb.init would find a missing key only once the output is written
    torch.manual_seed(cfg.seed)  # identical initial backbone on every rank
    backbone = build_backbone(cfg).to(info.device)
    initialised = init_backbone(cfg, backbone)  # fine-tuning from pretrained weights (not when resuming)
    head = build_head(cfg, info.device)  # None when label-free (num_classes 0)
    distill = build_distillation(cfg, backbone, info.device)  # None without a teacher; may add a projection
    model, backbone_opt = build_data_parallel(cfg, backbone)
    head_opt = build_head_optimizer(cfg, head)
    optimizers = [opt for opt in (backbone_opt, head_opt) if opt is not None]  # stepped in this order
    head_params = list(head.parameters()) if head is not None else []
    clipped_head_params = head_params if cfg.clip_head else []  # clip_head false: the backbone alone (arcface_torch)
    ema = ShardedEMA(backbone, cfg.ema_decay, cfg.ema_tau, optimizer=backbone_opt if cfg.zero else None) \
        if cfg.ema else None
    scaler = DynamicLossScaler() if cfg.fp16 else None
    seed_everything(cfg.seed + info.rank)  # per-rank randomness (Partial FC sampling) from here

    dataset = build_train_dataset(cfg)  # uint8 from the workers, normalised on the device
    if distill is not None:
        distill.check_data(cfg, dataset)  # a teacher file made from other data is refused here
    if cfg.num_image and cfg.num_image != len(dataset) and cfg.rec != "synthetic":
        logger.warning("config num_image is %d but %s holds %d images; using the latter",
                       cfg.num_image, cfg.rec, len(dataset))
    sampler = ResumableDistributedSampler(len(dataset), info.world_size, info.rank, cfg.batch_size, cfg.seed,
                                         source=cfg.rec)
    steps_per_epoch = sampler.batches_per_epoch // cfg.gradient_acc
    if steps_per_epoch == 0:  # else the run would end at once, "done" after 0 steps
        raise DataError(f"gradient_acc {cfg.gradient_acc} is more than the {sampler.batches_per_epoch} batches of "
                        f"{cfg.batch_size} x {info.world_size} ranks that {cfg.rec} fills per epoch: not one "
                        f"optimizer step; use --gradient_acc {sampler.batches_per_epoch} or less")
    total_steps = cfg.num_epoch * steps_per_epoch
    if cfg.max_steps:
        total_steps = min(total_steps, cfg.max_steps)
    warmup_steps, schedule_steps_total = schedule_steps(cfg.lr_scheduler, len(dataset), cfg.batch_size * info.world_size
                                                        * cfg.gradient_acc, cfg.warmup_epoch, cfg.num_epoch,
                                                        steps_per_epoch)
    schedule_steps_total = min(schedule_steps_total, total_steps)
    if problem := warmup_problem(total_steps, warmup_steps):
        logger.warning(problem)

    # a missing val set refuses the run here, writing nothing; the run's threshold is saved in output
    verify = VerificationCallback(cfg.val_targets, cfg.val_dir or cfg.rec, cfg.verbose, backbone, ema,
                                  is_main=info.is_main, output=cfg.output)

    lock.acquire(cfg.output, info.rank)  # one live run per output, seen by every rank: else refused here
    if info.is_main:
        for note in compat_notes(cfg):
            logger.warning(note)
    if initialised:
        logger.info(initialised)
    if cfg.fp16 and info.device.type == "cpu":
        logger.warning("fp16 on the CPU is emulated and many times slower than fp32: use bf16 or neither")
    checkpointer = Checkpointer(cfg.output, backbone=backbone, backbone_opt=backbone_opt, head=head,
                                head_opt=head_opt, ema=ema, scaler=scaler, config=cfg, rank=info.rank,
                                world_size=info.world_size, keep=cfg.keep_checkpoints)
    state = checkpointer.start(cfg.resume, cfg.overwrite, batch_size=cfg.batch_size)
    follow_data(state, checkpointer.resumed_meta, len(dataset), dataset.fingerprint(), cfg.rec,
                sampler.batches_per_epoch)  # another data set than the checkpoint's: the epoch restarts
    if distill is not None:  # the teacher's centre: the checkpoint's, else measured; then saved with each one
        distill.prepare(cfg, dataset, info.device, checkpointer.resumed_meta)
        checkpointer.extra_meta = distill.checkpoint_meta()
    # accepted: only now is anything written (a refused run must not replace the config of the run it met)
    open_log_file()
    if info.is_main:
        save_config(cfg, cfg.output, atomic_write_text)
    if checkpointer.resumed_meta is not None:
        logger.info("resumed at step %d (epoch %d, batch %d)", state.step, state.epoch, state.batch_in_epoch)
        log_resume_changes(checkpointer.resumed_meta, cfg, info.world_size, steps_per_epoch, total_steps)

    writer = None
    if info.is_main:
        from torch.utils.tensorboard import SummaryWriter
        # events past the step this run starts from (a resume's re-done steps) are dropped
        writer = SummaryWriter(os.path.join(cfg.output, "tensorboard"), purge_step=state.step + 1)
    wandb_run = start_wandb(cfg, info.rank)  # None unless using_wandb (rank 0, or all with wandb_log_all)
    writer = tee_writer(writer, wandb_run)
    verify.writer = writer
    if info.is_main:  # only once the data, the output and the val sets are accepted
        logger.info("config %s (world size %d, %s)\n%s", config_path, info.world_size, info.device, format_config(cfg))
    progress = ProgressLogger(total_steps, cfg.frequent, cfg.batch_size * info.world_size * cfg.gradient_acc,
                              writer, first_step=state.step,
                              poll_limit_s=stop.grace_s if info.device.type != "cpu" else None)
    skips = SkipReport(dataset, cfg.frequent, writer, enabled=cfg.skip_bad_images)
    first_step = state.step
    # built once: its persistent workers (and their open record files) serve every epoch
    loader = get_dataloader(dataset, sampler, cfg.num_workers, info.device, cfg.seed,
                            teacher_rows=distill.teacher_rows if distill is not None else None)
    try:
        with stop.deferred():  # a stop signal waits for the step end from here on
            while state.step < total_steps and state.epoch < cfg.num_epoch:
                sampler.set_epoch(state.epoch, state.batch_in_epoch)
                dataset.set_epoch(state.epoch, cfg.seed)  # mirroring fixed by (seed, epoch, index)
                for images, labels, *rows in loader:  # rows: a teacher file's, read by the workers
                    if state.batch_in_epoch >= steps_per_epoch * cfg.gradient_acc:
                        continue  # too few batches left for a whole step (see last_micro)
                    # on the CPU, where no device waits; label-free data has no labels to check
                    if head is not None and (problem := check_labels(labels, cfg.num_classes)):
                        logger.error("%s (the head stops every rank)", problem)
                    images = normalize_images(images.to(info.device, non_blocking=True))
                    labels = labels.to(info.device, non_blocking=True)
                    # a step's micro-batches never span two epochs (nor a resume): the epoch's last
                    # batches_per_epoch % gradient_acc batches are skipped, so every epoch has steps_per_epoch
                    last_micro = (state.batch_in_epoch + 1) % cfg.gradient_acc == 0
                    lr = cfg.lr * lr_factor(state.step, schedule_steps_total, warmup_steps, cfg.lr_scheduler,
                                             cfg.lr_power)
                    set_lr(optimizers, lr)  # before forward: a fused head steps in backward
                    with contextlib.nullcontext() if last_micro else backbone_opt.no_sync():
                        embeddings = model(images)
                        loss = head(embeddings, labels) if distill is None else \
                            distill.loss(head, embeddings, labels, images, rows)
                        scaled = loss / cfg.gradient_acc
                        (scaler.scale(scaled) if scaler else scaled).backward()
                    state.batch_in_epoch += 1
                    if not last_micro:
                        continue

                    if scaler is None or scaler.unscale_(backbone_opt, extra_params=head_params):
                        backbone_opt.clip_grad_norm_(cfg.max_grad_norm, extra_params=clipped_head_params)
                        for opt in optimizers:
                            opt.step()
                        if ema is not None:
                            ema.update()
                    for opt in optimizers:
                        opt.zero_grad()
                    state.step += 1
                    # the loss stays on the device; the host reads it once per `frequent` steps, and
                    # before a checkpoint (a diverged step is never saved as the last good one)
                    progress.add(loss.detach())
                    checkpoint_due = state.step % cfg.checkpoint_interval == 0
                    if progress.due(state.step) or checkpoint_due:
                        loss_value = progress.mean_loss()
                        check_loss(loss_value, state.step, scaler,
                                   label_errors=head.take_label_errors() if head is not None else 0)
                        if progress.due(state.step):
                            progress(state.step, state.epoch, loss_value, lr, scaler.scale_value if scaler else None)
                            if distill is not None:
                                distill.report(state.step, total_steps)
                    skips(state.step)

                    if verify.due(state.step):
                        with progress.paused():  # out of samples/s and the ETA
                            verify(state.step)
                    if checkpoint_due:
                        with progress.paused():
                            checkpointer.save(state, (images, labels))
                    job_done = cfg.stop_after_steps and state.step - first_step >= cfg.stop_after_steps
                    # every rank polls the stop flag at the same steps: each step on the CPU, once per
                    # `frequent` steps on GPUs (a gloo round trip; their steps are short)
                    poll = info.device.type == "cpu" or progress.due(state.step)
                    if job_done or (poll and stop.requested()):
                        logger.info("%s: saving a checkpoint at step %d and exiting",
                                    "job step limit" if job_done else "stop signal", state.step)
                        checkpointer.save(state, (images, labels))
                        skips(state.step, final=True)
                        return 0
                    if state.step >= total_steps:
                        break
                else:
                    state.epoch, state.batch_in_epoch = state.epoch + 1, 0
            checkpointer.save(state, (images, labels) if state.step > first_step else None)
            verify(state.step)
            skips(state.step, final=True)
            logger.info("done: %d steps; weights in %s", state.step, os.path.join(cfg.output, "model.pt"))
            return 0
    except TrainingStopped as exc:
        logger.error("stopped: %s", exc)
        return 3
    finally:
        if writer is not None:
            writer.close()
        model_path = os.path.join(cfg.output, "model.pt")
        finish_wandb(wandb_run, model_path if os.path.isfile(model_path) else None, cfg.save_artifacts and info.is_main)


def cli() -> None:
    code = exits_on_user_error(main)(sys.argv[1:])  # a config, data or checkpoint error: one line, exit 2
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    sys.exit(code)


if __name__ == "__main__":
    cli()
