"""The params classes against the task registry: the fields of LLMTrainingParams,
ImageClassificationParams and TwoTowerParams are exactly the flags `replica keys TASK --json`
lists (a key on one side only fails here), with the same defaults."""

import json
import re

import pytest

import replica
from replica import _fields
from replica.params import PARAMS_CLASSES, Params

from conftest import SOURCE, cli

REGENERATE = "regenerate the table: python python/tools/gen_fields.py build/replica"


def program_tasks():
    match = re.search(r"\{([a-z0-9,-]+)\}", cli(["keys", "--help"]).stdout)
    assert match, "replica keys --help lists no tasks"
    return match.group(1).split(",")


def program_table(task):
    return json.loads(cli(["keys", task, "--json"]).stdout)


def program_fields(spec):
    """name -> default of every flag the program lists for a task."""
    out = {}
    for section in ("run", "keys", "twins"):
        for e in spec[section]:
            out[e["name"]] = e["default"]
    for e in spec["autotrain_only"]:
        out[e["name"]] = {"false": False, "true": True, "": None}.get(e["accepted"], e["accepted"])
    return out


def test_a_class_per_task_of_the_registry():
    assert sorted(PARAMS_CLASSES) == sorted(program_tasks())
    assert sorted(_fields.TASKS) == sorted(program_tasks()), REGENERATE


@pytest.mark.parametrize("task", sorted(PARAMS_CLASSES))
def test_fields_are_the_program_keys(task):
    spec = program_table(task)
    cls = PARAMS_CLASSES[task]
    program = program_fields(spec)
    python = set(cls.fields())
    only_program = sorted(set(program) - python)
    only_python = sorted(python - set(program))
    assert not only_program and not only_python, (
        f"{cls.__name__} and `replica keys {task} --json` differ: only in the program: {only_program}; "
        f"only in Python: {only_python}; {REGENERATE}")


@pytest.mark.parametrize("task", sorted(PARAMS_CLASSES))
def test_defaults_are_the_program_defaults(task):
    spec = program_table(task)
    cls = PARAMS_CLASSES[task]
    params = cls()
    for name, default in program_fields(spec).items():
        want = None if default == "" and name in {e["name"] for e in spec["run"]} else default
        assert getattr(params, name) == want, f"{cls.__name__}.{name}: {getattr(params, name)!r} != {want!r}; {REGENERATE}"


@pytest.mark.parametrize("task", sorted(PARAMS_CLASSES))
def test_generated_table_is_current(task):
    assert _fields.TASKS[task] == program_table(task), REGENERATE


def test_autotrain_names_and_defaults():
    p = replica.LLMTrainingParams()
    # AutoTrain's LLMTrainingParams defaults (PRODUCT.md) under AutoTrain's names.
    assert (p.lr, p.epochs, p.batch_size, p.gradient_accumulation) == (3e-5, 1, 2, 4)
    assert (p.lora_r, p.lora_alpha, p.lora_dropout, p.target_modules) == (16, 32, 0.05, "all-linear")
    assert (p.model_max_length, p.block_size, p.trainer, p.peft) == (2048, -1, "sft", False)
    assert (p.push_to_hub, p.username, p.chat_template, p.text_column) == (False, None, "tokenizer", "text")


def test_no_field_hides_a_method():
    for cls in PARAMS_CLASSES.values():
        clash = [f for f in cls.fields() if hasattr(Params, f)]
        assert not clash, f"{cls.__name__} fields hidden by Params attributes: {clash}"


def test_unknown_and_mistyped_fields():
    with pytest.raises(replica.ConfigError, match=r"unknown field 'learning_rate' .*did you mean 'lr'"):
        replica.LLMTrainingParams(learning_rate=1e-4)
    with pytest.raises(replica.ConfigError, match=r"unknown field 'lora_rr' .*did you mean 'lora_r'"):
        replica.LLMTrainingParams(lora_rr=8)
    with pytest.raises(replica.ConfigError, match=r"LLMTrainingParams.lora_r must be an integer, got 'x'"):
        replica.LLMTrainingParams(lora_r="x")
    with pytest.raises(replica.ConfigError, match="applies|unknown field 'lora_r'"):
        replica.ImageClassificationParams(lora_r=8)
    p = replica.ImageClassificationParams()
    with pytest.raises(AttributeError, match="did you mean 'epochs'"):
        p.epoch


def test_flags_round_trip():
    p = replica.LLMTrainingParams(model="m", data_path="d", project_name="o", peft=True, lora_r=8,
                                  target_modules=["q_proj", "v_proj"], mixed_precision="bf16", lr=5e-3,
                                  valid_split="valid", nproc_per_node=2, shard_optimizer=False)
    assert p.command()[:2] == ["llm", "--train"]
    assert replica.LLMTrainingParams.from_args(p.command()) == p
    i = replica.ImageClassificationParams(project_name="x", hidden_sizes=[64, 32], valid_split=None, max_steps=3)
    args = i.command("run.yaml")
    assert args[:2] == ["--config", "run.yaml"] and "--valid-split" in args and "none" in args
    assert replica.ImageClassificationParams.from_args(args) == i
    assert i.config_yaml() == "task: image-classification\n"


def test_docs_name_the_classes():
    page = (SOURCE / "docs" / "python.md").read_text()
    for name in ("LLMTrainingParams", "ImageClassificationParams", "TwoTowerParams", "replica.spark.run",
                 "replica.ray.run", "PyTorchJob"):
        assert name in page, f"docs/python.md does not mention {name}"
