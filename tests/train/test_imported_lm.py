"""Training an imported language model on one's own text: `train --init` on a GPT-2, a
Llama, a Qwen3 or a Gemma 3 checkpoint reads the corpus with its tokenizer.json and
builds its lines with its own bos and eos. GPT-2 and Llama pad with eos, a token the
model must also predict, so the targets not scored are IGNORE and the loss has no pad
token (Gemma's own pad token is left out of it). Shown against transformers (the loss
of a batch we build is each family's cross entropy on the fast tokenizer's ids), against
the line layout (packed blocks score the same targets), and against ourselves (an
exported and re-imported copy of our model trains to the same weights as the model)."""

import json
from functools import partial

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from transduce import checkpoint
from transduce.cli import main
from transduce.config import TrainConfig
from transduce.data.batching import (SENTENCEPIECE_LINES, LineSpecials, PackedBatcher,
                                     TokenBatcher, pack_stream)
from transduce.data.dataset import load_text_split
from transduce.data.hf_tokenizer import HFTokenizer
from transduce.data.masking import IGNORE
from transduce.data.tokenizer import Tokenizer
from transduce.importers import import_gemma, import_gpt2, import_llama
from transduce.model import load_model
from transduce.train import loop
from transduce.train.log import LOG_NAME
from transduce.train.loop import TrainingError, train
from transduce.train.objective import SequenceObjective
from tests.train.test_lm import WORDS, counting, gpt_tiny  # noqa: F401 - counting: a fixture
from tests.train.test_loop import weights

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

EOT = "<|endoftext|>"
# Texts that hold a special token (Llama's "<s>", GPT-2's end of text) read it as one:
# a line's bos target is not scored by its position, whatever its ids hold.
LINES = ["one two three", "seven eight nine ten eleven twelve", "five <s> six",
         f"ten {EOT} eleven twelve", "twelve"]


def write_gpt2(directory):
    """A random GPT2LMHeadModel with a byte-level BPE trained here (end of text id 0,
    GPT-2's bos, eos and pad)."""
    bpe = tokenizers.ByteLevelBPETokenizer()
    bpe.train_from_iterator([" ".join(WORDS)] * 3 + ["hello world <s>"], vocab_size=300,
                            min_frequency=1, special_tokens=[EOT], show_progress=False)
    directory.mkdir()
    bpe.save(str(directory / "tokenizer.json"))
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=bpe.get_vocab_size(), n_layer=2, n_head=2,
                                     n_embd=32, n_positions=64, bos_token_id=0, eos_token_id=0)
    transformers.GPT2LMHeadModel(config).save_pretrained(directory)


def write_bpe(directory, specials):
    """A SentencePiece-style BPE trained on WORDS into a new `directory`, its special
    tokens (role -> token) first with ids in that order, a post-processor that starts
    every sequence with the bos token, and a tokenizer_config.json naming them."""
    bpe = tokenizers.SentencePieceBPETokenizer()
    bpe.train_from_iterator([" ".join(WORDS)] * 3 + ["hello world"], vocab_size=300,
                            min_frequency=1, special_tokens=list(specials.values()),
                            show_progress=False)
    bos = specials["bos"]
    bpe.post_processor = tokenizers.processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
        special_tokens=[(bos, list(specials).index("bos"))])
    directory.mkdir()
    bpe.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {f"{role}_token": token for role, token in specials.items()}))
    return bpe


def write_llama(directory, model_type="llama"):
    """A random LlamaForCausalLM (grouped-query; or a Qwen3ForCausalLM, its queries and
    keys normalized, heads wider than hidden_size / heads; or a Phi3ForCausalLM, its
    projections fused) with a SentencePiece-style BPE
    whose post-processor starts every sequence with <s>, as Llama 2's."""
    bpe = write_bpe(directory, {"unk": "<unk>", "bos": "<s>", "eos": "</s>"})
    torch.manual_seed(0)
    config_class, model_class, more = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
        "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM,     # fused projections
                 {"pad_token_id": None}),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {"head_dim": 16}),
    }[model_type]
    config = config_class(vocab_size=bpe.get_vocab_size(), hidden_size=32,
                          intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, max_position_embeddings=64, bos_token_id=1,
                          eos_token_id=2, **more)
    model_class(config).save_pretrained(directory)


def write_gemma(directory, generation="gemma3"):
    """A random Gemma3ForCausalLM (a sliding layer of 4 keys, then a full one) with a
    SentencePiece-style BPE whose post-processor starts every sequence with <bos>, and
    Gemma's ids: <pad> 0, <eos> 1, <bos> 2; or a Gemma2ForCausalLM of that shape, its
    scores and logits soft-capped low enough that the caps count."""
    bpe = write_bpe(directory, {"pad": "<pad>", "eos": "<eos>", "bos": "<bos>",
                                "unk": "<unk>"})
    torch.manual_seed(0)
    config_class, model_class, more = (
        (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM, {})
        if generation == "gemma3" else
        (transformers.Gemma2Config, transformers.Gemma2ForCausalLM,
         {"attn_logit_softcapping": 0.5, "final_logit_softcapping": 2.0,
          "initializer_range": 0.2}))
    config = config_class(
        vocab_size=bpe.get_vocab_size(), hidden_size=32, intermediate_size=48,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        query_pre_attn_scalar=8, sliding_window=4, max_position_embeddings=64,
        layer_types=["sliding_attention", "full_attention"], pad_token_id=0, eos_token_id=1,
        bos_token_id=2, **more)
    model_class(config).save_pretrained(directory)


FAMILIES = {"gpt2": (write_gpt2, import_gpt2, transformers.GPT2LMHeadModel),
            "llama": (write_llama, import_llama, transformers.LlamaForCausalLM),
            "qwen3": (partial(write_llama, model_type="qwen3"), import_llama,
                      transformers.Qwen3ForCausalLM),
            "gemma3": (write_gemma, import_gemma, transformers.Gemma3ForCausalLM),
            "gemma2": (partial(write_gemma, generation="gemma2"), import_gemma,
                       transformers.Gemma2ForCausalLM)}
GEMMAS = ("gemma3", "gemma2")
# Each family's (bos, eos, pad): GPT-2's one token; Llama's pad is its eos; Gemma's own.
SPECIAL_IDS = {"gpt2": (0, 0, 0), "llama": (1, 2, 2), "qwen3": (1, 2, 2), "gemma3": (2, 1, 0),
               "gemma2": (2, 1, 0)}


@pytest.fixture(scope="module", params=list(FAMILIES))
def imported(request, tmp_path_factory):
    """(family, the transformers checkpoint's directory, our import of it)."""
    write, import_, _ = FAMILIES[request.param]
    root = tmp_path_factory.mktemp(request.param)
    write(root / "hf")
    return request.param, root / "hf", import_(root / "hf", root / "ours")


def training_tokenizer(directory, data):
    model_config, _ = checkpoint.read_configs(checkpoint.resolve(directory))
    return loop._training_tokenizer(data, checkpoint.resolve(directory), model_config)


def train_config(**changes):
    values = dict(max_tokens=256, warmup_steps=20, log_every=10, eval_every=1000,
                  save_every=1000, label_smoothing=0.0, dtype="float32")
    return TrainConfig(**{**values, **changes})


def test_the_specials_are_the_vocabularys(imported, counting):
    family, _, ours = imported
    tokenizer = training_tokenizer(ours, counting)
    specials = LineSpecials.of(tokenizer)
    assert isinstance(tokenizer, HFTokenizer)
    bos, eos, pad = SPECIAL_IDS[family]
    assert specials == LineSpecials(bos, eos, pad, IGNORE)
    assert specials.shares_bos == (family == "gpt2")
    # eos pads GPT-2 and Llama, a target too: the loss leaves out only Gemma's own pad
    assert specials.loss_pad == (0 if family in GEMMAS else None)
    assert LineSpecials.of(Tokenizer(counting / "spm.model")) is SENTENCEPIECE_LINES
    assert SENTENCEPIECE_LINES.loss_pad == 0


def test_a_line_batch_gives_transformers_loss(imported, counting):
    """The batch holds [bos] + the fast tokenizer's ids as input and ids + [eos] as
    targets; the loss we train with is transformers' cross entropy over them."""
    family, hf_dir, ours = imported
    tokenizer = training_tokenizer(ours, counting)
    # A qwen3 directory's AutoTokenizer is Qwen2Tokenizer, which puts Qwen's own
    # pre-tokenizer over this SentencePiece-style tokenizer.json (real Qwen vocabularies
    # carry that one already): the file's own tokenizer is the reference there.
    # (Gemma's, GemmaTokenizer, likewise has a pre-tokenizer of its own.)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(hf_dir / "tokenizer.json")) \
        if family in ("qwen3", *GEMMAS) else \
        transformers.AutoTokenizer.from_pretrained(str(hf_dir))
    ids = [np.asarray(x, dtype=np.int64) for x in tokenizer.encode(LINES)]
    specials = LineSpecials.of(tokenizer)
    batch = TokenBatcher(None, ids, 1000, shuffle=False, specials=specials).collate(
        np.arange(len(LINES)))
    for row, line in enumerate(LINES):
        expected = fast(line, add_special_tokens=False)["input_ids"]
        length = len(expected) + 1
        assert batch.tgt_in[row, :length].tolist() == [specials.bos, *expected]
        assert batch.tgt_out[row, :length].tolist() == [*expected, specials.eos]
        assert (batch.tgt_out[row, length:] == IGNORE).all()
    assert batch.num_tgt_tokens == int((batch.tgt_out != IGNORE).sum())
    hf = FAMILIES[family][2].from_pretrained(str(hf_dir)).eval()
    real = (batch.tgt_out != IGNORE).long()
    with torch.no_grad():
        logits = hf(input_ids=batch.tgt_in, attention_mask=real).logits
        want = F.cross_entropy(logits.flatten(0, 1), batch.tgt_out.flatten(),
                               ignore_index=IGNORE, reduction="sum")
        objective = SequenceObjective(load_model(ours).eval(), True, 0.0, specials.loss_pad)
        got = objective(None, batch.tgt_in, batch.tgt_out)
    assert got.item() == pytest.approx(want.item(), rel=1e-5)


def scored(batch):
    """The (input context, target) of every scored target of a batch, as tuples."""
    out = []
    for tgt_in, tgt_out in zip(batch.tgt_in.tolist(), batch.tgt_out.tolist()):
        out += [(tuple(tgt_in[:i + 1]), t) for i, t in enumerate(tgt_out) if t != IGNORE]
    return out


def test_packed_blocks_score_what_the_lines_score(imported, counting):
    """Blocks cut from the stream score each line's targets from its bos to its eos, as
    the line layout does: where one token ends a line and opens the next (GPT-2's), the
    stream holds it once and every target is scored; else the bos targets are not, by
    position (a line's own <s> is scored)."""
    family, _, ours = imported
    tokenizer = training_tokenizer(ours, counting)
    specials = LineSpecials.of(tokenizer)
    ids = [np.asarray(x, dtype=np.int64) for x in tokenizer.encode(LINES * 3)]
    stream = pack_stream(ids, specials)
    lines = sum(len(x) + 1 for x in ids)          # targets per line: its ids and eos
    assert len(stream) == lines + (1 if family == "gpt2" else len(ids))
    batcher = PackedBatcher(ids, 7, 21, shuffle=False, specials=specials)
    batches = [batcher.collate(indices) for indices in batcher.epoch_batches(0)]
    assert torch.cat([b.tgt_in.flatten() for b in batches])[:len(stream) - 1].tolist() == \
        stream[:-1].tolist()
    targets = [t for b in batches for row in b.tgt_out.tolist() for t in row if t != IGNORE]
    line_batch = TokenBatcher(None, ids, 10000, shuffle=False, specials=specials).collate(
        np.arange(len(ids)))
    assert sorted(targets) == sorted(t for _, t in scored(line_batch))
    assert sum(b.num_tgt_tokens for b in batches) == len(targets) == lines
    # the same as reading each block's span of the stream directly
    for position, b in enumerate(batches):
        for row, block in enumerate(b.indices.tolist()):
            count = int(batcher.block_lengths[block])
            assert b.tgt_in[row, :count].tolist() == \
                stream[block * 7:block * 7 + count].tolist(), (position, row)
    if family == "llama":   # "five <s> six": its <s> is a scored target
        inner = tokenizer.encode(["five <s> six"])[0]
        assert 1 in inner and targets.count(1) == 3


def test_an_imported_language_model_trains_on_a_corpus_of_its_own(imported, counting,
                                                                  tmp_path, capsys):
    """From the command line, in lines and packed: the import's recipe is announced, the
    dev loss falls, and the result is a model of the same vocabulary that generates and
    is evaluated."""
    family, _, ours = imported
    tokenizer = training_tokenizer(ours, counting)
    untrained = loop.evaluate_dev(load_model(ours), load_text_split(counting, "dev", tokenizer),
                                  tokenizer, train_config(), torch.device("cpu"))["dev_loss"]
    for pack in ("0", "16"):
        run = tmp_path / f"run-{pack}"
        assert main(["train", "--data", str(counting), "--out", str(run), "--init", str(ours),
                     "--max-steps", "40", "--max-tokens", "256", "--dtype", "float32",
                     "--eval-every", "40", "--lr-scale", "1", "--pack-length", pack]) == 0
        printed = capsys.readouterr().out
        assert "an import, no recipe of its own" in printed
        dev = [json.loads(line)["dev_loss"] for line in (run / LOG_NAME).open()
               if '"dev_loss"' in line]
        assert dev[-1] < 0.6 * untrained, (pack, untrained, dev)
    trained = checkpoint.resolve(run)
    saved = checkpoint.load_tokenizer(trained)
    assert isinstance(saved, HFTokenizer) and saved.specials == tokenizer.specials
    _, train_cfg = checkpoint.read_configs(trained)
    assert (train_cfg.schedule, train_cfg.label_smoothing) == ("budget", 0.0)
    assert main(["generate", "--model", str(run), "--prompt", "five six",
                 "--max-new-tokens", "8"]) == 0
    continued = capsys.readouterr().out.split()      # the continuation: counting words
    assert continued and set(continued) <= set(WORDS), continued
    assert main(["evaluate", "--model", str(run), "--data", str(counting),
                 "--split", "dev", "--out", str(tmp_path / "eval")]) == 0
    assert "perplexity" in capsys.readouterr().out


def test_resume_continues_exactly(imported, counting, tmp_path):
    """A run from an import stopped mid-epoch, keeping one checkpoint, and resumed, ends
    with the weights of one run straight through."""
    _, _, ours = imported
    config = dict(pack_length=16, max_tokens=64, keep_last=1, save_every=3)
    straight, split = tmp_path / "straight", tmp_path / "split"
    model_config, _ = checkpoint.read_configs(checkpoint.resolve(ours))
    train(counting, straight, model_config, train_config(max_steps=6, **config), init=ours)
    train(counting, split, model_config, train_config(max_steps=3, **config), init=ours)
    train(counting, split, model_config, train_config(max_steps=6, **config), resume=True)
    a, b = weights(straight), weights(split)
    assert all(torch.equal(a[name], b[name]) for name in a)
    assert any(not torch.equal(a[name], weights(ours)[name]) for name in a)


@pytest.fixture(scope="module")
def exported_copy(counting, tmp_path_factory):
    """(our language model, its `export hf` read back by `import hf-gpt2`)."""
    root = tmp_path_factory.mktemp("copy")
    train(counting, root / "pre", gpt_tiny(), train_config(max_steps=2, max_tokens=128))
    assert main(["export", "hf", str(root / "pre"), str(root / "hf")]) == 0
    return root / "pre", import_gpt2(root / "hf", root / "copy")


@pytest.mark.parametrize("pack_length", [0, 16], ids=["lines", "packed"])
def test_an_exported_and_imported_copy_trains_as_ours(exported_copy, counting, tmp_path,
                                                      pack_length):
    """The copy reads the corpus with its tokenizer.json into the same ids, and trains on
    from them to the same weights as our model from its SentencePiece vocabulary."""
    config = train_config(max_steps=4, max_tokens=128, pack_length=pack_length,
                          label_smoothing=0.1)
    results = []
    for source, out in zip(exported_copy, (tmp_path / "ours", tmp_path / "copy")):
        model_config, _ = checkpoint.read_configs(checkpoint.resolve(source))
        train(counting, out, model_config, config, init=source)
        results.append(weights(out))
    ours, theirs = results
    assert isinstance(training_tokenizer(exported_copy[1], counting), HFTokenizer)
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[name], theirs[name]) for name in ours)


def test_refusals(imported, counting):
    """A translation model on a tokenizer.json, and a vocabulary larger than the
    model's output, are named."""
    _, _, ours = imported
    directory = checkpoint.resolve(ours)
    model_config, _ = checkpoint.read_configs(directory)
    with pytest.raises(TrainingError, match="tokenizer.json.*'transformer' model trains"):
        loop._training_tokenizer(counting, directory, model_config.replace(
            arch="transformer", full_attention_layers=(), local_rope_base=None,
            attention_softcap=None, logit_softcap=None))
    tokenizer = training_tokenizer(ours, counting)
    size = tokenizer.vocab_size - 1
    small = model_config.replace(src_vocab_size=size, tgt_vocab_size=size)
    with pytest.raises(TrainingError, match=f"{size + 1} tokens, but the model "
                                            f"has tgt_vocab_size={size}"):
        loop._check_vocabulary(small, tokenizer)
