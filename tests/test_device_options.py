"""Where the tools run a model (--device) and in what precision (--precision): checked at start,
one line each; on a GPU, fp16 and bf16 embeddings stay within a small angle of fp32's."""

import numpy as np
import pytest
import torch

from shardface.scripts.embed import main as embed_tool
from tests.tool_files import photos, tiny_model


@pytest.mark.parametrize(
    "argv,said",
    [
        (["--device", "tpu"], "--device tpu: cpu, cuda or cuda:N"),
        (["--device", "cuda:7"], "--device cuda:7: "),
        (["--device", "cpu", "--precision", "fp16"], "--precision fp16: for a model on a GPU"),
    ],
)
def test_a_device_or_precision_the_machine_cannot_give_is_one_line_before_any_work(
    tmp_path, capsys, argv, said
):
    if argv[:2] == ["--device", "cuda:7"] and torch.cuda.device_count() > 7:
        pytest.skip("this machine has a cuda:7")
    model = tiny_model(str(tmp_path / "m"))
    faces = photos(tmp_path / "faces", ids=1, per_id=2)
    assert embed_tool([model, faces, "--out", str(tmp_path / "e.npy"), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and said in err[0] and not (tmp_path / "e.npy").exists()


def test_device_cpu_embeds_as_the_default_does_on_a_cpu_machine(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("the default is the GPU here")
    model = tiny_model(str(tmp_path / "m"))
    faces = photos(tmp_path / "faces", ids=2, per_id=2)
    for name, extra in (("default", []), ("cpu", ["--device", "cpu"])):
        assert embed_tool([model, faces, "--out", str(tmp_path / f"{name}.npy"), *extra]) == 0
    np.testing.assert_array_equal(np.load(tmp_path / "default.npy"), np.load(tmp_path / "cpu.npy"))


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_low_precision_embeddings_on_a_gpu_stay_close_to_fp32(tmp_path, precision):
    """Unit rows of a 128-D network: fp16 (bf16) within 1e-3 (1e-2) of fp32's cosine 1."""
    from shardface.infer.model import load_model

    crops = torch.randint(0, 256, (64, 3, 150, 150), dtype=torch.uint8)
    full = load_model("dlib", device=torch.device("cuda")).embed_crops(crops)
    low = load_model("dlib", device=torch.device("cuda"), precision=precision).embed_crops(crops)
    cosines = (full.astype(np.float64) * low).sum(1)
    assert cosines.min() > (1 - 1e-3 if precision == "fp16" else 1 - 1e-2), cosines.min()
