import pytest

from shardface.configs import ConfigError, get_config


def test_job_config_overrides_base_and_cli_overrides_both():
    cfg = get_config(
        "configs/ms1mv3_r50.py",
        ["--lr", "0.2", "--fp16", "false", "--batch-size=64", "--margin_list", "1.0,0.0,0.4"],
    )
    assert cfg.network == "r50" and cfg.num_classes == 93431
    assert cfg.lr == 0.2 and cfg.fp16 is False and cfg.batch_size == 64
    assert tuple(cfg.margin_list) == (1.0, 0.0, 0.4)
    assert get_config("configs/ms1mv3_r50").lr == 0.1


def test_values_are_parsed_to_the_defaults_type():
    cfg = get_config(None, ["--num_epoch", "3", "--val_targets", "['lfw','cfp_fp']"])
    assert cfg.num_epoch == 3 and isinstance(cfg.num_epoch, int)
    assert list(cfg.val_targets) == ["lfw", "cfp_fp"]
    with pytest.raises(ConfigError, match="--num_epoch"):
        get_config(None, ["--num_epoch", "three"])


def test_unknown_key_lists_close_matches():
    with pytest.raises(ConfigError, match="sample_rate"):
        get_config(None, ["--sample_rat", "0.3"])


@pytest.mark.parametrize("job", ["ms1mv3_r50", "glint360k_r100", "wf42m_pfc02_r100", "demo"])
def test_shipped_job_configs_resolve(job):
    cfg = get_config(f"configs/{job}.py")
    assert cfg.num_classes > 0 and cfg.batch_size > 0


@pytest.mark.parametrize(
    "override,message",
    [
        (["--batch_size", "-1"], "batch_size = -1: expected a positive integer"),
        (["--batch_size", "0"], "batch_size = 0"),
        (["--num_epoch", "0"], "num_epoch = 0"),
        (["--gradient_acc", "0"], "gradient_acc = 0"),
        (["--checkpoint_interval", "0"], "checkpoint_interval = 0"),
        (["--frequent", "0"], "frequent = 0"),
        (["--scale", "-32"], "scale = -32.0: expected a finite number > 0"),
        (["--lr", "inf"], "lr = inf: expected a finite number > 0"),
        (["--lr", "nan"], "lr = nan: expected a finite number > 0"),
        (["--lr", "-0.1"], "lr = -0.1: expected a finite number > 0"),
        (["--weight_decay", "inf"], "weight_decay = inf: expected a finite number >= 0"),
        (
            ["--margin_list", "1.0,1e999,0.0"],
            r"margin_list = \(1.0, inf, 0.0\): expected three finite numbers",
        ),
        (["--chunk_size", "-5"], "chunk_size = -5: expected an integer >= 0"),
        (["--keep_checkpoints", "-1"], "keep_checkpoints = -1"),
        (["--margin_list", "1.0,0.5"], r"margin_list = \(1.0, 0.5\): expected three finite numbers"),
        (["--lr_scheduler", "step"], "lr_scheduler = 'step': expected one of 'poly', 'cosine'"),
        (["--optimizer", "lamb"], "optimizer = 'lamb'"),
        (["--sample_rate", "-0.1"], r"sample_rate = -0.1: expected a number in \[0.0, 1.0\]"),
        (["--fp16", "true", "--bf16", "true"], "choose one"),
        (["--distill_center_samples", "0"], "distill_center_samples = 0: expected an integer >= 2"),
        (["--distill_center_samples", "-1"], "distill_center_samples = -1: expected an integer >= 2"),
        (["--distill_center_samples", "1"], "distill_center_samples = 1: expected an integer >= 2"),
    ],
)
def test_out_of_range_values_fail_at_start_naming_key_and_value(override, message):
    with pytest.raises(ConfigError, match=message):
        get_config("configs/demo.py", override)


def test_job_config_values_are_validated_too(tmp_path):
    job = tmp_path / "job.py"
    job.write_text("from easydict import EasyDict as edict\nconfig = edict()\nconfig.batch_size = '64'\n")
    with pytest.raises(ConfigError, match="batch_size = '64': expected a positive integer"):
        get_config(str(job))


@pytest.mark.parametrize(
    "body,where,what",
    [
        ("config = (\n", ":1:", "was never closed"),
        (
            "from easydict import EasyDict as edict\nconfig = edict()\nconfig.lr = undefined_name\n",
            ":3:",
            "NameError: name 'undefined_name' is not defined",
        ),
        ("x = 1\nconfig = 5\n", ":2:", "config is int 5, expected a mapping"),
        ("x = 1\n", "", "defines no `config`"),
    ],
)
def test_a_config_file_that_fails_is_one_error_naming_file_and_line(tmp_path, body, where, what):
    job = tmp_path / "job.py"
    job.write_text(body)
    with pytest.raises(ConfigError) as caught:
        get_config(str(job))
    assert str(caught.value).startswith(f"{job}{where}") and what in str(caught.value), str(caught.value)


def test_resume_accepts_auto():
    assert get_config(None, ["--resume", "auto"]).resume == "auto"
    assert get_config(None, ["--resume", "true"]).resume is True
    with pytest.raises(ConfigError, match="--resume"):
        get_config(None, ["--resume", "maybe"])


def test_batch_size_1_is_refused_for_batchnorm():
    with pytest.raises(ConfigError, match="batch_size = 1.*BatchNorm"):
        get_config(None, ["--batch_size", "1"])


def test_a_run_ending_inside_its_warmup_is_named_and_a_longer_one_is_not():
    from shardface.configs.validate import warmup_problem

    assert "step 100, inside its 500-step warmup" in warmup_problem(100, 500)
    assert warmup_problem(500, 500) is None and warmup_problem(1000, 0) is None


def test_every_key_has_a_kind_that_takes_its_default_and_refuses_another_type_and_a_help():
    from shardface.configs.schema import Kind, keys

    for name, key in keys().items():
        assert isinstance(key.kind, Kind) and type(key.kind) is not Kind, name
        assert key.help.strip(), name
        assert key.kind.refuses(key.default) == "", name
        assert key.kind.refuses(object()) != "", name
        assert get_config(None, [f"--{name}", repr(key.default).strip("'")])[name] == key.default, name


def test_the_dump_hides_secret_values_and_the_ranks_compare_all_but_the_per_rank_keys():
    from shardface.configs import format_config
    from shardface.configs.schema import keys, rank_independent

    cfg = get_config(None, ["--wandb_key", "k3y-abc123", "--num_workers", "5"])
    dump = format_config(cfg)
    assert "k3y-abc123" not in dump and "wandb_key" in dump and "<hidden>" in dump
    assert "num_workers" in dump and len(dump.splitlines()) == len(keys())
    assert set(cfg) - set(rank_independent(cfg)) == {"output", "num_workers"}


def test_a_key_added_to_the_schema_gets_help_validation_parsing_and_the_ranks_check(monkeypatch):
    from shardface.configs.schema import SECTIONS, Integer, Key, describe_keys, rank_independent

    monkeypatch.setitem(SECTIONS["data"], "shuffle_buffer", Key(64, Integer(1), "records held for shuffling"))
    assert "  --shuffle_buffer 64    records held for shuffling" in describe_keys().splitlines()
    cfg = get_config("configs/demo.py", ["--shuffle_buffer", "128"])
    assert cfg.shuffle_buffer == 128 and rank_independent(cfg)["shuffle_buffer"] == 128
    assert get_config(None).shuffle_buffer == 64
    with pytest.raises(ConfigError, match="shuffle_buffer = 0: expected a positive integer"):
        get_config(None, ["--shuffle_buffer", "0"])
    with pytest.raises(ConfigError, match="did you mean shuffle_buffer"):
        get_config(None, ["--shuffle_bufer", "8"])
