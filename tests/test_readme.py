"""README and docs/ hold what they say: README stays a short read (at most 300 lines, none over 100
columns); every relative link in README, docs/ and benchmarks/ points to a file (and heading)
that exists; every `python -m scripts.X` names a module of the tree. And their commands work as
typed: in a fresh copy of the tree, `make demo`, then every command of the bash blocks of
README and docs/*.md that a CPU can run without research data, each in a shell that did
`source .venv/bin/activate` as README says, on photos made under the names the docs use
(tests/astronaut.py), the walk through one's own photos in a copy of its own. Every command shown is listed in `COMMANDS`, with the reason when it is not run
here; a new command fails the test until it is listed. (Commands quoted inline in the prose are
not walked.) Every `python`/`torchrun` command shown, run here or not, has its arguments parsed
by the program's own parser (train.py's config keys, a tool's or a benchmark's options), so a
mistyped option in any of them fails."""

import argparse
import glob
import importlib
import os
import re
import runpy
import shlex
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["README.md"] + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
LINKED = (
    DOCS
    + ["benchmarks/README.md"]
    + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "benchmarks", "runs", "*.md")))
)
# Files a link may name before they are committed: the lead generates this picture with
# Model.draw (README 'Python'); drop the entry once it is in the tree.
PENDING: set[str] = set()  # files a link may name before they are committed
RUN = None  # run as typed
NEEDS_GPU = "needs GPUs"
NEEDS_DATA = "needs a research data set (MS1M, LFW, CFP, IJB) or a run trained on one"
COMMANDS = {
    "make demo": RUN,
    "make test": "the test suite itself, of which this test is a part",
    "python3 -m venv .venv && .venv/bin/pip install torch torchvision --index-url "
    "https://download.pytorch.org/whl/cpu": "installs torch from the network",
    "python -m scripts.verify work_dirs/demo --bin data/drawn_faces/drawn_faces_val.bin": RUN,
    "python -m scripts.export_onnx work_dirs/demo": RUN,
    "python -m scripts.plan configs/demo.py --gpus 2": RUN,
    "python train.py configs/demo.py --output work_dirs/demo_1rank --max_steps 20 --warmup_epoch 0": RUN,
    "torchrun --nproc_per_node 8 train.py configs/ms1mv3_r50 --rec /data/ms1m-retinaface-t1": NEEDS_GPU,
    "scripts/train.sh configs/glint360k_r100 8 --batch_size 128": NEEDS_GPU,
    "NNODES=2 NPROC=8 RDZV_HOST=node0 scripts/train_multinode.sh configs/wf42m_pfc02_r100": NEEDS_GPU,
    "torchrun --nproc_per_node 4 train.py configs/ms1mv3_r50 --resume true": NEEDS_GPU,
    "torchrun --nproc_per_node 8 --max-restarts 3 train.py configs/ms1mv3_r50 --resume auto": NEEDS_GPU,
    "MAX_RESTARTS=3 NNODES=2 NPROC=8 RDZV_HOST=node0 scripts/train_multinode.sh configs/wf42m_pfc02_r100 "
    "--resume auto": NEEDS_GPU,
    "srun torchrun --nproc_per_node 8 train.py configs/ms1mv3_r50 --resume auto --stop_after_steps 20000": NEEDS_GPU,
    "make test-gpu": NEEDS_GPU,
    "make test-gpu PY=python3 GPU_SETUP=": NEEDS_GPU,  # its plan without a GPU: test_make_test_gpu_offline_installs_nothing
    "python benchmarks/gpu.py": RUN,  # on a CPU it says so and exits 0
    "python benchmarks/gpu.py --smoke": RUN,
    "git clone --depth 1 https://github.com/deepinsight/insightface /tmp/insightface": "needs the network",
    # on a CPU it says so and exits 0
    "python benchmarks/whole_step.py --arcface_torch /tmp/insightface/recognition/arcface_torch": RUN,
    "python benchmarks/whole_step.py --smoke": RUN,
    "ARCFACE_TORCH=/tmp/insightface/recognition/arcface_torch benchmarks/gpu_round3.sh": NEEDS_GPU,
    "python benchmarks/lfw_anchor.py --images LFW --pairs_list pairs.txt": "LFW (research data, not shipped); "
    "tests/test_lfw_anchor.py runs it on a small LFW-layout fixture (slow)",
    "python benchmarks/real_faces.py --celeb CELEB --lfw LFW --pairs_list pairs.txt": NEEDS_DATA,
    "python -m scripts.verify work_dirs/ms1mv3_r50 --bin /data/lfw.bin --bin /data/cfp_fp.bin": NEEDS_DATA,
    "python -m scripts.ijb work_dirs/ms1mv3_r50 --root /data/IJB_release/IJBC --target IJBC --roc roc.png": NEEDS_DATA,
    "python -m scripts.export_onnx work_dirs/ms1mv3_r50": NEEDS_DATA,
    "python -m scripts.export_onnx insightface_r100/model.pt r100.onnx --network r100": NEEDS_DATA,
    "python -m scripts.align photos aligned": RUN,
    "python -m scripts.embed dlib photos --align --out emb.npy": RUN,
    "python -m scripts.compare dlib a.jpg b.jpg --align": RUN,
    "python -m scripts.identify dlib --gallery people --align group.jpg": RUN,
    "torchrun --nnodes 4 --nproc_per_node 1 --node_rank $NODE --master_addr $HEAD --master_port 29500 "
    "-m scripts.pack_rec /data/photos/train /data/mine --align": "needs 4 machines and a photo set",
    "mkdir -p aligned data": RUN,
    "python -m scripts.align photos/train aligned/train --largest": RUN,
    "python -m scripts.align photos/held_out aligned/held_out --largest": RUN,
    "python -m scripts.pack_rec aligned/train data/mine": RUN,
    "python -m scripts.make_bin aligned/held_out data/mine/mine_val.bin --seed 0": RUN,
    "python train.py configs/demo.py --rec data/mine --num_classes 34 --val_targets \"['mine_val']\" "
    "--output work_dirs/mine": RUN,
    "python -m scripts.verify work_dirs/mine --bin data/mine/mine_val.bin": RUN,
    "python -m scripts.export_onnx work_dirs/mine work_dirs/mine/model.onnx": RUN,
    "python -m scripts.embed work_dirs/mine/model.onnx photos/held_out --align --out emb.npy": RUN,
    "python -m scripts.compare work_dirs/mine a.jpg b.jpg --align --threshold-from data/mine/mine_val.bin": RUN,
    "python -m scripts.identify work_dirs/mine --gallery people --align --top 3 "
    "--threshold-from data/mine/mine_val.bin group.jpg more_photos/": RUN,
    "python -m scripts.identify_eval work_dirs/mine photos/held_out --align --gallery_per_id 1 "
    "--unknown_ids 5 --plot cmc_det.png": RUN,
    "python -m scripts.ijb work_dirs/ms1mv3_r50 --root /data/IJB_release/IJBC --target IJBC --protocol 1:N": NEEDS_DATA,
    "python -m scripts.import_arcface_torch configs/ms1mv3_r50 old_run/ work_dirs/ms1mv3_r50 --num_epoch 25": NEEDS_DATA,
    "python -m scripts.embed dlib photos/held_out --align --no_flip --out dlib.npy": RUN,
    "python -m scripts.export_onnx dlib dlib.onnx": RUN,
    "python train.py configs/demo.py --rec data/mine --num_classes 34 --network dlib_resnet "
    "--embedding_size 128 --init_backbone dlib --lr 0.01 --val_targets \"['mine_val']\" --output work_dirs/mine_dlib": RUN,
    "torchrun --nproc_per_node 8 train.py configs/ms1mv3_r50 --num_epoch 25 --output work_dirs/ms1mv3_r50 --resume true": NEEDS_GPU,
    "torchrun --nproc_per_node 8 train.py configs/my_faces --init_backbone ms1mv3_r50/model.pt": NEEDS_GPU,
    "torchrun --nproc_per_node 8 train.py configs/ms1mv3_mbf --teacher work_dirs/ms1mv3_r100 --distill_loss cosine": NEEDS_GPU,
    "python -m scripts.teach work_dirs/ms1mv3_r100 /data/ms1m-retinaface-t1 r100_ms1m.teacher": NEEDS_DATA,
    "torchrun --nproc_per_node 8 train.py configs/ms1mv3_mbf --teacher r100_ms1m.teacher --distill_loss relational": NEEDS_GPU,
    "torchrun --nproc_per_node 8 train.py configs/ms1mv3_mbf --rec /data/my_crops --num_classes 0 "
    "--teacher work_dirs/ms1mv3_r100": NEEDS_GPU,
}


def readme_commands(text: str) -> list[str]:
    """The commands of the ```bash blocks, in order: comments dropped, continued lines joined."""
    commands = []
    for block in re.findall(r"^```bash\n(.*?)^```", text, flags=re.S | re.M):
        pending = ""
        for line in block.splitlines():
            line = re.sub(r"(^|\s+)#.*$", "", line).rstrip()
            if line.endswith("\\"):
                pending += line[:-1].strip() + " "
                continue
            line = (pending + line.strip()).strip()
            pending = ""
            if line:
                commands.append(line)
    return commands


def documented_commands(root: str = ROOT) -> list[str]:
    """The commands of README's and docs/*.md's bash blocks, README first."""
    return [c for name in DOCS for c in readme_commands(open(os.path.join(root, name)).read())]


def test_every_readme_command_is_listed():
    commands = documented_commands()
    unlisted = [c for c in commands if c not in COMMANDS]
    assert not unlisted, (
        f"commands of README/docs not in tests/test_readme.py's COMMANDS (run, or why not): {unlisted}"
    )
    assert "make demo" in commands and "make test" in commands and len(commands) >= 10
    stale = [c for c in COMMANDS if c not in commands]
    assert not stale, f"COMMANDS lists commands no longer in README or docs/: {stale}"


class _Parsed(BaseException):
    """Raised by a program's parser once its arguments parse: nothing of the program runs."""


def _program(command: str) -> tuple[str, list[str]] | None:
    """(train.py, scripts.X or benchmarks/x.py; its arguments) of a python or torchrun command,
    past variables set before it and srun; None for any other command."""
    words = shlex.split(command.split("&&")[-1])
    while words and (re.match(r"^[A-Z_]+=", words[0]) or words[0] == "srun"):
        words = words[1:]
    if not words or words[0] not in ("python", "python3", "torchrun"):
        return None
    for i, word in enumerate(words[1:], 1):
        if word == "-m":
            return (words[i + 1], words[i + 2 :]) if words[i + 1].startswith("scripts.") else None
        if word.endswith(".py"):
            return word, words[i + 1 :]
    return None


# programs whose arguments are a config and `--key value` config keys, after this many positionals
CONFIG_KEYS_AFTER = {"train.py": 1, "scripts.import_arcface_torch": 3}


def _parse(program: str, argv: list[str]) -> None:
    """Raises where `argv` does not parse (SystemExit from argparse, a ConfigError from config keys)."""
    if program in CONFIG_KEYS_AFTER:  # a config the docs name as the user's own: its keys on the base
        from shardface.configs import get_config, resolve_config_path
        from shardface.errors import ConfigError

        try:
            path = resolve_config_path(argv[0])
        except ConfigError:
            path = None
        get_config(path, argv[CONFIG_KEYS_AFTER[program] :])
        return
    try:  # scripts.plan parses its config keys beside its options (parse_known_args): it runs, in a second
        if program.startswith("scripts."):
            code = importlib.import_module(f"shardface.{program}").main(argv)
        else:
            sys.argv = [program, *argv]
            runpy.run_path(os.path.join(ROOT, program), run_name="__main__")
            code = 0
    except _Parsed:
        return
    assert code == 0, f"exit {code}"


def test_every_python_command_the_docs_show_parses(monkeypatch, capsys):
    real = argparse.ArgumentParser.parse_args

    def parse_only(self, args=None, namespace=None):
        real(self, args, namespace)
        raise _Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_only)
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    failures, parsed = [], 0
    for command in documented_commands():
        program = _program(command)
        if program is None:
            continue
        try:
            _parse(*program)
            parsed += 1
        except (SystemExit, Exception) as exc:
            failures.append(f"$ {command}\n  {type(exc).__name__}: {exc} {capsys.readouterr().err[-500:]}")
    assert not failures, "\n".join(failures)
    assert parsed >= 40, parsed


def test_readme_is_short_and_narrow():
    lines = open(os.path.join(ROOT, "README.md")).read().splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines; move details to docs/"
    wide = [(n, len(line)) for n, line in enumerate(lines, 1) if len(line) > 100]
    assert not wide, f"README.md lines over 100 columns (line, width): {wide}"


def _prose(text: str) -> str:
    """The text with fenced code blocks and inline code spans blanked out."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: str) -> set[str]:
    seen: dict[str, int] = {}
    anchors = set()
    text = re.sub(r"^```.*?^```", "", open(path).read(), flags=re.S | re.M)
    for heading in re.findall(r"^#{1,6}\s+(.*?)\s*#*$", text, flags=re.M):
        slug = _slug(heading)
        anchors.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return anchors


def _links(text: str) -> list[str]:
    prose = _prose(text)
    inline = re.findall(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", prose)
    defined = re.findall(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$", prose, flags=re.M)
    return inline + defined


def test_every_relative_link_points_to_a_file_that_exists():
    broken = []
    for name in LINKED:
        here = os.path.dirname(os.path.join(ROOT, name))
        for target in _links(open(os.path.join(ROOT, name)).read()):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            full = os.path.normpath(os.path.join(here, path)) if path else os.path.join(ROOT, name)
            if not os.path.exists(full):
                if os.path.relpath(full, ROOT) not in PENDING:
                    broken.append(f"{name}: {target} (no such file)")
            elif anchor and full.endswith(".md") and anchor not in _anchors(full):
                broken.append(f"{name}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_every_module_the_docs_run_exists():
    missing = []
    for name in DOCS:  # benchmarks/runs/ logs name modules as they were then
        prose_and_code = open(os.path.join(ROOT, name)).read()
        for package, module in re.findall(r"-m\s+(scripts|benchmarks)\.(\w+)", prose_and_code):
            if not os.path.isfile(os.path.join(ROOT, package, module + ".py")):
                missing.append(f"{name}: python -m {package}.{module}")
        for module in re.findall(r"\bscripts\.([a-z_]+)\b", prose_and_code):
            if not os.path.isfile(os.path.join(ROOT, "scripts", module + ".py")):
                missing.append(f"{name}: scripts.{module}")
        for script in re.findall(r"\b(benchmarks/\w+\.py)\b", prose_and_code):
            if not os.path.isfile(os.path.join(ROOT, script)):
                missing.append(f"{name}: {script}")
    assert not missing, "\n".join(missing)


def test_every_shardface_command_name_is_installed():
    names = set(
        re.findall(r"^(shardface-[a-z-]+)\s*=", open(os.path.join(ROOT, "pyproject.toml")).read(), flags=re.M)
    )
    unknown = [
        f"{name}: {tool}"
        for name in LINKED
        for tool in re.findall(r"\b(shardface-[a-z][a-z-]*[a-z])\b", open(os.path.join(ROOT, name)).read())
        if tool not in names
    ]
    assert not unknown, f"shardface-* names that pyproject.toml does not install: {unknown}"


def _fresh_copy(dst: str) -> None:
    """The tree as a clone has it (tracked and new files, nothing git ignores), with a .venv
    made of links to this one's parts and a fresh install stamp, so make installs nothing."""
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split("\0")
    for name in filter(None, files):
        if os.path.islink(
            os.path.join(ROOT, name)
        ):  # `shardface`, the link to the root: a link, as git makes it
            os.makedirs(os.path.dirname(os.path.join(dst, name)) or dst, exist_ok=True)
            os.symlink(os.readlink(os.path.join(ROOT, name)), os.path.join(dst, name))
        elif os.path.isfile(os.path.join(ROOT, name)):
            os.makedirs(os.path.dirname(os.path.join(dst, name)) or dst, exist_ok=True)
            shutil.copy2(os.path.join(ROOT, name), os.path.join(dst, name))
    venv = os.path.realpath(os.path.join(ROOT, ".venv"))
    os.makedirs(os.path.join(dst, ".venv"))
    for entry in os.listdir(venv):
        if not entry.startswith("."):
            os.symlink(os.path.join(venv, entry), os.path.join(dst, ".venv", entry))
    open(os.path.join(dst, ".venv", ".installed-requirements"), "w").close()


# the docs' walk through one's own photos runs in a copy of its own: photos.md trains work_dirs/mine, which
# identification.md's commands use, and its outputs (emb.npy, aligned/) would meet README's
PHOTO_WALK = ("docs/photos.md", "docs/identification.md")


def _run_as_typed(clone: str, commands: list[str]) -> list[str]:
    """Each command in a shell that sourced .venv/bin/activate (make's as they are); the failures."""
    env = {k: v for k, v in os.environ.items() if k not in ("SHARDFACE_DEBUG", "PYTHONPATH", "VIRTUAL_ENV")}
    failures = []
    for command in commands:
        if COMMANDS.get(command, RUN) is not RUN:
            continue
        shell = command if command.startswith("make ") else f"source .venv/bin/activate && {command}"
        proc = subprocess.run(
            ["bash", "-c", shell],
            cwd=clone,
            env=env,
            capture_output=True,
            text=True,
            timeout=3600 if command == "make demo" else 900,
        )
        if proc.returncode != 0:
            failures.append(f"$ {command}  -> exit {proc.returncode}\n{(proc.stdout + proc.stderr)[-1500:]}")
    return failures


@pytest.mark.slow
def test_readme_commands_run_as_typed_after_make_demo(tmp_path):
    """Every command marked RUN, on the photos the docs name (tests/astronaut.py makes them)."""
    pytest.importorskip("dlib")
    from tests.astronaut import documented_photos

    failures = []
    for name, docs in (("main", [d for d in DOCS if d not in PHOTO_WALK]), ("photos", list(PHOTO_WALK))):
        clone = tmp_path / name
        _fresh_copy(str(clone))
        documented_photos(clone)
        commands = [c for doc in docs for c in readme_commands(open(clone / doc).read())]
        failures += _run_as_typed(str(clone), commands)
    assert not failures, "\n\n".join(failures)


def test_make_test_gpu_offline_installs_nothing():
    """On a GPU machine without internet (the lent ones), `make test-gpu PY=python3 GPU_SETUP=`
    runs the kit with that python: no venv, no pip (make -n -B: the whole plan, nothing run)."""
    import subprocess

    plan = subprocess.run(
        ["make", "-n", "-B", "test-gpu", "PY=python3", "GPU_SETUP="],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert plan.returncode == 0, plan.stderr
    assert "pip" not in plan.stdout and "venv" not in plan.stdout
    assert "python3 -m pytest -q -m gpu" in plan.stdout
    default = subprocess.run(
        ["make", "-n", "-B", "test-gpu"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert "pip install" in default.stdout  # the usual target still sets up .venv first


def _python_block() -> str:
    """The README's Python section's code block, as the README holds it."""
    text = open(os.path.join(ROOT, "README.md")).read()
    section = text[text.index("\n## Python\n") :]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_readmes_python_block_runs_as_written(tmp_path, monkeypatch):
    """Its own code, run on the files it names: skimage's astronaut (public domain), two photos
    of her and a gallery of one person."""
    pytest.importorskip("dlib")
    from PIL import Image
    from skimage import data

    photo = Image.fromarray(data.astronaut())
    photo.save(tmp_path / "astronaut.jpg", quality=95)
    photo.save(tmp_path / "a.jpg", quality=95)
    photo.transpose(Image.FLIP_LEFT_RIGHT).save(tmp_path / "b.jpg", quality=95)
    os.makedirs(tmp_path / "people" / "eileen")
    photo.rotate(3).save(tmp_path / "people" / "eileen" / "1.jpg", quality=95)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(ROOT)
    scope: dict = {}
    exec(compile(_python_block(), "README.md", "exec"), scope)
    assert scope["result"].same is True and scope["rows"].shape == (2, 128)
    assert scope["matches"][0].name == "eileen" and scope["matches"][0].box == scope["faces"][0].box
    assert Image.open(tmp_path / "found.png").size == photo.size
