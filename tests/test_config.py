import pytest

from configs import ConfigError, get_config


def test_job_config_overrides_base_and_cli_overrides_both():
    cfg = get_config("configs/ms1mv3_r50.py", ["--lr", "0.2", "--fp16", "false", "--batch-size=64",
                                               "--margin_list", "1.0,0.0,0.4"])
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
