"""The two accuracies a user meets on one .bin are named for what they are: `compare
--threshold-from` prints the best threshold's accuracy over all pairs (fitted to them),
`verify` the 10-fold protocol's (each fold judged at a threshold chosen on the others;
its legend is checked where tests/test_own_images.py runs it, which costs seconds)."""

import os

import torch

from shardface.backbones import get_model
from shardface.scripts.compare import main as compare
from tests.tool_files import jpeg


def test_compare_names_its_accuracy_the_best_threshold_one_over_all_pairs_not_verifys_10_fold(
    drawn_faces, tmp_path, capsys
):
    torch.manual_seed(0)
    model = str(tmp_path / "model.pt")
    torch.save(get_model("tiny", num_features=128).state_dict(), model)
    faces = []
    for i, colour in enumerate([(200, 40, 40), (40, 200, 40)]):
        faces.append(str(tmp_path / f"{i}.jpg"))
        open(faces[-1], "wb").write(jpeg(colour))
    val = os.path.join(drawn_faces, "drawn_faces_val.bin")
    capsys.readouterr()
    assert compare([model, *faces, "--network", "tiny", "--threshold-from", val]) == 0
    said = capsys.readouterr().out
    assert f"from {val}: the best over all its 40 pairs, " in said
    assert (
        " of them right at it (best-threshold accuracy; scripts.verify reports the 10-fold accuracy" in said
    )
