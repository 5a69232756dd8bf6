"""Bad command-line input fails early and clearly: one line on stderr, a non-zero exit, no model loaded."""

import json

import pytest

import adaflash_hf.cli as cli
from adaflash_hf.bench.args import parse_positive_int_list, read_prompt_records


@pytest.fixture
def no_models(monkeypatch):
    def load_models(*args, **kwargs):
        pytest.fail("a model was loaded before the bad input was reported")

    import adaflash_hf.bench.models as models

    monkeypatch.setattr(models, "load_models", load_models)


@pytest.fixture(scope="module")
def drafter_folder(tmp_path_factory):
    """A saved tiny drafter: `--drafters` checks each folder is a loadable checkpoint (tests/test_load_errors.py)."""
    from .conftest import build_drafter, make_tiny_target

    folder = tmp_path_factory.mktemp("drafter")
    build_drafter(make_tiny_target(), seed=0).save_pretrained(folder)
    return str(folder)


def _prompts(tmp_path, text, name="prompts.jsonl"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


GOOD = json.dumps({"prompt": "2 + 2 =", "domain": "math"}) + "\n"
BAD_PROMPTS = {
    "missing": (None, "no such file"),
    "empty": ("", "no prompts in the file"),
    "blank": ("\n  \n", "no prompts in the file"),
    "not_json": (GOOD + "{prompt: 1}\n", "line 2: not JSON"),
    "no_prompt": (GOOD + json.dumps({"text": "hi", "domain": "chat"}) + "\n", "line 2: no 'prompt' key"),
    "no_domain": (json.dumps({"prompt": "hi"}) + "\n", "line 1: no 'domain' key"),
    "list": ("[1, 2]\n", "line 1: expected a JSON object"),
    "empty_prompt": (json.dumps({"prompt": " ", "domain": "chat"}) + "\n", "'prompt' must be a non-empty string"),
}


def _fails_in_one_line(argv, capsys, *fragments):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code not in (0, None)
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("adaflash-hf: error: ") and "Traceback" not in err, err
    for fragment in fragments:
        assert fragment in lines[0], err
    return lines[0]


@pytest.mark.parametrize("case", sorted(BAD_PROMPTS))
@pytest.mark.parametrize("command", ["bench", "compare"])
def test_bad_prompts_file_fails_before_loading(tmp_path, capsys, no_models, drafter_folder, command, case):
    text, message = BAD_PROMPTS[case]
    path = str(tmp_path / "nope.jsonl") if text is None else _prompts(tmp_path, text)
    extra = ["--drafters", drafter_folder] if command == "compare" else []
    _fails_in_one_line([command, *extra, "--prompts", path], capsys, "--prompts", path, message)


@pytest.mark.parametrize("value, message", [
    ("0", "'0' must be a positive integer"),
    ("abc", "'abc' not an integer"),
    ("1,,4", "empty item"),
    ("4,-1", "'-1' must be a positive integer"),
    ("", "expected a comma-separated list"),
])
def test_bad_concurrency_fails_before_loading(capsys, no_models, value, message):
    _fails_in_one_line(["bench", "--concurrency", value], capsys, "--concurrency", message)


@pytest.mark.parametrize("argv, fragments", [
    (["bench", "--max-new-tokens", "0"], ["--max-new-tokens '0'", "positive integer"]),
    (["bench", "--max-prompts", "x"], ["--max-prompts 'x'", "not an integer"]),
    (["bench", "--threads", "-2"], ["--threads '-2'", "positive integer"]),
    (["bench", "--drafter", "/no/such/drafter"], ["--drafter '/no/such/drafter'", "no such folder"]),
    (["bench", "--length-head", "/no/such/head"], ["--length-head '/no/such/head'", "no such folder"]),
    (["compare", "--drafters", "DRAFTER", "--max-new-tokens", "0"], ["--max-new-tokens '0'"]),
    (["bench-online", "--algorithms", "static,sgd"], ["--algorithms 'static,sgd'", "unknown ['sgd']"]),
    (["bench-online", "--per-block", "0"], ["--per-block '0'", "positive integer"]),
    (["bench-online", "--max-new-tokens", "-5"], ["--max-new-tokens '-5'", "positive integer"]),
    (["bench-online", "--drafter", "/no/such/drafter"], ["--drafter '/no/such/drafter'", "no such folder"]),
    (["compare", "--drafters", "DRAFTER,/no/such/drafter"],
     ["--drafters 'DRAFTER,/no/such/drafter'", "no such folder: /no/such/drafter"]),
    (["compare", "--drafters", " , "], ["--drafters", "expected comma-separated folders"]),
    (["compare", "--drafters", "DRAFTER,DRAFTER", "--labels", "a"], ["--labels 'a'", "1 labels for 2 drafters"]),
    (["report", "--control-drafter", "/no/such/ctl"], ["--control-drafter '/no/such/ctl'", "no such folder"]),
    (["report", "--length-head", "/no/such/head"], ["--length-head '/no/such/head'", "no such folder"]),
])
def test_other_bad_options_fail_before_loading(capsys, no_models, drafter_folder, argv, fragments):
    argv = [a.replace("DRAFTER", drafter_folder) for a in argv]  # "DRAFTER": a saved drafter checkpoint
    _fails_in_one_line(argv, capsys, *[f.replace("DRAFTER", drafter_folder) for f in fragments])


def test_good_input_parses_to_what_the_commands_use(tmp_path):
    path = _prompts(tmp_path, GOOD + "\n" + GOOD)
    args = cli.build_parser().parse_args(["bench", "--prompts", path, "--concurrency", " 1, 4,16"])
    assert str(args.prompts) == path and args.concurrency == "1,4,16"
    assert len(read_prompt_records(args.prompts)) == 2 and parse_positive_int_list(args.concurrency) == [1, 4, 16]
    args = cli.build_parser().parse_args(["bench-online"])
    assert args.algorithms == "static,ogd,optimistic,ensemble" and args.per_block is None and args.prompts is None
    with pytest.raises(ValueError, match="line 1: not JSON"):
        read_prompt_records(_prompts(tmp_path, "nope\n", "bad.jsonl"))
