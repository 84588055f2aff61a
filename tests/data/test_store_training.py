"""Training from the token store: the same model as from text, and across two "nodes"
(torchrun --nnodes 2 on one machine, rendezvous on 127.0.0.1, gloo) the same model as
one process with twice the update frequency, each rank reading only its share."""

import shutil
import socket
import subprocess
import sys
from pathlib import Path

import torch

from transduce.config import TrainConfig, preset
from transduce.data.store import build_store
from transduce.data.tokenizer import MODEL_NAME, Tokenizer
from transduce.model import load_model
from transduce.train.loop import train
from tests.train.test_loop import CPU_ENV, train_alone_at_double_update_freq

COMMON = ["--preset", "tiny", "--dropout", "0.0", "--max-tokens", "200", "--max-steps", "4",
          "--warmup-steps", "4", "--threads", "1", "--eval-every", "1000",
          "--save-every", "1000"]


def stored_corpus(tiny_corpus: Path, destination: Path) -> Path:
    shutil.copytree(tiny_corpus, destination, ignore=shutil.ignore_patterns(".cache", "tokens"))
    tokenizer = Tokenizer(destination / MODEL_NAME)
    build_store(destination, "train", tokenizer.path, tokenizer.vocab_size,
                tokenizer.fingerprint, workers=1, progress=False)
    return destination


def test_training_from_the_store_equals_training_from_text(tiny_corpus, tmp_path, capsys):
    corpus = stored_corpus(tiny_corpus, tmp_path / "stored")
    model = preset("tiny", src_vocab_size=300, tgt_vocab_size=300, dropout=0.1)
    config = TrainConfig(max_tokens=200, warmup_steps=5, max_steps=5, eval_every=1000,
                         save_every=1000, threads=1, lr_scale=2.0)
    train(corpus, tmp_path / "from-store", model, config)
    assert "(token store, uint16)" in capsys.readouterr().out
    train(tiny_corpus, tmp_path / "from-text", model, config)
    assert "token store" not in capsys.readouterr().out
    a = load_model(tmp_path / "from-store").state_dict()
    b = load_model(tmp_path / "from-text").state_dict()
    assert all(torch.equal(a[name], b[name]) for name in a)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_two_nodes_on_loopback_equal_one_process_with_double_update_freq(tiny_corpus, tmp_path):
    corpus = stored_corpus(tiny_corpus, tmp_path / "stored")
    train_alone_at_double_update_freq(tmp_path / "one", ["--data", str(corpus), *COMMON])
    port = free_port()
    nodes = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node",
         "1", "--node_rank", str(rank), "--master_addr", "127.0.0.1", "--master_port",
         str(port), "-m", "transduce", "train", "--data", str(corpus), "--out",
         str(tmp_path / "two"), "--update-freq", "1", *COMMON],
        env=CPU_ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for rank in (0, 1)]
    outputs = [node.communicate(timeout=300)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(outputs)
    assert "token store" in outputs[0]         # the run read the store, not the text
    a = load_model(tmp_path / "one").state_dict()
    b = load_model(tmp_path / "two").state_dict()
    # The gradients are summed over the two nodes by gloo's all-reduce, where the single
    # process adds them in its own order: equal to float32 reduction-order tolerance.
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=1e-5)
