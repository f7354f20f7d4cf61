"""arcface_torch job configs load unchanged, each key with its meaning there; shipped configs by name."""

import os
import sys

import pytest

from shardface.configs import ConfigError, get_config
from shardface.configs.schema import served_notes as compat_notes

# arcface_torch's recognition/arcface_torch/configs/, base.py and __init__.py aside (written down by hand)
ARCFACE_TORCH_JOB_CONFIGS = """
3millions glint360k_mbf glint360k_r100 glint360k_r50 ms1mv2_mbf ms1mv2_r100 ms1mv2_r50 ms1mv3_mbf ms1mv3_r100
ms1mv3_r50 ms1mv3_r50_onegpu wf12m_conflict_r50 wf12m_conflict_r50_pfc03_filter04 wf12m_flip_pfc01_filter04_r50
wf12m_flip_r50 wf12m_mbf wf12m_pfc02_r100 wf12m_r100 wf12m_r50 wf42m_pfc0008_32gpu_r100
wf42m_pfc02_16gpus_mbf_bs8k wf42m_pfc02_16gpus_r100 wf42m_pfc02_16gpus_r50_bs8k wf42m_pfc02_32gpus_r50_bs4k
wf42m_pfc02_8gpus_r50_bs4k wf42m_pfc02_r100 wf42m_pfc02_r100_16gpus wf42m_pfc02_r100_32gpus wf42m_pfc02_vit_h
wf42m_pfc03_32gpu_r100 wf42m_pfc03_32gpu_r18 wf42m_pfc03_32gpu_r200 wf42m_pfc03_32gpu_r50
wf42m_pfc03_40epoch_64gpu_vit_b wf42m_pfc03_40epoch_64gpu_vit_l wf42m_pfc03_40epoch_64gpu_vit_s
wf42m_pfc03_40epoch_64gpu_vit_t wf42m_pfc03_40epoch_8gpu_vit_b wf42m_pfc03_40epoch_8gpu_vit_t wf4m_mbf wf4m_r100
wf4m_r50""".split()

# the arcface_torch format: no base, `config = edict()` and its keys, wandb and DALI keys included
VERBATIM = """from easydict import EasyDict as edict

# make training faster
config = edict()
config.margin_list = (1.0, 0.5, 0.0)
config.network = "r50"
config.resume = False
config.save_all_states = False
config.output = None
config.embedding_size = 512
config.sample_rate = 1
config.interclass_filtering_threshold = 0
config.fp16 = False
config.batch_size = 128
config.optimizer = "sgd"
config.lr = 0.1
config.momentum = 0.9
config.weight_decay = 5e-4
config.verbose = 2000
config.frequent = 10
config.dali = False
config.dali_aug = False
config.gradient_acc = 1
config.seed = 2048
config.num_workers = 2
config.wandb_key = "XXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXX"
config.suffix_run_name = None
config.using_wandb = False
config.wandb_entity = "entity"
config.wandb_project = "project"
config.wandb_log_all = True
config.save_artifacts = False
config.wandb_resume = False
config.rec = "/train_tmp/ms1m-retinaface-t1"
config.num_classes = 93431
config.num_image = 5179510
config.num_epoch = 20
config.warmup_epoch = 0
config.val_targets = ['lfw', 'cfp_fp', "agedb_30"]
"""


def test_configs_ship_all_42_arcface_torch_job_configs_and_each_loads():
    assert len(ARCFACE_TORCH_JOB_CONFIGS) == 42
    for name in ARCFACE_TORCH_JOB_CONFIGS:
        cfg = get_config(f"configs/{name}")
        assert cfg.output == os.path.join("work_dirs", name), name
        assert cfg.num_classes > 0 and cfg.num_image > 0


def test_shipped_arcface_configs_keep_their_values():
    cfg = get_config("configs/ms1mv3_r50")
    assert (cfg.network, tuple(cfg.margin_list), cfg.lr, cfg.num_classes, cfg.num_image, cfg.fp16) == (
        "r50",
        (1.0, 0.5, 0.0),
        0.1,
        93431,
        5179510,
        True,
    )
    cfg = get_config("configs/wf42m_pfc02_vit_h")
    assert (cfg.network, cfg.optimizer, cfg.lr, cfg.sample_rate, cfg.batch_size, cfg.dali, cfg.dali_aug) == (
        "vit_h",
        "adamw",
        0.001,
        0.5,
        768,
        True,
        True,
    )
    assert get_config("configs/glint360k_r100").margin_list == (1.0, 0.0, 0.4)


def test_verbatim_arcface_torch_config_loads_with_its_meanings(tmp_path):
    job = tmp_path / "my_arcface_job.py"
    job.write_text(VERBATIM)
    cfg = get_config(str(job))
    assert cfg.output == os.path.join("work_dirs", "my_arcface_job")  # output None
    assert cfg.wandb_project == "project" and cfg.wandb_log_all is True and cfg.suffix_run_name is None
    assert cfg.save_all_states is False and cfg.dali is False and cfg.sample_rate == 1
    assert compat_notes(cfg) == []
    job.write_text(VERBATIM.replace("config.output = None", "config.output = 'runs/x'"))
    assert get_config(str(job)).output == "runs/x"


def test_dali_is_served_by_shardface_loader_with_one_warning():
    notes = compat_notes(get_config("configs/wf42m_pfc02_vit_h"))
    assert len(notes) == 1 and "dali" in notes[0] and "own loader" in notes[0]
    assert compat_notes(get_config("configs/ms1mv3_r50")) == []


def test_unknown_keys_all_named_at_once_hint_only_when_close(tmp_path):
    job = tmp_path / "job.py"
    job.write_text(
        "from easydict import EasyDict as edict\nconfig = edict()\n"
        "config.sample_rat = 0.3\nconfig.zzz_unrelated = 1\nconfig.lr_schedular = 'poly'\n"
    )
    with pytest.raises(ConfigError) as err:
        get_config(str(job), ["--colour", "red"])
    msg = str(err.value)
    assert "\n" not in msg and str(job) in msg and "'colour' in command line" in msg
    assert "'sample_rat' (did you mean sample_rate?)" in msg
    assert "'lr_schedular' (did you mean lr_scheduler?)" in msg
    assert "'zzz_unrelated'," in msg and "zzz_unrelated' (" not in msg
    with pytest.raises(ConfigError) as err:
        get_config(None, ["--batchsize", "3", "--colour", "red"])
    msg = str(err.value)
    assert "'batchsize' (did you mean batch_size?)" in msg and "'colour' in command line" in msg


def test_shipped_configs_found_by_name_from_another_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert get_config("configs/ms1mv3_r50").num_classes == 93431
    assert get_config("ms1mv3_r50.py").num_classes == 93431
    assert get_config("glint360k_r100").num_classes == 360232
    with pytest.raises(ConfigError, match="config file not found: configs/nope"):
        get_config("configs/nope")
    (tmp_path / "configs").mkdir()  # a local file of the same name wins over the shipped one
    (tmp_path / "configs" / "ms1mv3_r50.py").write_text(
        "from easydict import EasyDict as edict\nconfig = edict()\nconfig.num_classes = 7\n"
    )
    assert get_config("configs/ms1mv3_r50").num_classes == 7


def test_using_wandb_without_wandb_stops_at_start_naming_pip_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` fails as when not installed
    with pytest.raises(ConfigError, match="pip install wandb"):
        get_config("configs/demo", ["--using_wandb", "true"])
    assert get_config("configs/demo").using_wandb is False  # not asked: wandb not needed
