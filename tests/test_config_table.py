"""Every job config shipped in configs/ loads with get_config and carries the values of a table
written down here: arcface_torch's 42 job configs with the values of its files (read from
insightface recognition/arcface_torch/configs/), ShardFace's own configs with theirs."""

import os

import pytest

from shardface.configs import get_config

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
KEYS = (
    "network",
    "num_classes",
    "sample_rate",
    "lr",
    "batch_size",
    "optimizer",
    "num_epoch",
    "warmup_epoch",
    "margin_list",
)
ARCFACE_TORCH = {
    "3millions": ("mbf", 300000, 0.1, 0.1, 512, "sgd", 30, -1, (1.0, 0.0, 0.4)),
    "glint360k_mbf": ("mbf", 360232, 1.0, 0.1, 128, "sgd", 20, 0, (1.0, 0.0, 0.4)),
    "glint360k_r100": ("r100", 360232, 1.0, 0.1, 128, "sgd", 20, 0, (1.0, 0.0, 0.4)),
    "glint360k_r50": ("r50", 360232, 1.0, 0.1, 128, "sgd", 20, 0, (1.0, 0.0, 0.4)),
    "ms1mv2_mbf": ("mbf", 85742, 1.0, 0.1, 128, "sgd", 40, 0, (1.0, 0.5, 0.0)),
    "ms1mv2_r100": ("r100", 85742, 1.0, 0.1, 128, "sgd", 20, 0, (1.0, 0.5, 0.0)),
    "ms1mv2_r50": ("r50", 85742, 1.0, 0.1, 128, "sgd", 20, 0, (1.0, 0.5, 0.0)),
    "ms1mv3_mbf": ("mbf", 93431, 1.0, 0.1, 128, "sgd", 40, 0, (1.0, 0.5, 0.0)),
    "ms1mv3_r100": ("r100", 93431, 1.0, 0.1, 128, "sgd", 20, 0, (1.0, 0.5, 0.0)),
    "ms1mv3_r50": ("r50", 93431, 1.0, 0.1, 128, "sgd", 20, 0, (1.0, 0.5, 0.0)),
    "ms1mv3_r50_onegpu": ("r50", 93431, 1.0, 0.02, 128, "sgd", 20, 0, (1.0, 0.5, 0.0)),
    "wf12m_conflict_r50": ("r50", 1017970, 1.0, 0.1, 128, "sgd", 20, 2, (1.0, 0.0, 0.4)),
    "wf12m_conflict_r50_pfc03_filter04": ("r50", 1017970, 0.3, 0.1, 128, "sgd", 20, 2, (1.0, 0.0, 0.4)),
    "wf12m_flip_pfc01_filter04_r50": ("r50", 617970, 0.1, 0.1, 128, "sgd", 20, 2, (1.0, 0.0, 0.4)),
    "wf12m_flip_r50": ("r50", 617970, 1.0, 0.1, 128, "sgd", 20, 2, (1.0, 0.0, 0.4)),
    "wf12m_mbf": ("mbf", 617970, 1.0, 0.1, 128, "sgd", 20, 0, (1.0, 0.0, 0.4)),
    "wf12m_pfc02_r100": ("r100", 617970, 0.2, 0.1, 128, "sgd", 20, 0, (1.0, 0.0, 0.4)),
    "wf12m_r100": ("r100", 617970, 1.0, 0.1, 128, "sgd", 20, 0, (1.0, 0.0, 0.4)),
    "wf12m_r50": ("r50", 617970, 1.0, 0.1, 128, "sgd", 20, 0, (1.0, 0.0, 0.4)),
    "wf42m_pfc0008_32gpu_r100": ("r100", 2059906, 0, 0.4, 512, "sgd", 20, 2, (1.0, 0.0, 0.4)),
    "wf42m_pfc02_16gpus_mbf_bs8k": ("mbf", 2059906, 0.2, 0.4, 512, "sgd", 20, 2, (1.0, 0.0, 0.4)),
    "wf42m_pfc02_16gpus_r100": ("r100", 2059906, 0.2, 0.3, 256, "sgd", 20, 1, (1.0, 0.0, 0.4)),
    "wf42m_pfc02_16gpus_r50_bs8k": ("r50", 2059906, 0.2, 0.6, 512, "sgd", 20, 4, (1.0, 0.0, 0.4)),
    "wf42m_pfc02_32gpus_r50_bs4k": ("r50", 2059906, 0.2, 0.4, 128, "sgd", 20, 2, (1.0, 0.0, 0.4)),
    "wf42m_pfc02_8gpus_r50_bs4k": ("r50", 2059906, 0.2, 0.4, 512, "sgd", 20, 2, (1.0, 0.0, 0.4)),
    "wf42m_pfc02_r100": ("r100", 2059906, 0.2, 0.1, 128, "sgd", 20, 0, (1.0, 0.0, 0.4)),
    "wf42m_pfc02_r100_16gpus": ("r100", 2059906, 0.2, 0.2, 128, "sgd", 20, 2, (1.0, 0.0, 0.4)),
    "wf42m_pfc02_r100_32gpus": ("r100", 2059906, 0.2, 0.4, 128, "sgd", 20, 2, (1.0, 0.0, 0.4)),
    "wf42m_pfc02_vit_h": ("vit_h", 2059906, 0.5, 0.001, 768, "adamw", 16, 2, (1.0, 0.0, 0.4)),
    "wf42m_pfc03_32gpu_r100": ("r100", 2059906, 0.3, 0.4, 128, "sgd", 20, 2, (1.0, 0.0, 0.4)),
    "wf42m_pfc03_32gpu_r18": ("r18", 2059906, 0.3, 0.4, 128, "sgd", 20, 2, (1.0, 0.0, 0.4)),
    "wf42m_pfc03_32gpu_r200": ("r200", 2059906, 0.3, 0.4, 128, "sgd", 20, 2, (1.0, 0.0, 0.4)),
    "wf42m_pfc03_32gpu_r50": ("r50", 2059906, 0.3, 0.4, 128, "sgd", 20, 2, (1.0, 0.0, 0.4)),
    "wf42m_pfc03_40epoch_64gpu_vit_b": (
        "vit_b_dp005_mask_005",
        2059906,
        0.3,
        0.001,
        384,
        "adamw",
        40,
        4,
        (1.0, 0.0, 0.4),
    ),
    "wf42m_pfc03_40epoch_64gpu_vit_l": (
        "vit_l_dp005_mask_005",
        2059906,
        0.3,
        0.001,
        384,
        "adamw",
        40,
        4,
        (1.0, 0.0, 0.4),
    ),
    "wf42m_pfc03_40epoch_64gpu_vit_s": (
        "vit_s_dp005_mask_0",
        2059906,
        0.3,
        0.001,
        384,
        "adamw",
        40,
        4,
        (1.0, 0.0, 0.4),
    ),
    "wf42m_pfc03_40epoch_64gpu_vit_t": (
        "vit_t_dp005_mask0",
        2059906,
        0.3,
        0.001,
        384,
        "adamw",
        40,
        4,
        (1.0, 0.0, 0.4),
    ),
    "wf42m_pfc03_40epoch_8gpu_vit_b": (
        "vit_b_dp005_mask_005",
        2059906,
        0.3,
        0.001,
        256,
        "adamw",
        40,
        4,
        (1.0, 0.0, 0.4),
    ),
    "wf42m_pfc03_40epoch_8gpu_vit_t": (
        "vit_t_dp005_mask0",
        2059906,
        0.3,
        0.001,
        512,
        "adamw",
        40,
        4,
        (1.0, 0.0, 0.4),
    ),
    "wf4m_mbf": ("mbf", 205990, 1.0, 0.1, 128, "sgd", 20, 0, (1.0, 0.0, 0.4)),
    "wf4m_r100": ("r100", 205990, 1.0, 0.1, 128, "sgd", 20, 0, (1.0, 0.0, 0.4)),
    "wf4m_r50": ("r50", 205990, 1.0, 0.1, 128, "sgd", 20, 0, (1.0, 0.0, 0.4)),
}
SHARDFACE_ONLY = {  # the same keys, then the margin
    "demo": ("tiny", 400, 1.0, 0.1, 64, "sgd", 8, 1, (1.0, 0.0, 0.35), "combined"),
    "ms1mv3_r50_adaface": ("r50", 93431, 1.0, 0.1, 128, "sgd", 20, 0, (1.0, 0.5, 0.0), "adaface"),
    "ms1mv3_r50_curricularface": (
        "r50",
        93431,
        1.0,
        0.1,
        128,
        "sgd",
        20,
        0,
        (1.0, 0.5, 0.0),
        "curricularface",
    ),
    "ms1mv3_r50_magface": ("r50", 93431, 1.0, 0.1, 128, "sgd", 20, 0, (1.0, 0.5, 0.0), "magface"),
    "ms1mv3_r50_subcenter_arcface": (
        "r50",
        93431,
        1.0,
        0.1,
        128,
        "sgd",
        20,
        0,
        (1.0, 0.5, 0.0),
        "subcenter_arcface",
    ),
    "real_faces": ("mbf", 298, 1.0, 0.1, 64, "sgd", 10, 1, (1.0, 0.0, 0.35), "combined"),
    "parity": ("mbf", 298, 1.0, 0.1, 64, "sgd", 10, 0, (1.0, 0.5, 0.0), "combined"),
}


def _job_configs() -> list[str]:
    """Names of the files in configs/ that define a job (`config = edict()`), base.py aside."""
    names = []
    for name in sorted(os.listdir(CONFIGS)):
        if name.endswith(".py") and name != "base.py":
            with open(os.path.join(CONFIGS, name)) as f:
                if "config = edict()" in f.read():
                    names.append(name[:-3])
    return names


def test_every_shipped_config_is_in_the_table_and_all_42_arcface_torch_names_ship():
    assert len(ARCFACE_TORCH) == 42
    assert set(_job_configs()) == set(ARCFACE_TORCH) | set(SHARDFACE_ONLY)


@pytest.mark.parametrize("name", sorted(ARCFACE_TORCH) + sorted(SHARDFACE_ONLY))
def test_shipped_config_loads_with_its_table_values(name):
    cfg = get_config(f"configs/{name}")
    row = ARCFACE_TORCH.get(name) or SHARDFACE_ONLY[name]
    got = tuple(tuple(cfg[k]) if k == "margin_list" else cfg[k] for k in KEYS)
    assert got == row[: len(KEYS)], name
    if name in ARCFACE_TORCH:  # the combined margin of its margin_list; output None: work_dirs/<name>
        assert cfg.margin == "combined" and cfg.output == os.path.join("work_dirs", name)
    else:
        assert cfg.margin == row[len(KEYS)]
