"""What the importers' tests share: a copy of a small Hugging Face checkpoint with its
config or weights changed, the check that an import was refused leaving nothing, and
the checks that an imported language model computes and generates what transformers'
does."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from transduce.importers import ForeignCheckpointError


def damaged(small_hf, tmp_path, config=None, weights=None):
    """A copy of small_hf; config(values) / weights(tensors) change it in place or
    return the replacement."""
    directory = tmp_path / "hf"
    shutil.copytree(small_hf, directory)
    if config:
        values = json.loads((directory / "config.json").read_text())
        (directory / "config.json").write_text(json.dumps(config(values) or values))
    if weights:
        tensors = load_file(str(directory / "model.safetensors"))
        save_file(weights(tensors) or tensors, str(directory / "model.safetensors"))
    return directory


def tokenizer_size(tokenizer_dir):
    """The number of tokens of the tokenizer.json in `tokenizer_dir`."""
    tokenizers = pytest.importorskip("tokenizers")
    return tokenizers.Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json")).get_vocab_size()


def saved_with_drawn_norms(model, directory, tokenizer_dir, norms):
    """A random transformers language model, its norms' gains (parameters whose names hold
    one of `norms`) drawn around 1 and every bias around 0 so that each counts, saved
    with save_pretrained at `directory` beside the tokenizer's files -> the model."""
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if any(norm in name for norm in norms):
                parameter.normal_(1.0 if name.endswith("weight") else 0.0, 0.2)
            elif name.endswith("bias"):
                parameter.normal_(0.0, 0.2)
    model.save_pretrained(directory)
    for file in tokenizer_dir.iterdir():
        (directory / file.name).write_bytes(file.read_bytes())
    return model


def hf_outputs(hf, ids, mask):
    """A transformers encoder's outputs over padded rows ids (B, T) with their real
    tokens mask (B, T), every layer's hidden states included."""
    with torch.no_grad():
        return hf(input_ids=ids, attention_mask=mask.long(), output_hidden_states=True)


def assert_refused(importer, directory, tmp_path, *messages):
    """importer(directory, out) raises naming every message, and writes nothing."""
    out = tmp_path / "out"
    with pytest.raises(ForeignCheckpointError) as error:
        importer(directory, out)
    for message in messages:
        assert message in str(error.value)
    assert not out.exists() and not list(tmp_path.glob(".tmp-*"))


def assert_a_classification_batch_gives_transformers_loss(hf, out, labelled, tmp_path,
                                                          pad_id):
    """Fine-tuning the import `out` of the transformers classifier `hf` (its directory
    beside `out` as "hf"): the batch our training builds from `labelled` (label, text)
    lines is transformers' tokenizer's padded encoding (padding included), and `hf`
    gives our loss on it."""
    from transduce import checkpoint
    from transduce.config import TrainConfig
    from transduce.model import load_model
    from transduce.train import encoder as encoder_training
    from transduce.train.loop import _training_tokenizer
    transformers = pytest.importorskip("transformers")

    data = tmp_path / "data"
    data.mkdir()
    for split in ("train", "dev"):
        (data / f"{split}.tsv").write_text("".join(f"{a}\t{b}\n" for a, b in labelled))
    (data / "corpus.json").write_text('{"kind": "classification", "lang": "en"}')
    model_config, _ = checkpoint.read_configs(out)
    tokenizer = _training_tokenizer(data, out, model_config)
    split, batcher, _ = encoder_training.load_encoder_data(
        data, tokenizer, model_config, TrainConfig(task="classify", max_tokens=1000))
    indices = batcher.epoch_batches(0)[0]
    batch = batcher.collate(indices, (0, 0))
    fast = transformers.AutoTokenizer.from_pretrained(str(out.parent / "hf"))
    encoded = fast([split.corpus.texts[i] for i in indices], padding=True, return_tensors="pt")
    assert torch.equal(batch.ids, encoded["input_ids"]) and (batch.ids == pad_id).any()
    ours = load_model(out).eval()
    with torch.no_grad():
        expected = hf(**encoded, labels=batch.labels).loss
        losses = encoder_training.batch_losses(ours, ours, batch)
    torch.testing.assert_close(losses.sums["classify"] / len(indices), expected,
                               atol=1e-5, rtol=1e-5)


def left_padded(lengths, length, vocab_size, pad_id, seed=0):
    """(B, T) ids, each row's real tokens last, and the (B, T) mask of real tokens."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab_size, (len(lengths), length), generator=generator)
    mask = torch.arange(length)[None, :] >= (length - torch.tensor(lengths))[:, None]
    return ids.masked_fill(~mask, pad_id), mask


def assert_same_logits(hf, ours, atol):
    """Logits of random tokens, and of a left-padded batch at each row's own positions
    (the real tokens compared)."""
    tokens = torch.randint(0, hf.config.vocab_size, (3, 17))
    padded, mask = left_padded([13, 7, 1], 13, hf.config.vocab_size, ours.config.pad_id)
    positions = (mask.long().cumsum(dim=1) - 1).clamp(min=0)
    with torch.no_grad():
        expected, got = hf(tokens).logits, ours(tokens)
        padded_expected = hf(padded, attention_mask=mask.long(), position_ids=positions).logits
        padded_got = ours(padded, key_mask=mask)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=atol, rtol=1e-5)
    torch.testing.assert_close(padded_got[mask], padded_expected[mask], atol=atol, rtol=1e-5)


def assert_same_greedy_tokens(hf, ours, steps, monkeypatch):
    """`steps` greedy tokens after two left-padded prompts, through our cache and
    transformers' generate (no end token: both run every step, whatever they produce;
    undone after the test)."""
    from transduce.decode.search import greedy_search

    prompt, mask = left_padded([6, 3], 6, hf.config.vocab_size, ours.config.pad_id, seed=1)
    monkeypatch.setattr(hf.generation_config, "eos_token_id", None)
    with torch.no_grad():
        expected = hf.generate(prompt, attention_mask=mask.long(), do_sample=False,
                               max_new_tokens=steps, pad_token_id=ours.config.pad_id)[:, 6:]
    got = greedy_search(ours, prompt, bos_id=prompt[:, -1], eos_id=-1, max_len=steps,
                        src_mask=mask[:, None, None, :])
    assert expected.shape == (2, steps)
    assert torch.equal(got, expected)
    assert len(set(expected.flatten().tolist())) > 3     # a real test, not one token repeated


def assert_same_perplexity(hf, out, tmp_path):
    """`transduce evaluate` scores [bos] + line -> line + [eos] with the imported
    tokenizer's ids (GPT-2's bos is its eos): its log-likelihood equals transformers'
    loss on the same sequences."""
    import json

    from transduce import checkpoint
    from transduce.cli import main

    data = tmp_path / "text"
    data.mkdir()
    lines = ["Hello world!", "El niño comió café."]
    (data / "test.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    assert main(["evaluate", "--model", str(out), "--data", str(data), "--split", "test",
                 "--out", str(tmp_path / "eval")]) == 0
    result = json.loads((tmp_path / "eval.json").read_text())
    tokenizer = checkpoint.load_tokenizer(out)
    total = 0.0
    with torch.no_grad():
        for ids in tokenizer.encode(lines):
            sequence = torch.tensor([[tokenizer.bos_id, *ids, tokenizer.eos_id]])
            total += hf(sequence, labels=sequence).loss.item() * (len(ids) + 1)
    assert result["nll"] == pytest.approx(total, rel=1e-5)


def assert_same_onnx_logits(hf, out, tmp_path, atol):
    """`export onnx` of the imported checkpoint `out`: its pass over whole sequences
    computes transformers' logits (assert_same_logits, left-padded rows too)."""
    pytest.importorskip("onnxruntime")
    from transduce.decode.onnx_lm_engine import OnnxLanguageModel
    from transduce.export.onnx import export_onnx

    engine = OnnxLanguageModel(export_onnx(out, tmp_path / "onnx"))

    class WholePass(torch.nn.Module):
        """The export's pass over whole sequences, as the model's forward."""
        config = engine.config

        def forward(self, tokens, key_mask=None):
            return engine.logits(tokens, key_mask)

    assert_same_logits(hf, WholePass(), atol=atol)


LLAMA_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def assert_peft_adapter_merges(ours, out, tmp_path, atol, modules=LLAMA_MODULES):
    """A LoRA adapter PEFT made on the Hugging Face directory `out` was imported from
    (on `modules`, B drawn), merged by `import peft` into the import: the merge computes
    PEFT's logits, which differ from the import's."""
    peft = pytest.importorskip("peft")
    import transformers

    from tests.test_peft import with_drawn_adapters
    from transduce import checkpoint
    from transduce.importers import import_peft
    from transduce.model import load_model

    hf = transformers.AutoModelForCausalLM.from_pretrained(checkpoint.read_origin(out)["from"])
    config = peft.LoraConfig(r=4, lora_alpha=8, task_type="CAUSAL_LM", target_modules=modules)
    theirs = with_drawn_adapters(hf, config, tmp_path / "adapter")
    merged = load_model(import_peft(tmp_path / "adapter", out, tmp_path / "merged"))
    tokens = torch.randint(3, ours.config.tgt_vocab_size, (2, 12))
    with torch.no_grad():
        expected = theirs(tokens).logits
        torch.testing.assert_close(merged(tokens), expected, atol=atol, rtol=1e-5)
        assert (ours(tokens) - expected).abs().max() > 1e-2          # the adapter counts


def assert_a_lora_run_goes_to_peft(hf_dir, importer, counting, tmp_path, atol=1e-4):
    """A LoRA run (q, k, v, o and the feed-forward network) on the import of `hf_dir`,
    written by `export peft`: PEFT puts the adapters on the transformers model and
    computes the run's logits, which differ from the base's."""
    peft = pytest.importorskip("peft")
    import transformers

    from tests.test_peft import lora_run
    from transduce.export import export_peft
    from transduce.model import load_model

    run = lora_run(hf_dir, importer, counting, tmp_path, "q,k,v,o,ffn")
    adapter = export_peft(run, tmp_path / "adapter")
    with torch.no_grad():
        base = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
        ids = torch.randint(3, base.config.vocab_size, (2, 9))
        before = base(ids).logits
        adapted = peft.PeftModel.from_pretrained(base, adapter).eval()(ids).logits
        assert (adapted - before).abs().max() > 1e-3          # the adapters change something
        torch.testing.assert_close(adapted, load_model(run)(ids), rtol=1e-4, atol=atol)


def assert_the_command_generates_as_transformers(hf, out, command, capsys, pad_id):
    """`transduce import COMMAND` of the directory beside the import `out` ("hf"), then
    `transduce generate` from it: transformers' 8 greedy tokens after a prompt (as the
    command writes them, one line each: backslashes and line breaks escaped)."""
    from transduce import checkpoint
    from transduce.cli import main
    from transduce.cli.generate import one_line

    tokenizer = checkpoint.load_tokenizer(out)
    ids = tokenizer.encode(["In the beginning"])[0]
    with torch.no_grad():
        expected = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=8,
                               eos_token_id=None, pad_token_id=pad_id)[0, len(ids):]
    assert main(["import", command, str(out.parent / "hf"), "--out",
                 str(out.parent / "again"), "--force"]) == 0
    assert "decoder-only" in capsys.readouterr().out
    assert main(["generate", "--model", str(out.parent / "again"), "--prompt",
                 "In the beginning", "--max-new-tokens", "8", "--dtype", "float32"]) == 0
    written = capsys.readouterr().out.strip()
    assert written.endswith(one_line(tokenizer.decode(expected.tolist())).strip())


def assert_same_ctranslate2_tokens(hf, out, tmp_path, pad_id, first=()):
    """`export ct2` of the import `out`: a ctranslate2.Generator's 20 greedy tokens after
    `first` (BLOOM's bos) and 12 random ones are transformers', not one token repeated."""
    ctranslate2 = pytest.importorskip("ctranslate2")
    from transduce import checkpoint
    from transduce.export import export_ctranslate2

    exported = export_ctranslate2(out, tmp_path / "ct2")
    tokenizer = checkpoint.load_tokenizer(out)
    ids = [*first, *torch.randint(4, tokenizer.vocab_size, (12,),
                                  generator=torch.Generator().manual_seed(4)).tolist()]
    generator = ctranslate2.Generator(str(exported), device="cpu", intra_threads=1)
    found = generator.generate_batch([[tokenizer.piece(t) for t in ids]], max_length=20,
                                     sampling_topk=1, include_prompt_in_result=False,
                                     end_token=[])
    with torch.no_grad():
        expected = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=20,
                               eos_token_id=None, pad_token_id=pad_id)[0, len(ids):]
    assert found[0].sequences_ids[0] == expected.tolist()
    assert len(set(expected.tolist())) > 2          # (a random model repeats a token a while)
