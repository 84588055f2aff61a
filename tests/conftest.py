import os
import random

import pytest
import torch

# Without a GPU, impl="triton" is tested in Triton's interpreter, which must be chosen
# before triton is first imported (tests/attention/test_triton.py).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _share_the_cores_among_workers() -> None:
    """Under pytest-xdist (`make test` runs one worker per core), each worker and the
    processes it starts take their share of the cores: two workers of two threads each
    on two cores spin against each other (OpenMP) and run the suite slower than one."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 1:
        threads = max(1, (os.cpu_count() or 1) // workers)
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)


_share_the_cores_among_workers()

from transduce.data.corpus import write_metadata
from transduce.data.tokenizer import train_tokenizer


# The files that take longest (40-85 s each on a 2-core EPYC Zen 3), run first: `make
# test` hands each file whole to a worker in the order collected (xdist's
# --no-loadscope-reorder; by default it orders them by their number of tests), and a
# long file handed out last runs alone while the other worker waits.
LONGEST_FIRST = ["tests/serve/test_fuzz.py", "tests/train/test_objective.py",
                 "tests/decode/test_speculative_sampling.py", "tests/attention/test_triton.py",
                 "tests/model/test_decoder_step.py", "tests/model/test_compile.py",
                 "tests/decode/test_continuous.py", "tests/decode/test_speculative.py",
                 "tests/train/test_loop.py", "tests/test_onnx.py", "tests/serve/test_browser.py",
                 "tests/train/test_answering.py"]


def pytest_collection_modifyitems(items):
    rank = {name: place for place, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))


@pytest.fixture(autouse=True)
def _seed():
    """Every test starts from the same random state."""
    torch.manual_seed(0)


WORDS = {"uno": "one", "dos": "two", "tres": "three", "casa": "house", "perro": "dog",
         "gato": "cat", "rojo": "red", "grande": "big", "el": "the", "come": "eats"}


def write_word_pairs(directory, words: dict[str, str], target_language: str) -> None:
    """A word-for-word toy translation task: Spanish words (the keys of `words`) into
    theirs, 300 training pairs, 30 dev, 30 test, written as a corpus directory."""
    rng = random.Random(0)
    for split, size in (("train", 300), ("dev", 30), ("test", 30)):
        source, target = [], []
        for _ in range(size):
            chosen = [rng.choice(list(words)) for _ in range(rng.randint(2, 8))]
            source.append(" ".join(chosen))
            target.append(" ".join(words[w] for w in chosen))
        (directory / f"{split}.es").write_text("\n".join(source) + "\n", encoding="utf-8")
        (directory / f"{split}.{target_language}").write_text("\n".join(target) + "\n",
                                                             encoding="utf-8")
    write_metadata(directory, "es", target_language)


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory):
    """A word-for-word toy translation task with its own 300-piece vocabulary."""
    directory = tmp_path_factory.mktemp("corpus")
    write_word_pairs(directory, WORDS, "en")
    train_source = (directory / "train.es").read_text(encoding="utf-8").splitlines()
    train_target = (directory / "train.en").read_text(encoding="utf-8").splitlines()
    train_tokenizer(train_source + train_target, directory, vocab_size=300)
    return directory


@pytest.fixture(scope="session")
def tool_caller(tmp_path_factory):
    """An instruct model whose template takes tools, trained until it calls two of them
    when asked for the weather, and answers a greeting in text (tests/chat_models.py)."""
    from tests.chat_models import tool_model

    return tool_model(tmp_path_factory.mktemp("tools"))


@pytest.fixture(scope="session")
def reasoning(tmp_path_factory):
    """A thinking model whose template opens the reply's reasoning, and a bias towards
    </think> with which its greedy reply to CONVERSATIONS[1] closes the reasoning
    after some of it and answers after that."""
    from tests.chat_models import CONVERSATIONS, reasoning_model

    model = reasoning_model(tmp_path_factory.mktemp("reasoning"))
    close = model.generator.tokenizer.backend.token_to_id("</think>")
    for bias in range(0, 40):
        text = model.generator.chat(CONVERSATIONS[1], max_new_tokens=24,
                                    logit_bias={close: bias})
        thought, _, answer = text.partition("</think>")
        if thought.strip() and answer.strip():
            model.bias, model.text = {str(close): bias}, text
            return model
    raise AssertionError("no bias gives a reply with reasoning and an answer")


@pytest.fixture(scope="session")
def neox_tokenizer(tmp_path_factory):
    """A byte-level BPE with Pythia's special tokens (<|endoftext|> 0, <|padding|> 1),
    whose tokenizer_config.json names <|endoftext|> for bos and eos and no pad token; no
    post-processor (GPT-NeoX and StableLM add no bos to a prompt)."""
    import json

    tokenizers = pytest.importorskip("tokenizers")
    directory = tmp_path_factory.mktemp("neox-tokenizer")
    text = ["The quick brown fox jumps over the lazy dog. It's a dog's life.",
            "El niño comió una manzana en la mañana; ¿verdad que sí?",
            "In the beginning God created the heaven and the earth.",
            "Ça coûte 12,50 € — déjà vu, naïve café."]
    trained = tokenizers.ByteLevelBPETokenizer()
    trained.train_from_iterator(text * 2, vocab_size=320, min_frequency=1,
                                special_tokens=["<|endoftext|>", "<|padding|>"],
                                show_progress=False)
    trained.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>",
         "unk_token": "<|endoftext|>"}))
    return directory
