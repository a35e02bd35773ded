"""The params classes against the task registry: the fields of LLMTrainingParams,
ImageClassificationParams and TwoTowerParams are exactly the flags `replica keys TASK --json`
lists (a key on one side only fails here), with the same defaults; and they are pydantic models
as AutoTrain's are (model_dump, model_dump_json, model_fields, model_json_schema, lax coercion,
ValidationError naming the field, unknown keywords ignored with a warning)."""

import importlib.util
import json
import re
import warnings
from pathlib import Path

import pydantic
import pytest

import replica
from replica import _fields, _models
from replica.params import PARAMS_CLASSES, Params

from conftest import AUTOTRAIN_0_8_36_DEFAULTS, SOURCE, cli, need

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
    python = set(cls.model_fields)
    assert list(cls.model_fields) == cls.fields()
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


def test_generated_classes_are_current():
    """_models.py (the class bodies: each field's name and type) is what gen_fields.py writes
    from _fields.py."""
    spec = importlib.util.spec_from_file_location("gen_fields", SOURCE / "python" / "tools" / "gen_fields.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert Path(_models.__file__).read_text() == gen.render_models(_fields.TASKS), REGENERATE


def test_autotrain_names_and_defaults():
    p = replica.LLMTrainingParams()
    # AutoTrain's LLMTrainingParams defaults (PRODUCT.md) under AutoTrain's names.
    assert (p.lr, p.epochs, p.batch_size, p.gradient_accumulation) == (3e-5, 1, 2, 4)
    assert (p.lora_r, p.lora_alpha, p.lora_dropout, p.target_modules) == (16, 32, 0.05, "all-linear")
    assert (p.model_max_length, p.block_size, p.trainer, p.peft) == (2048, -1, "sft", False)
    assert (p.push_to_hub, p.username, p.chat_template, p.text_column) == (False, "", "tokenizer", "text")


def test_no_field_hides_a_method():
    for cls in PARAMS_CLASSES.values():
        clash = [f for f in cls.fields() if hasattr(Params, f)]
        assert not clash, f"{cls.__name__} fields hidden by Params attributes: {clash}"


def test_unknown_keywords_are_ignored_with_a_warning_as_autotrain_does():
    # AutoTrain's params are pydantic models with extra="ignore" (it logs "Parameters supplied
    # but not used"): the keyword is dropped, and the warning names the field meant.
    with pytest.warns(UserWarning, match=r"unknown field 'learning_rate' .*did you mean 'lr'.*ignored"):
        p = replica.LLMTrainingParams(learning_rate=1e-4)
    assert p == replica.LLMTrainingParams() and "learning_rate" not in p.model_dump()
    with pytest.warns(UserWarning, match=r"unknown field 'lora_rr' .*did you mean 'lora_r'"):
        replica.LLMTrainingParams(lora_rr=8)
    with pytest.warns(UserWarning, match=r"unknown field 'lora_r' of ImageClassificationParams"):
        replica.ImageClassificationParams(lora_r=8)
    with pytest.warns(UserWarning, match=r"unknown field 'use_peft'"):
        replica.LLMTrainingParams.model_validate({"use_peft": True})
    # Setting or reading a name that is no field is refused, naming the nearest.
    p = replica.ImageClassificationParams()
    with pytest.raises(replica.ConfigError, match=r"unknown field 'epoch' .*did you mean 'epochs'"):
        p.epoch = 3
    with pytest.raises(AttributeError, match="did you mean 'epochs'"):
        p.epoch
    # `task` (replica's training_params.json has it) must be the class's.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert replica.LLMTrainingParams(task="llm-sft", lora_r=8).lora_r == 8
    with pytest.raises(pydantic.ValidationError, match="task 'two-tower' is not LLMTrainingParams's .*TwoTowerParams"):
        replica.LLMTrainingParams(task="two-tower")


def test_a_wrong_type_is_a_validation_error_naming_the_field():
    with pytest.raises(pydantic.ValidationError) as e:
        replica.LLMTrainingParams(lora_r="x")
    assert [err["loc"][0] for err in e.value.errors()] == ["lora_r"]
    assert e.value.title == "LLMTrainingParams" and "lora_r" in str(e.value)
    with pytest.raises(pydantic.ValidationError) as e:
        replica.LLMTrainingParams(lr="fast", peft="maybe", model=3)
    assert sorted({err["loc"][0] for err in e.value.errors()}) == ["lr", "model", "peft"]
    with pytest.raises(pydantic.ValidationError, match="nproc_per_node"):
        replica.LLMTrainingParams(nproc_per_node="many")
    with pytest.raises(pydantic.ValidationError, match="hidden_sizes"):
        replica.ImageClassificationParams(hidden_sizes=["a"])
    p = replica.LLMTrainingParams()
    with pytest.raises(pydantic.ValidationError, match="max_steps"):  # assignment is validated too
        p.max_steps = "ten"
    assert p.max_steps == -1


def test_lax_coercion_as_pydantic_does():
    p = replica.LLMTrainingParams(lr="3e-5", lora_r="8", peft="true", epochs=2.0, max_steps="40",
                                  nproc_per_node="2", shard_optimizer="false", zero_stage="auto",
                                  target_modules=["q_proj", "v_proj"], dpo_beta=1, merge_adapter=0)
    assert (p.lr, p.lora_r, p.peft, p.epochs, p.max_steps) == (3e-5, 8, True, 2, 40)
    assert type(p.lr) is float and type(p.lora_r) is int and type(p.dpo_beta) is float
    assert (p.nproc_per_node, p.shard_optimizer, p.zero_stage) == (2, False, "auto")
    assert (p.target_modules, p.merge_adapter) == ("q_proj,v_proj", False)  # AutoTrain's comma-separated form
    p.batch_size = "16"
    p.warmup_ratio = "0.05"
    assert (p.batch_size, p.warmup_ratio) == (16, 0.05)
    i = replica.ImageClassificationParams(hidden_sizes="64,32", augment="yes")
    assert (i.hidden_sizes, i.augment) == ([64, 32], True)
    i.hidden_sizes = (8,)
    assert i.hidden_sizes == [8]
    assert p.command()[2:].count("--lr") == 0  # 3e-5 is the default: not passed


@pytest.mark.parametrize("task", sorted(PARAMS_CLASSES))
def test_model_dump_and_json_round_trip(task):
    cls = PARAMS_CLASSES[task]
    changes = {"project_name": "out/x", "max_steps": 7, "lr": 0.25, "seed": 3, "valid_split": None,
               "nproc_per_node": 2, "shard_optimizer": True}
    p = cls(**changes, token="s3cret")
    dumped = p.model_dump()
    assert list(dumped) == [f for f in cls.model_fields if f != "token"]  # the secret is left out
    assert dumped["lr"] == 0.25 and p.to_dict() == dumped
    assert cls(**dumped) == cls(**changes) == cls.model_validate(dumped)
    text = p.model_dump_json(indent=2)
    assert "s3cret" not in text and "s3cret" not in repr(p) and "s3cret" not in str(p)
    assert cls.model_validate_json(text) == cls(**changes) == cls(**json.loads(text))
    assert cls(**json.loads(text)).command("t.yaml") == cls(**changes).command("t.yaml")
    assert p.copy(seed=4).seed == 4 and p.seed == 3 and p.model_copy() == p


@pytest.mark.parametrize("task", sorted(PARAMS_CLASSES))
def test_json_schema_is_valid_and_has_the_defaults(task):
    jsonschema = need("jsonschema")
    cls = PARAMS_CLASSES[task]
    schema = cls.model_json_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    assert schema["title"] == cls.__name__ and schema["type"] == "object"
    assert list(schema["properties"]) == list(cls.model_fields) and not schema.get("required")
    spec = program_table(task)
    program = program_fields(spec)
    run = {e["name"] for e in spec["run"]}
    for name, prop in schema["properties"].items():
        want = None if program[name] == "" and name in run else program[name]
        assert prop["default"] == want, (name, prop)
        assert prop["description"] and prop["flag"] == cls.field(name).flag, (name, prop)
    validator = jsonschema.Draft202012Validator(schema)
    validator.validate(json.loads(cls(project_name="x", max_steps=3).model_dump_json()))
    assert list(validator.iter_errors({"max_steps": "many"}))
    assert schema["properties"]["max_steps"]["anyOf"] == [{"type": "integer"}, {"type": "null"}]


def test_every_autotrain_field_constructs():
    # Every field of AutoTrain's LLMTrainingParams is one of ours: its training_params.json
    # constructs without a warning (what a value means to replica is the run's to say).
    assert not set(AUTOTRAIN_0_8_36_DEFAULTS) - set(replica.LLMTrainingParams.model_fields)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        p = replica.LLMTrainingParams(**json.loads(json.dumps(AUTOTRAIN_0_8_36_DEFAULTS, indent=4)))
    assert (p.trainer, p.optimizer, p.quantization, p.log, p.logging_steps) == ("default", "adamw_torch", "int4",
                                                                                "none", -1)
    assert p.mixed_precision is None and p.token is None and p.push_to_hub is False
    assert "--mixed-precision" not in p.command()  # null: replica's default


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
