"""Weights & Biases logging with arcface_torch's keys (`using_wandb` ...): optional, imported only when asked.

Rank 0 logs (every rank with `wandb_log_all`, each its own run `<yymmdd_HHMM>_GPU<rank>[_<suffix_run_name>]`).
Every scalar written to TensorBoard (loss, lr, samples/s, verification) goes to wandb too, through
`ScalarTee`, so the loop and callbacks need no wandb code."""

from __future__ import annotations

import datetime
import os

from shardface.errors import ConfigError

_LOCAL_MODES = ("offline", "dryrun", "disabled")  # wandb modes that need no account


def _logs(cfg: dict, rank: int) -> bool:
    return bool(cfg["using_wandb"]) and (rank == 0 or bool(cfg["wandb_log_all"]))


def check_wandb_login(cfg: dict, rank: int) -> None:
    """At start, before anything is written: raise ConfigError when this rank is to log to wandb
    online and wandb has no API key (`wandb_key`, WANDB_API_KEY, ~/.netrc, or wandb's settings),
    which wandb.init would find only after the output was written, as a traceback. Reads wandb's
    own resolved settings and credentials, starting nothing and changing nothing; a wandb
    release without that interface is not checked here (wandb.init still reports it)."""
    if not _logs(cfg, rank) or cfg["wandb_key"] or os.environ.get("WANDB_MODE") in _LOCAL_MODES:
        return  # (the environment first: wandb's settings are cached per process)
    try:
        from wandb.errors import AuthenticationError
        from wandb.sdk import wandb_setup
        from wandb.sdk.lib.wbauth import authenticate

        settings = wandb_setup.singleton().settings
        mode, host = settings.mode, settings.base_url
        find = authenticate.authenticate_session
    except (ImportError, AttributeError):
        return
    if mode in _LOCAL_MODES:
        return
    try:
        found = find(host=host, source="shardface", prompt=False, update_session=False)
    except AuthenticationError as exc:  # a key is set but malformed
        raise ConfigError(
            f"using_wandb = True but wandb's API key for {host} is not usable ({exc}): fix it with "
            f"`wandb login --relogin`, or pass --wandb_key"
        ) from None
    if found is None:
        raise ConfigError(
            f"using_wandb = True but wandb has no API key for {host} (mode {mode}): run `wandb login`, "
            f"set WANDB_API_KEY or --wandb_key, or set WANDB_MODE=offline to log on this machine only"
        )


def start_wandb(cfg: dict, rank: int):
    """The wandb run of this rank, or None (not asked, or not this rank); the config is logged."""
    if not _logs(cfg, rank):
        return None
    import wandb  # validate_config checked it is installed

    if cfg["wandb_key"]:
        wandb.login(key=cfg["wandb_key"])
    name = datetime.datetime.now().strftime("%y%m%d_%H%M") + f"_GPU{rank}"
    if cfg["suffix_run_name"]:
        name += f"_{cfg['suffix_run_name']}"
    return wandb.init(
        entity=cfg["wandb_entity"],
        project=cfg["wandb_project"],
        name=name,
        resume=cfg["wandb_resume"] or None,
        config=dict(cfg),
    )


class ScalarTee:
    """Writes each `add_scalar` to the TensorBoard writer (if any) and to the wandb run."""

    def __init__(self, writer, run):
        self.writer, self.run = writer, run

    def add_scalar(self, tag: str, value, step: int) -> None:
        if self.writer is not None:
            self.writer.add_scalar(tag, value, step)
        self.run.log({tag: float(value)}, step=step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()

    def __getattr__(self, name):  # any other SummaryWriter call goes to TensorBoard alone
        return getattr(self.writer, name)


def tee_writer(writer, run):
    """`writer` itself without a wandb run; else a writer that also logs to the run."""
    return writer if run is None else ScalarTee(writer, run)


def finish_wandb(run, model_path: str | None, save_artifacts: bool) -> None:
    """Log `model_path` as a model artifact (`save_artifacts`) and close the run."""
    if run is None:
        return
    if save_artifacts and model_path:
        import wandb

        artifact = wandb.Artifact(f"{run.name}_Final", type="model")
        artifact.add_file(model_path)
        run.log_artifact(artifact)
    run.finish()
