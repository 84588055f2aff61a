"""The training loop: exact resume, interruption, divergence, multi-process equivalence."""

import json
import math
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from transduce import checkpoint
from transduce.cli import main
from transduce.config import TrainConfig, preset
from transduce.model import load_model
from transduce.train import loop, objective
from transduce.train.log import LOG_NAME
from transduce.train.loop import TrainingError, train
from tests.environment import subprocess_env
from tests.train.forked import run_forked

REPO = Path(__file__).resolve().parents[2]
# Training subprocesses: on the CPU with one thread each, also on a machine with a GPU,
# so that runs compared with each other run where the two-process ones must (gloo on the
# CPU: two NCCL ranks would need two GPUs).
CPU_ENV = subprocess_env(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")


def tiny_config(**changes):
    return preset("tiny", src_vocab_size=300, tgt_vocab_size=300, dropout=0.1, **changes)


def train_config(**changes):
    values = dict(max_tokens=200, warmup_steps=20, log_every=5, eval_every=1000, save_every=1000,
                  keep_last=3, lr_scale=2.0)
    values.update(changes)
    return TrainConfig(**values)


def weights(run):
    return load_model(run).state_dict()


def _not_called(*args, **kwargs):
    raise AssertionError("a random model was built for weights read next")


def test_resume_continues_exactly(tiny_corpus, tmp_path, monkeypatch):
    """2N steps in one go == N steps, stop, resume, N more: identical parameters."""
    model_config = tiny_config()
    straight, split = tmp_path / "straight", tmp_path / "split"
    train(tiny_corpus, straight, model_config, train_config(max_steps=24))
    train(tiny_corpus, split, model_config, train_config(max_steps=12))
    with monkeypatch.context() as patched:     # every weight is read: none drawn first
        patched.setattr(loop, "build_model", _not_called)
        train(tiny_corpus, split, model_config, train_config(max_steps=24), resume=True)
    a, b = weights(straight), weights(split)
    assert all(torch.equal(a[name], b[name]) for name in a)
    # The run did train: the weights moved from their initialisation.
    torch.manual_seed(1)
    assert not torch.equal(a["output_proj.weight"],
                           loop.build_model(model_config).state_dict()["output_proj.weight"])
    # A budget already spent is refused, not overrun by a step, before anything loads.
    def loading(*args, **kwargs):
        raise AssertionError("the data and the model were loaded for a spent budget")

    monkeypatch.setattr(loop, "set_up", loading)
    with pytest.raises(TrainingError, match=r"at step 24, which spends its step budget "
                                            r"\(max_steps=20\)"):
        train(tiny_corpus, split, model_config, train_config(max_steps=20), resume=True)
    with pytest.raises(TrainingError, match=r"has trained 0\.\d minutes, which spends its "
                                            r"time budget \(max_minutes=0\.0001\)"):
        train(tiny_corpus, split, model_config,
              train_config(max_steps=0, max_minutes=0.0001), resume=True)
    assert checkpoint.list_checkpoints(split)[-1].name.endswith("24")


def test_packed_pairs_train_and_resume_exactly(tiny_corpus, tmp_path):
    """--pack-length for a translation model: rows of whole pairs, the loss falls, MFU
    counts each pair alone, and a resumed run ends where a straight one does."""
    model_config = tiny_config()
    straight, split = tmp_path / "straight", tmp_path / "split"
    train(tiny_corpus, straight, model_config, train_config(max_steps=24, pack_length=40))
    train(tiny_corpus, split, model_config, train_config(max_steps=12, pack_length=40))
    train(tiny_corpus, split, model_config, train_config(max_steps=24, pack_length=40),
          resume=True)
    a, b = weights(straight), weights(split)
    assert all(torch.equal(a[name], b[name]) for name in a)
    log = [json.loads(line) for line in (straight / LOG_NAME).read_text().splitlines()]
    losses = [r["loss"] for r in log if r.get("event") == "train"]
    assert losses[-1] < 0.8 * losses[0]
    assert 0 < [r["mfu"] for r in log if r.get("event") == "train"][-1] < 1


def test_checkpoints_log_and_keep_last(tiny_corpus, tmp_path):
    run = tmp_path / "run"
    train(tiny_corpus, run, tiny_config(), train_config(max_steps=10, save_every=2, eval_every=5,
                                                        dev_bleu_sentences=5))
    assert [p.name for p in checkpoint.list_checkpoints(run)] == \
        ["step-0000006", "step-0000008", "step-0000010"]
    records = [__import__("json").loads(line) for line in (run / "log.jsonl").open()]
    events = [r["event"] for r in records]
    assert events[0] == "start" and events.count("dev") == 2
    train_records = [r for r in records if r["event"] == "train"]
    assert [r["step"] for r in train_records] == [5, 10]
    assert all(r["tokens_per_s"] > 0 and 0 < r["mfu"] < 1 for r in train_records)
    dev = [r for r in records if r["event"] == "dev"][-1]
    assert {"dev_loss", "dev_ppl", "dev_bleu_greedy"} <= set(dev)
    assert load_model(run).languages == ("es", "en")        # from the corpus's corpus.json


def test_nonfinite_losses_skip_steps_then_abort(tiny_corpus, tmp_path, monkeypatch):
    real = objective.projected_label_smoothed_nll

    def poisoned(hidden, weight, target, epsilon, pad_id, **options):
        loss, nll = real(hidden, weight, target, epsilon, pad_id, **options)
        return loss * float("nan"), nll

    monkeypatch.setattr(objective, "projected_label_smoothed_nll", poisoned)
    with pytest.raises(TrainingError, match="not finite in 3 steps in a row"):
        train(tiny_corpus, tmp_path / "run", tiny_config(), train_config(max_steps=10, nan_limit=3))
    nonfinite = [line for line in (tmp_path / "run" / "log.jsonl").open() if "nonfinite" in line]
    assert len(nonfinite) == 3
    monkeypatch.undo()        # a new run in the same directory starts a log of its own
    train(tiny_corpus, tmp_path / "run", tiny_config(), train_config(max_steps=1))
    events = [json.loads(line)["event"] for line in (tmp_path / "run" / LOG_NAME).open()]
    assert events[0] == "start" and "nonfinite_loss" not in events
    previous = (tmp_path / "run" / f"{LOG_NAME}.previous").read_text(encoding="utf-8")
    assert previous.count("nonfinite_loss") == 3


class _LosingGradients(torch.nn.Module):
    """A compiler's stand-in that computes the loss and loses its gradients (zeros), as
    torch 2.11's did with the fused loss."""

    def __init__(self, net: torch.nn.Module):
        super().__init__()
        self.net = net

    def forward(self, *args):
        loss = self.net(*args)
        return loss.detach() + 0.0 * loss


@pytest.mark.parametrize("compiler", ["losing", "faithful"])
def test_a_compiled_run_whose_first_gradients_are_all_zero_stops(tiny_corpus, tmp_path,
                                                                 monkeypatch, compiler):
    compile_with = _LosingGradients if compiler == "losing" else lambda net: net
    monkeypatch.setattr(loop.torch, "compile", lambda net, **options: compile_with(net))
    config = train_config(max_steps=2, compile=True)
    if compiler == "faithful":
        train(tiny_corpus, tmp_path / "run", tiny_config(), config)
        return
    with pytest.raises(TrainingError, match="--compile: every gradient of the first step is zero"):
        train(tiny_corpus, tmp_path / "run", tiny_config(), config)


def test_vocabulary_mismatch_is_refused_before_training(tiny_corpus, tmp_path):
    with pytest.raises(TrainingError, match="src_vocab_size=40"):
        train(tiny_corpus, tmp_path / "run", preset("tiny", src_vocab_size=40, tgt_vocab_size=40),
              train_config(max_steps=1))


@pytest.mark.parametrize("flags,message", [
    (["--d-model", "30"], "d_model=30"),
    (["--num-kv-heads", "3"], "num_kv_heads=3"),
    (["--tie-embeddings", "all", "--tgt-vocab-size", "301"], "tie_embeddings='all'"),
    (["--update-freq", "0"], "update_freq"),
    (["--cuda-graphs"], "cuda_graphs needs compile (--compile); one shape a batch "
                        "(--pack-length L)"),
    (["--cuda-graphs", "--compile", "--pack-length", "64", "--update-freq", "2"],
     "cuda_graphs needs one batch a step (--update-freq 1"),
])
def test_cli_refuses_bad_configs_naming_the_field(tiny_corpus, tmp_path, capsys, flags, message):
    argv = ["train", "--data", str(tiny_corpus), "--out", str(tmp_path / "run"),
            "--preset", "tiny", *flags]
    assert main(argv) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_cuda_graphs_compile_for_one_shape_and_mark_each_step(tiny_corpus, tmp_path,
                                                              monkeypatch):
    """What a run with cuda_graphs asks of torch.compile and of its CUDA graphs (the
    graphs themselves replay on a GPU: tests/test_cuda.py)."""
    asked, marks = [], []
    monkeypatch.setattr(loop, "check_cuda_graphs", lambda *args: None)
    monkeypatch.setattr(loop.torch, "compile", lambda net, **options: asked.append(options)
                        or net)
    monkeypatch.setattr(loop.torch.compiler, "cudagraph_mark_step_begin",
                        lambda: marks.append(len(marks)))
    train(tiny_corpus, tmp_path / "run", tiny_config(),
          train_config(max_steps=3, compile=True, pack_length=64, cuda_graphs=True))
    assert asked == [{"dynamic": False, "mode": "reduce-overhead"}] and len(marks) == 3


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is there to replay on")
def test_cuda_graphs_without_a_gpu_are_refused_before_anything_is_written(tiny_corpus,
                                                                          tmp_path, capsys):
    argv = ["train", "--data", str(tiny_corpus), "--out", str(tmp_path / "run"),
            "--preset", "tiny", "--compile", "--pack-length", "64", "--cuda-graphs"]
    assert main(argv) == 2
    assert "cuda_graphs replays steps on a CUDA GPU, and this machine has none" in \
        capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_cli_config_file_and_flags(tiny_corpus, tmp_path, capsys):
    config = tmp_path / "run.toml"
    config.write_text('preset = "tiny"\n[model]\nnum_kv_heads = 2\n[train]\nmax_steps = 3\n'
                      'max_tokens = 200\nwarmup_steps = 5\n', encoding="utf-8")
    run = tmp_path / "run"
    assert main(["train", "--data", str(tiny_corpus), "--out", str(run), "--config", str(config),
                 "--max-steps", "2"]) == 0
    model_config, train_cfg = checkpoint.read_configs(checkpoint.resolve(run))
    assert model_config.num_kv_heads == 2 and model_config.d_model == 64
    assert train_cfg.max_steps == 2 and train_cfg.max_tokens == 200
    assert main(["train", "--data", str(tiny_corpus), "--out", str(run), "--preset", "tiny"]) == 2
    assert "--resume" in capsys.readouterr().err
    # Resumed with the first command line and a longer budget in the file: it continues.
    config.write_text('preset = "tiny"\n[model]\nnum_kv_heads = 2\n[train]\nmax_steps = 3\n',
                      encoding="utf-8")
    resume = ["train", "--data", str(tiny_corpus), "--out", str(run), "--resume"]
    assert main([*resume, "--config", str(config)]) == 0
    assert checkpoint.list_checkpoints(run)[-1].name == "step-0000003"
    assert main([*resume, "--preset", "small", "--max-steps", "4"]) == 2
    assert "describe another: d_model 256 (the run: 64)" in capsys.readouterr().err
    assert main(["train", "--data", str(tiny_corpus), "--out", str(tmp_path / "up"), "--init",
                 str(run), "--preset", "tiny", "--config", str(config)]) == 2
    assert (f"--init keeps the checkpoint's model; it cannot change --preset, {config}: preset, "
            f"{config}: [model] num_kv_heads") in capsys.readouterr().err
    config.write_text('[train]\nmax_stepz = 3\n', encoding="utf-8")
    assert main(["train", "--data", str(tiny_corpus), "--out", str(tmp_path / "x"),
                 "--config", str(config)]) == 2
    assert "max_stepz" in capsys.readouterr().err


def run_cli(args, **kwargs):
    return subprocess.Popen([sys.executable, "-m", "transduce", *args], env=CPU_ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kwargs)


def test_sigterm_writes_a_final_checkpoint(tiny_corpus, tmp_path):
    run = tmp_path / "run"
    process = run_cli(["train", "--data", str(tiny_corpus), "--out", str(run), "--preset", "tiny",
                       "--max-tokens", "200", "--save-every", "100000", "--log-every", "1"])
    deadline = time.time() + 60
    while time.time() < deadline and not (run / "log.jsonl").exists():
        time.sleep(0.2)
    while time.time() < deadline and "train" not in (run / "log.jsonl").read_text():
        time.sleep(0.2)
    process.send_signal(signal.SIGTERM)
    output, _ = process.communicate(timeout=60)
    assert process.returncode == 0, output
    assert "SIGTERM" in output
    saved = checkpoint.list_checkpoints(run)
    assert len(saved) == 1 and (saved[0] / checkpoint.TRAINER_STATE).is_file()


def test_two_processes_equal_one_with_double_update_freq(tiny_corpus, tmp_path):
    common = ["--data", str(tiny_corpus), "--preset", "tiny", "--dropout", "0.0",
              "--max-tokens", "200", "--max-steps", "6", "--warmup-steps", "5", "--threads", "1"]
    train_alone_at_double_update_freq(tmp_path / "one", common)
    # Started by torchrun, as users start them (the other such tests fork them).
    assert_two_processes_trained_alike(tmp_path / "one", tmp_path / "two", common,
                                       launcher=())


# torchrun's worker: `transduce` with the given arguments, which writes the names of
# the threads still running in the process (Linux) once train() has destroyed the
# process group: its own alone. With the collector off, nothing but train() itself
# frees what holds the group. A group's threads may take a moment to end once freed
# (gloo's TCP loop was once seen still running at the first look): they are given up
# to two seconds; a group still held keeps them for good.
WORKER = """
import gc, os, sys, time
gc.disable()
from transduce.cli import main
from transduce.train import loop
shutdown = loop.shutdown_distributed
def thread_name(path):
    try:
        return open(path).read().strip()
    except FileNotFoundError:          # a thread that ended while the list was read: gone
        return None
def thread_names():
    tasks = "/proc/self/task"
    found = [thread_name(f"{tasks}/{t}/comm") for t in os.listdir(tasks)] \\
        if os.path.isdir(tasks) else []
    return sorted(name for name in found if name is not None)
def shutdown_and_look(*args, **kwargs):
    shutdown(*args, **kwargs)
    deadline = time.monotonic() + 2.0
    names = thread_names()
    while any("gloo" in n or "tcpstore" in n for n in names) and time.monotonic() < deadline:
        time.sleep(0.05)
        names = thread_names()
    sys.stdout.flush()
    os.write(1, f"threads left: [{' '.join(names)}]\\n".encode())   # one write: whole
loop.shutdown_distributed = shutdown_and_look
PRELUDE
sys.exit(main(sys.argv[1:]))
"""


def run_two_processes(worker: Path, args: list[str], prelude: str = "",
                      launcher: tuple[str, ...] | None = None) -> subprocess.CompletedProcess:
    """`transduce ARGS` in two gloo processes; asserts that neither aborted and that no
    thread of the process group (gloo's workers, its TCP loop) was left running once
    train() destroyed it, whatever the run's outcome. launcher: torchrun's options, to
    start them with torchrun; None forks them from a process that has imported torch
    once (tests/train/forked.py: torchrun's environment, without its start-up)."""
    worker.write_text(WORKER.replace("PRELUDE", prelude), encoding="utf-8")
    result = run_forked(worker, args) if launcher is None else subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
         "2", *launcher, str(worker), *args],
        env=CPU_ENV, capture_output=True, text=True, timeout=300)
    output = result.stdout + result.stderr
    assert "terminate called" not in output and "SIGABRT" not in output, output
    left = re.findall(r"threads left: \[([^\]]*)\]", result.stdout)
    assert len(left) == 2, output
    assert not any("gloo" in names or "tcpstore" in names for names in left), left
    return result


def train_alone_at_double_update_freq(out: Path, common: list[str]) -> None:
    """The two-process runs' reference: `transduce train COMMON` at update_freq 2 into
    `out`, in this process (a process of its own would only add its start)."""
    assert main(["train", "--out", str(out), "--update-freq", "2", *common]) == 0


def assert_two_processes_trained_alike(one: Path, two: Path, common: list[str],
                                       launcher: tuple[str, ...] | None = None) -> None:
    """Train `common` in two gloo processes at update_freq 1 into `two`: the weights
    must be those of the single process at update_freq 2 in `one`; neither process
    aborts or leaves the process group's threads behind."""
    double = run_two_processes(two.parent / f"{two.name}_worker.py",
                               ["train", "--out", str(two), "--update-freq", "1", *common],
                               launcher=launcher)
    assert double.returncode == 0, double.stdout + double.stderr
    a, b = weights(one), weights(two)
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=1e-5)


FAIL_AT_STEP_2 = """
from transduce.train import loop
periodic = loop._periodic
def failing(run, *args, **kwargs):
    if run.position.step == 2:
        raise loop.TrainingError("deliberate failure at step 2")
    return periodic(run, *args, **kwargs)
loop._periodic = failing
"""


def test_a_run_failing_in_two_processes_leaves_no_process_group_behind(tiny_corpus,
                                                                       tmp_path):
    """An error in the middle of a two-process run: each process names it and exits
    with the process group destroyed (the error's frames hold the DDP module)."""
    result = run_two_processes(tmp_path / "worker.py",
                               ["train", "--data", str(tiny_corpus), "--out",
                                str(tmp_path / "run"), "--preset", "tiny", "--max-tokens",
                                "200", "--max-steps", "6", "--threads", "1"],
                               prelude=FAIL_AT_STEP_2)
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert output.count("transduce: error: deliberate failure at step 2") == 2, output


def test_cli_average_and_plot(tiny_corpus, tmp_path, capsys):
    run = tmp_path / "run"
    train(tiny_corpus, run, tiny_config(), train_config(max_steps=6, save_every=2, log_every=1,
                                                        eval_every=3))
    assert main(["average", str(run), "--last", "2", "--out", str(run / "average")]) == 0
    assert "step-0000004, step-0000006" in capsys.readouterr().out
    averaged = weights(run / "average")
    last_two = [weights(run / "step-0000004"), weights(run / "step-0000006")]
    for name, tensor in averaged.items():
        torch.testing.assert_close(tensor, (last_two[0][name] + last_two[1][name]) / 2)
    assert main(["plot", str(run)]) == 0
    assert (run / "curves.png").stat().st_size > 10_000
    assert main(["average", str(tmp_path / "nothing"), "--out", str(tmp_path / "x")]) == 1


def test_bfloat16_autocast_trains_with_float32_master_weights(tiny_corpus, tmp_path):
    run = tmp_path / "run"
    train(tiny_corpus, run, tiny_config(), train_config(max_steps=8, dtype="bfloat16"))
    model = load_model(run)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    records = [__import__("json").loads(line) for line in (run / "log.jsonl").open()]
    losses = [r["loss"] for r in records if r["event"] == "train"]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]


@pytest.mark.parametrize("changes", [
    {"arch": "rnn-bahdanau"}, {"arch": "rnn-luong", "rnn_cell": "lstm"},
    {"arch": "rnn-luong", "luong_score": "dot", "input_feeding": True},
    {"attention_type": "linear"}, {"attention_type": "sliding", "attention_window": 2},
    {"attention_type": "global", "attention_window": 2}, {"attention_type": "strided",
                                                           "attention_window": 2},
    {"positional": "t5"}, {"positional": "alibi", "attention_impl": "flash"},
])
def test_every_architecture_and_attention_type_trains(tiny_corpus, tmp_path, changes):
    run = tmp_path / "run"
    train(tiny_corpus, run, tiny_config(**changes), train_config(max_steps=25))
    log = [json.loads(line) for line in (run / LOG_NAME).read_text().splitlines()]
    losses = [r["loss"] for r in log if r.get("event") == "train"]
    # learned: well below the start in the second half (at this rate a logged loss can
    # spike, as Luong's dot scores with input feeding did on an AVX2-only EPYC)
    assert min(losses[len(losses) // 2:]) < 0.8 * losses[0]
    assert 0 < [r["mfu"] for r in log if r.get("event") == "train"][-1] < 1
    model = load_model(run)
    assert model.config == tiny_config(**changes)


def test_train_leaves_signal_handlers_and_threads_as_it_found_them(tiny_corpus, tmp_path):
    def mine(number, frame):
        pass

    before_int, before_term = signal.signal(signal.SIGINT, mine), signal.getsignal(signal.SIGTERM)
    threads = torch.get_num_threads()
    try:
        train(tiny_corpus, tmp_path / "run", tiny_config(),
              train_config(max_steps=2, threads=1 if threads > 1 else 2))
        assert signal.getsignal(signal.SIGINT) is mine
        assert signal.getsignal(signal.SIGTERM) == before_term
        assert torch.get_num_threads() == threads
    finally:
        signal.signal(signal.SIGINT, before_int)


def test_budget_schedule_moving_average_and_forecast_in_a_run(tiny_corpus, tmp_path, monkeypatch,
                                                              capsys):
    monkeypatch.setattr(loop, "FORECAST_AFTER_S", 0.0)
    run = tmp_path / "run"
    config = train_config(max_steps=10, max_minutes=60.0, schedule="budget",
                          warmup_fraction=0.2, log_every=1, ema_decay=0.5)
    train(tiny_corpus, run, tiny_config(), config)
    records = [json.loads(line) for line in (run / LOG_NAME).read_text().splitlines()]
    rates = [r["lr"] for r in records if r["event"] == "train"]
    peak = 2.0 * (64 * 20) ** -0.5
    expected = [peak * min((s / 10) / 0.2, (1 - s / 10) / 0.8) for s in range(10)]
    # By steps (10 steps take far less than 60 minutes; the first step's few milliseconds
    # of the hour lift its rate off 0 a little).
    assert rates == pytest.approx(expected, rel=1e-3, abs=1e-5)
    forecast = [r for r in records if r["event"] == "forecast"]
    assert len(forecast) == 1 and forecast[0]["expected_steps"] > 10
    assert "at this pace about" in capsys.readouterr().out
    averaged, last = weights(run / "ema"), weights(run)
    assert any(not torch.equal(averaged[name], last[name]) for name in last)
    assert checkpoint.trained_steps(run / "ema") == 10


def test_resume_is_exact_with_a_moving_average(tiny_corpus, tmp_path):
    config = dict(ema_decay=0.8)
    straight, split = tmp_path / "straight", tmp_path / "split"
    train(tiny_corpus, straight, tiny_config(), train_config(max_steps=12, **config))
    train(tiny_corpus, split, tiny_config(), train_config(max_steps=6, **config))
    train(tiny_corpus, split, tiny_config(), train_config(max_steps=12, **config), resume=True)
    for part in ("ema", "step-0000012"):
        a, b = weights(straight / part), weights(split / part)
        assert all(torch.equal(a[name], b[name]) for name in a)


def test_plot_races_runs_by_minutes(tiny_corpus, tmp_path, capsys):
    runs = []
    for name, changes in (("post-norm", {}), ("pre-norm", {"norm_first": True})):
        runs.append(tmp_path / name)
        train(tiny_corpus, runs[-1], tiny_config(**changes),
              train_config(max_steps=6, eval_every=3, dev_bleu_sentences=5))
    out = tmp_path / "race.png"
    assert main(["plot", *map(str, runs), "--out", str(out)]) == 0
    assert out.stat().st_size > 10_000
    assert main(["plot", *map(str, runs)]) == 2
    assert "--out" in capsys.readouterr().err


def test_small_preset_brings_its_budget_recipe_and_flags_override_it(tiny_corpus, tmp_path,
                                                                      monkeypatch, capsys):
    seen = {}
    monkeypatch.setattr(loop, "train", lambda data, out, model_config, train_config, **_:
                        seen.update(model=model_config, train=train_config))
    argv = ["train", "--data", str(tiny_corpus), "--out", str(tmp_path / "run")]
    assert main([*argv, "--preset", "small", "--max-minutes", "5"]) == 0
    recipe = seen["train"]
    assert (recipe.schedule, recipe.max_tokens, recipe.ema_decay) == ("budget", 2048, 0.999)
    assert seen["model"].norm_first and recipe.max_minutes == 5
    assert main([*argv, "--preset", "small", "--max-steps", "9", "--max-tokens", "4096",
                 "--schedule", "noam"]) == 0
    assert (seen["train"].schedule, seen["train"].max_tokens) == ("noam", 4096)
    assert main([*argv, "--preset", "base", "--max-minutes", "5"]) == 0
    assert (seen["train"].schedule, seen["train"].warmup_steps) == ("noam", 4000)  # the paper's
    assert not seen["model"].norm_first
    assert main([*argv, "--preset", "small"]) == 2
    assert "give --max-minutes or --max-steps" in capsys.readouterr().err
