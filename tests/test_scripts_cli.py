"""The command-line tools: both option spellings everywhere, a help text for every argument,
user errors as one line, and export_onnx's optional output."""

import importlib
import os
import subprocess

import pytest
import torch

from shardface import backbones
from shardface.scripts.cli import ArgumentParser, underscored

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# every module of scripts/ with a `main`, and those of them that parse options: a new tool is
# held to the same rules
_SOURCES = {
    name[:-3]: open(os.path.join(ROOT, "scripts", name)).read()
    for name in os.listdir(os.path.join(ROOT, "scripts"))
    if name.endswith(".py")
}
TOOLS = sorted(name for name, text in _SOURCES.items() if "\ndef main(" in text)
PARSING_TOOLS = [name for name in TOOLS if "ArgumentParser" in _SOURCES[name]]


class _Parsed(Exception):
    def __init__(self, parser):
        self.parser = parser


def _parser_of(tool: str, monkeypatch) -> ArgumentParser:
    """The parser the tool's main builds (stopped where it would parse)."""

    def stop(parser, args=None, namespace=None):
        raise _Parsed(parser)

    monkeypatch.setattr(ArgumentParser, "parse_known_args", stop)
    with pytest.raises(_Parsed) as parsed:
        importlib.import_module(f"scripts.{tool}").main([])
    return parsed.value.parser


@pytest.mark.parametrize("tool", TOOLS)
def test_every_tool_reports_user_errors_in_one_line(tool):
    from shardface.parallel.user_errors import exits_on_user_error

    main = importlib.import_module(f"scripts.{tool}").main
    assert main.__code__ is exits_on_user_error(main).__code__, (
        f"scripts.{tool}.main: not @exits_on_user_error"
    )


@pytest.mark.parametrize("tool", PARSING_TOOLS)
def test_every_tool_uses_the_shared_parser_with_help_for_every_argument(tool, monkeypatch):
    parser = _parser_of(tool, monkeypatch)
    for action in parser._actions:
        assert action.help, f"scripts.{tool}: {action.option_strings or action.dest} has no help text"
        for option in action.option_strings:
            assert option == underscored(option), f"scripts.{tool}: {option} is not the underscore spelling"


def test_dash_and_underscore_spellings_are_the_same_option():
    p = ArgumentParser()
    p.add_argument("path", help="a positional is left alone")
    p.add_argument("--batch_size", type=int, default=1, help="h")
    p.add_argument("--no-ema", action="store_true", help="h")
    for argv in (["x-y", "--batch-size", "3", "--no_ema"], ["x-y", "--batch_size=3", "--no-ema"]):
        args = p.parse_args(argv)
        assert (args.path, args.batch_size, args.no_ema) == ("x-y", 3, True)
    assert p.parse_args(["--", "--a-b"]).path == "--a-b"  # after `--`, nothing is an option
    with pytest.raises(TypeError, match="help"):
        p.add_argument("--seed", type=int)


def test_tool_user_error_is_one_line_with_exit_code_2(tmp_path, capsys):
    from shardface.scripts.pack_rec import main

    (tmp_path / "list.txt").write_text("a.jpg 3\n")
    assert main([str(tmp_path / "list.txt"), str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == f"error: {tmp_path / 'list.txt'}:1: expected 'path<TAB>label'\n"


def test_export_output_defaults_to_the_run_and_accepts_a_directory(tmp_path):
    from shardface.scripts.export_onnx import output_path

    run = tmp_path / "run"
    run.mkdir()
    assert output_path(str(run), None) == str(run / "model.onnx")
    assert output_path(str(run / "model.pt"), None) == str(run / "model.onnx")
    assert output_path(str(run), str(tmp_path)) == str(tmp_path / "model.onnx")
    assert output_path(str(run), "new_dir/") == os.path.join("new_dir", "model.onnx")
    assert output_path(str(run), str(tmp_path / "x.onnx")) == str(tmp_path / "x.onnx")


def test_export_into_a_directory_writes_model_onnx_there(tmp_path):
    from shardface.scripts.export_onnx import main

    torch.manual_seed(0)
    torch.save(backbones.get_model("tiny").state_dict(), tmp_path / "model.pt")
    out = tmp_path / "exported"
    out.mkdir()
    assert main([str(tmp_path / "model.pt"), str(out), "--network", "tiny"]) == 0
    assert (out / "model.onnx").is_file()


@pytest.mark.slow
def test_train_sh_without_nproc_runs_one_process_on_a_cpu(drawn_faces, tmp_path):
    from tests.distributed import free_port
    from tests.train_runs import train_argv

    out = str(tmp_path / "run")
    argv = train_argv(drawn_faces, out, "--max_steps", "2")
    proc = subprocess.run(
        ["scripts/train.sh", *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, OMP_NUM_THREADS="1", MASTER_PORT=str(free_port())),
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "world size 1" in open(os.path.join(out, "training.log")).read()


def _seeded_tools(monkeypatch) -> dict:
    """{tool: its positionals filled with placeholders} for every tool with a --seed option."""
    found = {}
    for tool in PARSING_TOOLS:
        parser = _parser_of(tool, monkeypatch)
        if any("--seed" in a.option_strings for a in parser._actions):
            found[tool] = [
                f"x{i}" for i, a in enumerate(parser._actions) if not a.option_strings and a.nargs is None
            ]
    monkeypatch.undo()
    return found


def test_every_tool_refuses_a_negative_seed_in_one_line_before_any_work(tmp_path, capsys, monkeypatch):
    """One rule for --seed in every tool, numpy's: an integer >= 0 (make_bin's random.Random took
    -1, identify_eval's and make_drawn_faces' numpy failed on it or later)."""
    tools = _seeded_tools(monkeypatch)
    assert {"identify_eval", "make_bin", "make_drawn_faces"} <= set(tools)
    monkeypatch.chdir(tmp_path)
    for tool, positionals in tools.items():
        capsys.readouterr()
        rc = importlib.import_module(f"scripts.{tool}").main([*positionals, "--seed", "-1"])
        err = capsys.readouterr().err
        assert (
            rc == 2
            and err == "error: --seed -1: a seed is an integer >= 0 (numpy's rule, which every tool keeps)\n"
        ), (tool, err)
    assert os.listdir(tmp_path) == []
