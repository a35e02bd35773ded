"""Project(params, backend="local") and the package's entry points: the LLM SFT demo run from
Python gives the command line's training_params.json and adapter, the run handle, typed errors
with replica's messages, `python -m replica`."""

import json
import subprocess
import sys
import warnings

import pytest

import replica

from conftest import AUTOTRAIN_0_8_36_DEFAULTS, MLP_OVERRIDES, cli, need_fashion_mnist, same_bytes

DEMO_STEPS = 6


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("demo") / "demo"
    cli(["llm", "init-demo", str(directory)])
    return directory


def demo_command(demo_dir):
    """The fine-tuning command `replica llm init-demo` prints, as arguments."""
    out = cli(["llm", "init-demo", str(demo_dir.parent / "again")]).stdout
    line = next(l.strip() for l in out.splitlines() if l.strip().startswith("replica llm --train"))
    return line.replace(str(demo_dir.parent / "again"), str(demo_dir)).split()[1:]


def test_llm_demo_from_python_equals_the_cli(demo_dir, tmp_path):
    # The command line: the demo's own command, 2 workers, a few steps.
    args = demo_command(demo_dir)
    cli_project = tmp_path / "cli"
    cli(args + ["--project-name", str(cli_project), "--max-steps", str(DEMO_STEPS), "--nproc-per-node", "2"],
        timeout=600)
    # Python: the same run through the API.
    params = replica.init_llm_demo(str(demo_dir), project_name=str(tmp_path / "py"), max_steps=DEMO_STEPS,
                                   nproc_per_node=2)
    assert params.peft and params.model == str(demo_dir / "model")
    run = replica.Project(params, backend="local", process=True).create()
    assert run.returncode == 0 and run.metrics and run.metrics[-1]["step"] == DEMO_STEPS

    expected = json.loads((cli_project / "training_params.json").read_text())
    got = run.training_params
    assert got.pop("project_name") == str(tmp_path / "py")
    assert expected.pop("project_name") == str(cli_project)
    assert got == expected
    for name in ("adapter_model.safetensors", "adapter_config.json"):
        assert same_bytes(cli_project / "final" / name, run.final_dir / name), f"final/{name} differs"


def test_dpo_from_python_logs_trls_metrics(demo_dir, tmp_path):
    # AutoTrain's LLMTrainingParams(trainer="dpo", ...) on the demo's preference data.
    params = replica.LLMTrainingParams(model=str(demo_dir / "model"), data_path=str(demo_dir / "data" / "preference"),
                                       project_name=str(tmp_path / "dpo"), trainer="dpo", peft=True, max_steps=3,
                                       block_size=128, batch_size=4, gradient_accumulation=1, dpo_beta=0.2,
                                       max_prompt_length=64, nproc_per_node=2, logging_steps=1)
    run = replica.Project(params, backend="local", process=True).create()
    assert run.returncode == 0 and run.metrics[-1]["step"] == 3
    for name in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen"):
        assert name in run.metrics[-1], name
    assert run.training_params["trainer"] == "dpo" and run.training_params["dpo_beta"] == 0.2
    assert (run.final_dir / "adapter_config.json").exists()


def test_autotrain_training_params_json_constructs_and_runs(demo_dir, tmp_path):
    # The training_params.json of an AutoTrain QLoRA run (AutoTrain 0.8.36's fields: its
    # defaults, with `--peft --lr 2e-4 --log tensorboard` and the Hub's names), as
    # AutoTrainParams.save() writes it: `LLMTrainingParams(**json.load(...))` constructs.
    autotrain = dict(AUTOTRAIN_0_8_36_DEFAULTS, model="meta-llama/Llama-3.2-1B", project_name="my-autotrain-llm",
                     data_path="timdettmers/openassistant-guanaco", peft=True, lr=2e-4, log="tensorboard",
                     block_size=128)
    path = tmp_path / "training_params.json"
    path.write_text(json.dumps(autotrain, indent=4))
    with warnings.catch_warnings(), open(path) as f:
        warnings.simplefilter("error")  # every field is one of ours
        params = replica.LLMTrainingParams(**json.load(f))
    assert (params.trainer, params.optimizer, params.quantization, params.lr) == ("default", "adamw_torch", "int4", 2e-4)
    # Here: the demo's model and data in place of the Hub's, a few steps.
    params.model, params.data_path, params.project_name = str(demo_dir / "model"), str(demo_dir / "data"), str(tmp_path / "at")
    params.max_steps, params.nproc_per_node, params.logging_steps = 2, 1, 1
    run = replica.Project(params, backend="local", process=True).create()
    assert run.returncode == 0 and run.metrics[-1]["step"] == 2
    got = run.training_params
    assert (got["trainer"], got["optimizer"], got["quantization"], got["peft"], got["lr"]) == ("sft", "adamw", "int4", True, 2e-4)
    assert (run.final_dir / "adapter_config.json").exists()

    # replica's own training_params.json round-trips: the params it gives run the same run again.
    with warnings.catch_warnings(), open(run.project_dir / "training_params.json") as f:
        warnings.simplefilter("error")
        again = replica.LLMTrainingParams(**json.load(f))
    assert again.model_dump() == replica.LLMTrainingParams(**got).model_dump()
    again.project_name = str(tmp_path / "again")
    rerun = replica.Project(again, backend="local", process=True).create()
    expected, repeated = dict(got), rerun.training_params
    assert repeated.pop("project_name") == str(tmp_path / "again") and expected.pop("project_name")
    assert repeated == expected
    assert same_bytes(run.final_dir / "adapter_model.safetensors", rerun.final_dir / "adapter_model.safetensors")


def test_run_handle_wait_logs_metrics(tmp_path):
    need_fashion_mnist()
    params = replica.ImageClassificationParams(project_name=str(tmp_path / "mlp"), nproc_per_node=1, hidden_sizes=[64],
                                               **{**MLP_OVERRIDES, "max_steps": 5})
    run = replica.Project(params, backend="local", process=False).create()
    assert isinstance(run, replica.Run)
    assert run.wait(timeout=300) is run
    assert run.returncode == 0
    assert [m["step"] for m in run.metrics if "loss" in m] == [1, 2, 3, 4, 5]
    assert "done: 5 steps" in run.logs
    assert run.training_params["task"] == "image-classification"
    with warnings.catch_warnings():  # replica's own training_params.json constructs the params again
        warnings.simplefilter("error")
        again = replica.ImageClassificationParams(**run.training_params)
    assert (again.hidden_sizes, again.max_steps, again.nproc_per_node) == ([64], 5, 1)
    assert again.command("t.yaml") == params.command("t.yaml")


def test_refused_value_is_a_config_error_with_replicas_message(tmp_path):
    params = replica.ImageClassificationParams(project_name=str(tmp_path / "bad"), lr=-1.0)
    with pytest.raises(replica.ConfigError) as e:
        replica.Project(params).create()
    assert "--lr" in e.value.message and "must be > 0" in e.value.message
    assert e.value.returncode == 1


def test_missing_model_is_a_config_error():
    with pytest.raises(replica.ConfigError, match="--model DIR is required"):
        replica.Project(replica.LLMTrainingParams(project_name="x", data_path="d"), process=True).create()


def test_failed_worker_is_a_worker_error_with_replicas_message(tmp_path):
    need_fashion_mnist()
    params = replica.ImageClassificationParams(project_name=str(tmp_path / "fail"), nproc_per_node=2,
                                               **MLP_OVERRIDES)
    run = replica.Run(params, echo=False, env={"REPLICA_DISTRIBUTED_DEBUG": "verbose"})
    with pytest.raises(replica.WorkerError) as e:
        run.wait(timeout=300)
    assert e.value.rank in (0, 1)
    assert "REPLICA_DISTRIBUTED_DEBUG='verbose' is not one of OFF, INFO, DETAIL" in e.value.message
    assert e.value.message.startswith(f"rank {e.value.rank}: ")
    assert e.value.exit_code == 1 and e.value.records


def test_backend_is_checked():
    with pytest.raises(replica.ConfigError, match="backend 'spaces' is not one of local, spark, ray"):
        replica.Project(replica.LLMTrainingParams(), backend="spaces")


def test_python_m_replica_is_the_program():
    out = subprocess.run([sys.executable, "-m", "replica", "--version"], capture_output=True, text=True, check=True)
    assert out.stdout.startswith("replica ")
    keys = subprocess.run([sys.executable, "-m", "replica", "keys", "two-tower", "--json"], capture_output=True,
                          text=True, check=True)
    assert json.loads(keys.stdout)["task"] == "two-tower"
