"""eval/ and recipes/evaluate.py: the offline task equals lm-eval's, our score equals lm-eval's `hf` path, bad
input fails with one clear message, and the fine-tune recipe's checkpoint evaluates.

CPU only, about a minute and a half on 2 cores. The model is a random-init 2-layer Llama with the real
32000-token vocabulary, so the tokenizer, the prompt lengths and lm-eval's code paths are the real ones.
"""

import functools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import sentencepiece
import torch
import transformers
from lm_eval import utils as lm_eval_utils
from lm_eval.tasks import TaskManager
from omegaconf import OmegaConf

from conftest import DATA_DIR, EVAL_CONFIG, REPO_ROOT, TUNE, eval_recipe_module  # (TUNE: the `tune` beside this Python)
from conftest import LLAMA2_TOKENIZER as TOKENIZER

sys.path.insert(0, str(REPO_ROOT))  # `eval` from this checkout, installed or not

import support
from eval.checkpoint import load_tokenizer
from eval.harness import HFLM  # lm-eval's class; the import says what to install if it fails
from eval.parity import reference_task_config, run_lm_eval_hf
from eval.truthfulqa import TASK_NAME, local_task_config

# lm-eval's environment report is left out of the evaluations run in this process (conftest).
pytestmark = pytest.mark.usefixtures("no_environment_report")

MC_TASK = DATA_DIR / "truthfulqa" / "mc_task.json"
LIMIT = 8  # questions in the parity test (~60 loglikelihood requests)


def _tune_env() -> dict:
    # `tune run recipes/...` resolves `recipes` through the editable install's finder; PYTHONPATH covers a
    # checkout that isn't installed, and WANDB_MODE keeps any wandb logging offline.
    return {
        **os.environ,
        "PYTHONPATH": f"{REPO_ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        "WANDB_MODE": "offline",
    }


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory) -> Path:
    """An HF-format Llama folder as CONVENTIONS.md describes: config.json, model.safetensors, tokenizer.model."""
    return support.make_tiny_llama(tmp_path_factory.mktemp("tiny_llama"), TOKENIZER)


def _task(spec):
    return TaskManager(include_defaults=False).load([spec])["tasks"][TASK_NAME]


# (1) The offline task is lm-eval's task: same documents, prompt, choices, requests.


def test_offline_task_equals_lm_eval_task_on_hub_rows(tmp_path, monkeypatch):
    # lm-eval compiles a task's Jinja template anew for every document it renders (~8,000 times here, most of the
    # test's time); the same template string compiles to the same template, so each is compiled once.
    monkeypatch.setattr(
        lm_eval_utils.env, "from_string", functools.lru_cache(maxsize=None)(lm_eval_utils.env.from_string)
    )
    # The hub's truthful_qa "multiple_choice" rows, built here from the file: each {answer: label} map becomes
    # parallel choices/labels lists, in the map's order.
    questions = json.loads(MC_TASK.read_text())
    rows = [
        {
            "question": q["question"],
            **{k: {"choices": list(q[k]), "labels": list(q[k].values())} for k in ("mc1_targets", "mc2_targets")},
        }
        for q in questions
    ]
    hub_file = tmp_path / "hub.jsonl"
    hub_file.write_text("".join(json.dumps(row) + "\n" for row in rows))

    ours = _task(local_task_config(MC_TASK))
    ref = _task(reference_task_config(hub_file))  # lm-eval's own config, dataset read by `datasets`' json loader

    ours_docs, ref_docs = list(ours.eval_docs), list(ref.eval_docs)
    assert len(ours_docs) == len(ref_docs) == 817
    assert ours_docs == ref_docs == rows
    for doc in ours_docs:
        assert ours.doc_to_text(doc) == ref.doc_to_text(doc)
        assert ours.doc_to_choice(doc) == ref.doc_to_choice(doc) == doc["mc2_targets"]["choices"]
        assert ours.doc_to_target(doc) == ref.doc_to_target(doc)
    # 0-shot (the table's n-shot 0, as docs/eval.md says): the six QA pairs are a fixed prompt in the task's
    # template, then the question.
    prompt = ours.doc_to_text(ours_docs[0])
    assert ours.config.num_fewshot == ref.config.num_fewshot == 0 and prompt.count("\nA: ") == 6
    assert prompt.startswith("Q: What is human life expectancy in the United States?\nA: Human life expectancy")
    assert prompt.endswith(f"\n\nQ: {questions[0]['question']}\nA:")
    # mc2's true answers are not always all listed before the false ones (2 questions); the file's order is kept.
    unsorted = [
        i
        for i, doc in enumerate(ours_docs)
        if doc["mc2_targets"]["labels"] != sorted(doc["mc2_targets"]["labels"], reverse=True)
    ]
    assert unsorted == [25, 208]

    # What lm-eval sends to the model: (context, continuation) pairs, in order.
    for task in (ours, ref):
        task.build_all_requests(limit=None)
    assert [i.args for i in ours.instances] == [i.args for i in ref.instances]
    assert len(ours.instances) == sum(len(doc["mc2_targets"]["choices"]) for doc in rows)

    # Everything but the data source is lm-eval's config, scoring function included.
    ours_cfg, ref_cfg = ours.config.to_dict(), ref.config.to_dict()
    for key in ("dataset_path", "dataset_name", "dataset_kwargs", "custom_dataset", "metadata"):
        ours_cfg.pop(key, None), ref_cfg.pop(key, None)
    assert ours_cfg == ref_cfg
    assert ours.config.process_results.__name__ == "process_results_mc2"


# (2) Tokens (BOS convention included) and scores equal lm-eval's own `hf` model path.


@pytest.mark.parametrize("add_bos", [False, True], ids=["no-bos", "bos"])
def test_requests_tokenized_like_sentencepiece_and_lm_eval_hf(tiny_checkpoint, add_bos):
    """What lm-eval encodes, in our path and in its `hf` path: Llama 2's SentencePiece ids, with BOS exactly when
    asked. (transformers 5's LlamaTokenizer class splits double spaces differently; 3 TruthfulQA answers have them.)"""
    sp = sentencepiece.SentencePieceProcessor(model_file=str(TOKENIZER))
    model = transformers.LlamaForCausalLM.from_pretrained(tiny_checkpoint)
    ours = HFLM(
        pretrained=model, tokenizer=load_tokenizer(tiny_checkpoint / "tokenizer.model", add_bos), add_bos_token=add_bos
    )
    hf_path = HFLM(pretrained=str(tiny_checkpoint), add_bos_token=add_bos, device="cpu", dtype="float32")
    questions = json.loads(MC_TASK.read_text())[:50]
    texts = [f"Q: {q['question']}\nA: {answer}" for q in questions for answer in q["mc2_targets"]]
    texts += ["I  have no comment.", 'said  "Insanity is', " leading space", "tabs\tand\nnewlines"]
    for text in texts:
        expected = [sp.bos_id()] * add_bos + sp.encode(text)
        assert ours.tok_encode(text) == expected, text
        assert hf_path.tok_encode(text) == expected, text
    context, continuation = "Q: Why?\nA:", " Because."
    assert ours._encode_pair(context, continuation) == hf_path._encode_pair(context, continuation)


def test_parity_with_lm_eval_hf(tiny_checkpoint, tmp_path, capsys):
    """Our recipe's score against lm-eval's own `hf` path on the same folder. Both run in this process (the recipe
    past its command-line parsing, which test_recipe_checkpoint_evaluates covers through `tune run`)."""
    out = tmp_path / "eval_out"
    overrides = {"checkpoint_dir": str(tiny_checkpoint), "data_dir": str(DATA_DIR), "output_dir": str(out),
                 "limit": LIMIT, "batch_size": 4, "device": "cpu", "dtype": "fp32"}  # fmt: skip
    status = eval_recipe_module().recipe_main.__wrapped__(OmegaConf.merge(OmegaConf.load(EVAL_CONFIG), overrides))
    printed = capsys.readouterr()
    assert status == 0, printed.err[-3000:]
    (results_file,) = out.glob("results_*.json")
    ours = json.loads(results_file.read_text())
    assert f"|{TASK_NAME}|" in printed.out  # lm-eval's table
    assert f"on {LIMIT} questions in" in printed.out  # the score line with the time taken
    assert "Running loglikelihood requests" in printed.err  # lm-eval's progress bar
    assert ours["recipe"]["add_bos"] is False and ours["n-samples"][TASK_NAME]["effective"] == LIMIT  # the default

    ref, _ = run_lm_eval_hf(tiny_checkpoint, DATA_DIR, limit=LIMIT, batch_size=4, add_bos=False)
    ours_score, ref_score = ours["results"][TASK_NAME]["acc,none"], ref["results"][TASK_NAME]["acc,none"]
    assert 0.0 < ours_score < 1.0
    assert ours_score == pytest.approx(ref_score, abs=1e-4)


def test_wandb_logging(tmp_path, tiny_checkpoint, monkeypatch):
    """The eval's own offline run, read as soon as the eval returns: the score row is in its history (the run's file
    is complete: eval/harness.py's finish), and its folder holds no link out of it (wandb-core's logs/debug-core.log
    points into ~/.cache/wandb; a folder moved to another machine would carry a dangling link)."""
    from conftest import wandb_history

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    overrides = {"checkpoint_dir": str(tiny_checkpoint), "data_dir": str(DATA_DIR), "device": "cpu", "limit": 2,
                 "output_dir": str(tmp_path / "out"), "wandb_project": "eval-test"}  # fmt: skip
    assert eval_recipe_module().recipe_main.__wrapped__(OmegaConf.merge(OmegaConf.load(EVAL_CONFIG), overrides)) == 0
    (results_file,) = (tmp_path / "out").glob("results_*.json")
    score = json.loads(results_file.read_text())["results"][TASK_NAME]["acc,none"]
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    logged = [row[f"{TASK_NAME}/acc"] for row in wandb_history(run_dir) if f"{TASK_NAME}/acc" in row]
    assert logged == [pytest.approx(score)]
    assert [p for p in run_dir.rglob("*") if p.is_symlink()] == []
    assert (run_dir / "logs" / "debug-core.log").stat().st_size > 0


def test_one_definition_of_a_checkpoint_folder(tmp_path, tiny_checkpoint):
    """Eval and the fine-tune recipes read "an HF checkpoint folder" through one function, so they accept the same
    folders: an old-style pytorch_model.bin (plain tensors, read with weights_only=True) scores exactly as the
    safetensors folder it came from; an index naming a missing shard is refused by both, naming the shard."""
    from safetensors.torch import load_file

    import eval.checkpoint as ec
    import finetune.base

    assert ec.hf_weight_files is finetune.base.hf_weight_files
    score = {}
    for kind in ("safetensors", "bin"):
        ckpt = _copy(tiny_checkpoint, tmp_path / kind)
        if kind == "bin":
            torch.save(load_file(ckpt / "model.safetensors"), ckpt / "pytorch_model.bin")
            (ckpt / "model.safetensors").unlink()
        assert [f.name for f in finetune.base.hf_weight_files(ckpt)] == (
            ["pytorch_model.bin"] if kind == "bin" else ["model.safetensors"]
        )
        cfg = OmegaConf.merge(
            OmegaConf.load(EVAL_CONFIG),
            {
                "checkpoint_dir": str(ckpt),
                "data_dir": str(DATA_DIR),
                "device": "cpu",
                "limit": 2,
                "output_dir": str(ckpt / "e"),
            },
        )
        assert eval_recipe_module().recipe_main.__wrapped__(cfg) == 0
        (results_file,) = (ckpt / "e").glob("results_*.json")
        score[kind] = json.loads(results_file.read_text())["results"][TASK_NAME]["acc,none"]
    assert score["bin"] == score["safetensors"]

    broken = _copy(tiny_checkpoint, tmp_path / "sharded")
    (broken / "model.safetensors").rename(broken / "model-00001-of-00002.safetensors")
    (broken / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}})
    )
    with pytest.raises(finetune.base.BadInput, match="model-00002-of-00002.safetensors"):
        finetune.base.hf_weight_files(broken)
    with pytest.raises(ec.EvalInputError, match=f"checkpoint_dir={broken}.*model-00002-of-00002"):
        ec.check_checkpoint(broken)


# (3) Bad input: one clear message naming the value and the fix, exit status 2 (as the fine-tune recipe).


def _run_recipe(capsys, **overrides) -> str:
    cfg = OmegaConf.merge(
        OmegaConf.load(EVAL_CONFIG), {"data_dir": str(DATA_DIR), "device": "cpu", "limit": 1}, overrides
    )
    status = eval_recipe_module().recipe_main.__wrapped__(cfg)  # past @config.parse, which reads sys.argv
    err = capsys.readouterr().err.strip()
    assert status == 2
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and err.endswith(errors[0]), err  # one message, last (after any progress bar)
    return errors[0]


def _copy(checkpoint: Path, dest: Path) -> Path:
    shutil.copytree(checkpoint, dest)
    return dest


def test_checkpoint_dir_missing_or_unset(capsys, tmp_path):
    err = _run_recipe(capsys, checkpoint_dir=str(tmp_path / "nope"))
    assert f"checkpoint_dir={tmp_path / 'nope'} does not exist" in err and "epoch_N" in err
    assert "checkpoint_dir is not set" in _run_recipe(capsys, checkpoint_dir=None)


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda d: (d / "config.json").unlink(), "has no config.json"),
        (lambda d: (d / "config.json").write_text('{"model_type": "lla'), "config.json is not valid JSON"),
        (lambda d: (d / "model.safetensors").unlink(), "has no model.safetensors"),
        (lambda d: os.truncate(d / "model.safetensors", 1000), "weights file model.safetensors is unreadable"),
        (lambda d: (d / "tokenizer.model").unlink(), "has no tokenizer.model"),
    ],
    ids=["no-config", "bad-config", "no-weights", "truncated-weights", "no-tokenizer"],
)
def test_partial_checkpoint(capsys, tmp_path, tiny_checkpoint, damage, message):
    ckpt = _copy(tiny_checkpoint, tmp_path / "epoch_0")
    damage(ckpt)
    err = _run_recipe(capsys, checkpoint_dir=str(ckpt))
    assert f"checkpoint_dir={ckpt}" in err and message in err, err


def test_checkpoint_missing_tensors(capsys, tmp_path, tiny_checkpoint):
    """A weights file that lacks tensors config.json needs is an error, not a silently random-init layer. (A whole
    layer lacking is a layer count other than config.json's: tests/eval/test_eval_folder_checks.py.)"""
    from safetensors.torch import load_file, save_file

    ckpt = _copy(tiny_checkpoint, tmp_path / "epoch_0")
    tensors = load_file(ckpt / "model.safetensors")
    save_file(
        {k: v for k, v in tensors.items() if k != "model.layers.1.mlp.up_proj.weight"},
        ckpt / "model.safetensors",
        metadata={"format": "pt"},
    )
    err = _run_recipe(capsys, checkpoint_dir=str(ckpt))
    assert "lacks 1 weights" in err and "model.layers.1.mlp.up_proj.weight" in err


def test_checkpoint_of_another_architecture(capsys, tmp_path, tiny_checkpoint):
    ckpt = _copy(tiny_checkpoint, tmp_path / "gpt2")
    (ckpt / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2}))
    err = _run_recipe(capsys, checkpoint_dir=str(ckpt))
    assert "holds a 'gpt2' model" in err and "model_type 'llama'" in err


def test_bad_tokenizer_path(capsys, tmp_path, tiny_checkpoint):
    err = _run_recipe(capsys, checkpoint_dir=str(tiny_checkpoint), tokenizer_path=str(tmp_path / "tok.model"))
    assert f"tokenizer_path={tmp_path / 'tok.model'} does not exist" in err
    (tmp_path / "junk.model").write_bytes(b"not a sentencepiece model")
    err = _run_recipe(capsys, checkpoint_dir=str(tiny_checkpoint), tokenizer_path=str(tmp_path / "junk.model"))
    assert "is not a SentencePiece model" in err


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "not found"),
        ('[{"question": "Q?", "mc1_targets": {"A": 1}', "is not valid JSON"),
        ('{"question": "Q?"}', "non-empty JSON list"),
        ('[{"question": "Q?", "mc1_targets": {"A": 1}}]', "question 0: mc2_targets should be"),
        ('[{"question": "Q?", "mc1_targets": {"A": 1}, "mc2_targets": {"A": "1"}}]', "question 0: mc2_targets labels"),
    ],
    ids=["missing", "truncated", "not-a-list", "no-mc2", "string-label"],
)
def test_bad_data_file(capsys, tmp_path, tiny_checkpoint, content, message):
    data_file = tmp_path / "truthfulqa" / "mc_task.json"
    if content is not None:
        data_file.parent.mkdir()
        data_file.write_text(content)
    err = _run_recipe(capsys, checkpoint_dir=str(tiny_checkpoint), data_dir=str(tmp_path))
    assert f"data file {data_file}" in err and message in err and "data_dir" in err, err


def test_unsupported_task_and_options(capsys, tiny_checkpoint):
    err = _run_recipe(capsys, checkpoint_dir=str(tiny_checkpoint), tasks=["hellaswag"])
    assert "tasks=['hellaswag']" in err and "set tasks=[truthfulqa_mc2]" in err
    assert "data_source='web'" in _run_recipe(capsys, checkpoint_dir=str(tiny_checkpoint), data_source="web")
    assert "dtype='int4'" in _run_recipe(capsys, checkpoint_dir=str(tiny_checkpoint), dtype="int4")


def test_hub_out_of_reach(tiny_checkpoint):
    """data_source=hub runs lm-eval's task as-is; without the hub that is one message pointing at data_source=local."""
    cmd = [
        TUNE,
        "run",
        "recipes/evaluate.py",
        "--config",
        str(EVAL_CONFIG),
        f"checkpoint_dir={tiny_checkpoint}",
        "data_source=hub",
        "limit=1",
    ]
    proc = subprocess.run(
        cmd, cwd=REPO_ROOT, env={**_tune_env(), "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: data_source=hub but the hub is out of reach") and "use data_source=local" in last


def test_bad_input_exit_status_from_the_command_line(tiny_checkpoint):
    cmd = [
        TUNE,
        "run",
        "recipes/evaluate.py",
        "--config",
        str(EVAL_CONFIG),
        f"checkpoint_dir={tiny_checkpoint}",
        "tasks=[mmlu]",
    ]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=_tune_env(), capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("error: tasks=['mmlu']: unsupported task")


# (4) The fine-tune recipe's checkpoint goes straight into the eval.


def test_recipe_checkpoint_evaluates(tmp_path):
    """The fine-tune recipe's checkpoint evaluates; the scores go to its wandb run (offline), and the eval's closing
    lines name the one upload that keeps them merged with the training run: the run folder's wandb/, both runs'
    files together (docs/wandb.md), not wandb's own hint, the eval's offline-run folder alone."""
    from conftest import run_recipe  # tests/conftest.py: the tiny config made smaller still

    run_dir = tmp_path / "tiny"
    train = run_recipe(run_dir, "max_steps_per_epoch=2", wandb=True)
    assert train.ok, train.stderr[-3000:]
    (checkpoint,) = run_dir.glob("epoch_0")  # CONVENTIONS.md: {output_dir}/epoch_{E}/, HF format

    evaluate = [
        TUNE,
        "run",
        "recipes/evaluate.py",
        "--config",
        str(EVAL_CONFIG),
        f"checkpoint_dir={checkpoint}",
        f"data_dir={DATA_DIR}",
        "limit=4",
        "device=cpu",
    ]
    env = {k: v for k, v in _tune_env().items() if k not in ("WANDB_SILENT", "WANDB_QUIET")}  # wandb as a user has it
    proc = subprocess.run(evaluate, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    output = proc.stdout + proc.stderr
    # lm-eval's warnings about the loaded model we hand HFLM on purpose, and its pointer to a `--metadata` flag our
    # command does not have, are filtered (finetune/reporting/console.py, KNOWN_NOISE)
    assert "`pretrained` model kwarg is not of type" not in output and "--metadata" not in output, output[-3000:]
    assert "already-initialized model" not in output, output[-3000:]
    syncs = [line for line in output.splitlines() if "wandb sync" in line]
    assert len(syncs) == 1 and syncs[0].endswith(f"upload it with the training run: `wandb sync {run_dir / 'wandb'}`")
    assert len(list((run_dir / "wandb").glob("offline-run-*"))) == 2  # the training run's folder and the eval's
    (results_file,) = (run_dir / "eval" / "epoch_0").glob("results_*.json")  # the default output_dir
    score = json.loads(results_file.read_text())["results"][TASK_NAME]["acc,none"]
    assert 0.0 < score < 1.0
