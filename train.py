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

from shardface.builders import build_model_parts, build_train_dataset
from shardface.checkpoint.changes import log_resume_changes
from shardface.checkpoint.checkpointer import Checkpointer
from shardface.checkpoint.data_position import follow_data
from shardface.checkpoint.files import atomic_write_text
from shardface.checkpoint.foreign import refuse_arcface_torch_output
from shardface.checkpoint.run_lock import RunLock
from shardface.configs import format_config, get_config, save_config
from shardface.configs.schema import describe_keys, rank_independent, secret_keys, served_notes
from shardface.configs.validate import warmup_problem
from shardface.dataset import ResumableDistributedSampler, get_dataloader, normalize_images
from shardface.eval.callback import VerificationCallback
from shardface.parallel import init_distributed, setup_logging
from shardface.parallel.agreement import check_same_on_every_rank
from shardface.parallel.dist import open_log_file
from shardface.parallel.stop import StopSignal
from shardface.parallel.user_errors import exits_on_user_error
from shardface.utils.divergence import TrainingStopped, check_labels, check_loss
from shardface.utils.reports import Reports
from shardface.utils.schedule import StepPlan, set_lr
from shardface.utils.wandb_logging import check_wandb_login


def main(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__ + "\nConfig keys (configs/schema.py):" + describe_keys())
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


class Run:
    """One training run on this rank: its config, its parts, its data and plan, and where it stands.

    `Run(cfg, config_path, stop, lock)` builds it on every rank in one fixed order (the config and
    data checks, the lock, the resume and the teacher's centre issue collectives in that order);
    a run refused while it is built raises, and has written nothing in its output: training.log is
    held and the config saved only once the data, the output and the val sets are accepted.
    What a step runs is `parts` (builders.ModelParts), its counts and lr are `plan`
    (utils.schedule.StepPlan), and what it reports goes through `reports` (utils.reports.Reports).
    The step's own parts are methods (`forward_backward`, `optimizer_step`, `report`,
    `exit_reason`); `close` ends the reports on every way out of the loop.
    """

    def __init__(self, cfg, config_path: str, stop: StopSignal, lock: RunLock) -> None:
        self.cfg, self.stop = cfg, stop
        self.info = info = init_distributed(cfg.dist_timeout_min)
        if info.device.type == "cuda":  # fixed 112x112 inputs: let cuDNN pick its fastest kernels once
            torch.backends.cudnn.benchmark = True
        # training.log is held in memory until the run is accepted (a refused start writes no log), so
        # what building the run says (photos left out, compat notes) reaches it too
        self.logger = setup_logging(info.rank, os.path.join(cfg.output, "training.log"), held=True)
        # before any rank acts on it
        check_same_on_every_rank(rank_independent(cfg), "the config", secret_keys())
        # wandb.init would find a missing key only once the output is written
        check_wandb_login(cfg, info.rank)
        self.parts = build_model_parts(cfg, info.device, info.rank)
        self._plan_steps()
        # a missing val set refuses the run here, writing nothing; the run's threshold is saved in output
        self.verify = VerificationCallback(
            cfg.val_targets,
            cfg.val_dir or cfg.rec,
            cfg.verbose,
            self.parts.backbone,
            self.parts.ema,
            is_main=info.is_main,
            output=cfg.output,
        )
        self._accept(lock)
        self._open_reports(config_path)

    def _plan_steps(self) -> None:
        """The data set, its sampler, and the step plan."""
        cfg, info = self.cfg, self.info
        self.dataset = dataset = build_train_dataset(cfg)  # uint8 from the workers, normalised on the device
        if self.parts.distill is not None:
            self.parts.distill.check_data(cfg, dataset)  # a teacher file made from other data is refused here
        if cfg.num_image and cfg.num_image != len(dataset) and cfg.rec != "synthetic":
            self.logger.warning(
                "config num_image is %d but %s holds %d images; using the latter",
                cfg.num_image,
                cfg.rec,
                len(dataset),
            )
        self.sampler = ResumableDistributedSampler(
            len(dataset), info.world_size, info.rank, cfg.batch_size, cfg.seed, source=cfg.rec
        )
        self.plan = plan = StepPlan.of(cfg, len(dataset), self.sampler.batches_per_epoch, info.world_size)
        if problem := warmup_problem(plan.total_steps, plan.warmup_steps):
            self.logger.warning(problem)

    def _accept(self, lock: RunLock) -> None:
        """Take the output (lock, checkpointer, resume, teacher's centre); only then write in it:
        training.log, the config, what the resume changed."""
        cfg, info, logger, parts = self.cfg, self.info, self.logger, self.parts
        lock.acquire(cfg.output, info.rank)  # one live run per output, seen by every rank: else refused here
        if info.is_main:
            for note in served_notes(cfg):
                logger.warning(note)
        if parts.initialised:
            logger.info(parts.initialised)
        if cfg.fp16 and info.device.type == "cpu":
            logger.warning("fp16 on the CPU is emulated and many times slower than fp32: use bf16 or neither")
        self.checkpointer = checkpointer = Checkpointer(
            cfg.output,
            backbone=parts.backbone,
            backbone_opt=parts.backbone_opt,
            head=parts.head,
            head_opt=parts.head_opt,
            ema=parts.ema,
            scaler=parts.scaler,
            config=cfg,
            rank=info.rank,
            world_size=info.world_size,
            keep=cfg.keep_checkpoints,
        )
        self.state = state = checkpointer.start(cfg.resume, cfg.overwrite, batch_size=cfg.batch_size)
        # another data set than the checkpoint's: the epoch restarts
        follow_data(
            state,
            checkpointer.resumed_meta,
            len(self.dataset),
            self.dataset.fingerprint(),
            cfg.rec,
            self.sampler.batches_per_epoch,
        )
        if (
            parts.distill is not None
        ):  # the teacher's centre: the checkpoint's, else measured; saved with each
            parts.distill.prepare(cfg, self.dataset, info.device, checkpointer.resumed_meta)
            checkpointer.extra_meta = parts.distill.checkpoint_meta()
        # accepted: only now is anything written (a refused run must not replace the config of the run it met)
        open_log_file()
        if info.is_main:
            save_config(cfg, cfg.output, atomic_write_text)
        if checkpointer.resumed_meta is not None:
            logger.info(
                "resumed at step %d (epoch %d, batch %d)", state.step, state.epoch, state.batch_in_epoch
            )
            log_resume_changes(
                checkpointer.resumed_meta,
                cfg,
                info.world_size,
                self.plan.steps_per_epoch,
                self.plan.total_steps,
            )

    def _open_reports(self, config_path: str) -> None:
        """The reports, the config's log line, and the loader."""
        cfg, info = self.cfg, self.info
        self.reports = Reports(
            cfg,
            self.dataset,
            rank=info.rank,
            world_size=info.world_size,
            first_step=self.state.step,
            total_steps=self.plan.total_steps,
            poll_limit_s=self.stop.grace_s if info.device.type != "cpu" else None,
        )
        self.verify.writer = self.reports.writer
        if info.is_main:  # only once the data, the output and the val sets are accepted
            self.logger.info(
                "config %s (world size %d, %s)\n%s",
                config_path,
                info.world_size,
                info.device,
                format_config(cfg),
            )
        self.first_step = self.state.step
        # built once: its persistent workers (and their open record files) serve every epoch
        distill = self.parts.distill
        self.loader = get_dataloader(
            self.dataset,
            self.sampler,
            cfg.num_workers,
            info.device,
            cfg.seed,
            teacher_rows=distill.teacher_rows if distill is not None else None,
        )

    def forward_backward(self, images, labels, rows, last_micro: bool):
        """One micro-batch from the loader: its labels checked, moved to the device, the step's lr
        set, forward and backward (the gradients averaged across ranks only on the step's last
        micro-batch). Returns (images, labels) on the device, the loss and the lr."""
        cfg, parts = self.cfg, self.parts
        # on the CPU, where no device waits; label-free data has no labels to check
        if parts.head is not None and (problem := check_labels(labels, cfg.num_classes)):
            self.logger.error("%s (the head stops every rank)", problem)
        images = images.to(self.info.device, non_blocking=True)
        if cfg.channels_last:
            # the parameters keep their layout (ZeRO's flat shards): only activations change; the
            # uint8 batch is a quarter of the float one to copy, and normalising keeps its layout
            images = images.contiguous(memory_format=torch.channels_last)
        images = normalize_images(images)
        labels = labels.to(self.info.device, non_blocking=True)
        lr = self.plan.lr(cfg, self.state.step)
        set_lr(parts.optimizers, lr)  # before forward: a fused head steps in backward
        with contextlib.nullcontext() if last_micro else parts.backbone_opt.no_sync():
            embeddings = parts.model(images)
            if self.reports.norms is not None:
                self.reports.norms.add(embeddings)
            if parts.distill is None:
                loss = parts.head_step(embeddings, labels)
            else:
                loss = parts.distill.loss(parts.head, embeddings, labels, images, rows)
            scaled = loss / cfg.gradient_acc
            (parts.scaler.scale(scaled) if parts.scaler else scaled).backward()
        return images, labels, loss, lr

    def optimizer_step(self) -> None:
        """The parts' optimizer step (builders.ModelParts.step), then the step counted."""
        self.parts.step(self.cfg.max_grad_norm)
        self.state.step += 1

    def report(self, loss: torch.Tensor, lr: float) -> bool:
        """Log the step's progress when due, after checking its loss; returns whether a
        checkpoint is due. The loss stays on the device; the host reads it once per `frequent`
        steps, and before a checkpoint (a diverged step is never saved as the last good one)."""
        step, progress, scaler = self.state.step, self.reports.progress, self.parts.scaler
        head, distill, norms = self.parts.head, self.parts.distill, self.reports.norms
        progress.add(loss.detach())
        checkpoint_due = step % self.cfg.checkpoint_interval == 0
        if progress.due(step) or checkpoint_due:
            loss_value = progress.mean_loss()
            check_loss(
                loss_value,
                step,
                scaler,
                label_errors=head.take_label_errors() if head is not None else 0,
            )
            if progress.due(step):
                progress(step, self.state.epoch, loss_value, lr, scaler.scale_value if scaler else None)
                if norms is not None:
                    norms(step)
                if distill is not None:
                    distill.report(step, self.plan.total_steps)
        self.reports.skips(step)
        return checkpoint_due

    def exit_reason(self) -> str | None:
        """Why this job ends after this step with a checkpoint ("job step limit", "stop signal"),
        or None. Every rank polls the stop flag at the same steps: each step on the CPU, once per
        `frequent` steps on GPUs (a gloo round trip; their steps are short)."""
        step = self.state.step
        job_done = self.cfg.stop_after_steps and step - self.first_step >= self.cfg.stop_after_steps
        poll = self.info.device.type == "cpu" or self.reports.progress.due(step)
        if job_done or (poll and self.stop.requested()):
            return "job step limit" if job_done else "stop signal"
        return None

    def close(self) -> None:
        """End the reports (utils.reports.Reports.close)."""
        self.reports.close()


def train(cfg, config_path: str, stop: StopSignal, lock: RunLock) -> int:
    """Build the run, then step it until total_steps (or num_epoch), a job step limit or a stop
    signal, each ending with a checkpoint. Returns 0, or 3 when training diverged."""
    run = Run(cfg, config_path, stop, lock)
    state, logger = run.state, run.logger
    try:
        with stop.deferred():  # a stop signal waits for the step end from here on
            while state.step < run.plan.total_steps and state.epoch < cfg.num_epoch:
                run.sampler.set_epoch(state.epoch, state.batch_in_epoch)
                run.dataset.set_epoch(state.epoch, cfg.seed)  # mirroring fixed by (seed, epoch, index)
                for images, labels, *rows in run.loader:  # rows: a teacher file's, read by the workers
                    if state.batch_in_epoch >= run.plan.steps_per_epoch * cfg.gradient_acc:
                        continue  # too few batches left for a whole step (see last_micro)
                    # a step's micro-batches never span two epochs (nor a resume): the epoch's last
                    # batches_per_epoch % gradient_acc batches are skipped, so every epoch has steps_per_epoch
                    last_micro = (state.batch_in_epoch + 1) % cfg.gradient_acc == 0
                    images, labels, loss, lr = run.forward_backward(images, labels, rows, last_micro)
                    state.batch_in_epoch += 1
                    if not last_micro:
                        continue

                    run.optimizer_step()
                    checkpoint_due = run.report(loss, lr)
                    reason = run.exit_reason()
                    # after a stop signal its checkpoint comes first, within its grace
                    if reason != "stop signal":
                        if run.verify.due(state.step):
                            with run.reports.progress.paused():  # out of samples/s and the ETA
                                run.verify(state.step)
                        if checkpoint_due:
                            with run.reports.progress.paused():
                                run.checkpointer.save(state, (images, labels))
                    if reason:
                        logger.info("%s: saving a checkpoint at step %d and exiting", reason, state.step)
                        run.checkpointer.save(state, (images, labels))
                        run.reports.skips(state.step, final=True)
                        return 0
                    if state.step >= run.plan.total_steps:
                        break
                else:
                    state.epoch, state.batch_in_epoch = state.epoch + 1, 0
            run.checkpointer.save(state, (images, labels) if state.step > run.first_step else None)
            run.verify(state.step)
            run.reports.skips(state.step, final=True)
            logger.info("done: %d steps; weights in %s", state.step, os.path.join(cfg.output, "model.pt"))
            return 0
    except TrainingStopped as exc:
        logger.error("stopped: %s", exc)
        return 3
    finally:
        run.close()


def cli() -> None:
    code = exits_on_user_error(main)(sys.argv[1:])  # a config, data or checkpoint error: one line, exit 2
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    sys.exit(code)


if __name__ == "__main__":
    cli()
