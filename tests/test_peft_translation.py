"""PEFT's LoRA adapters of encoder-decoders, both ways, on each model `export hf` writes:
Pegasus (our own pre-norm model), Marian (post-norm; both permute the model dimension),
NLLB (M2M100) and T5 (relu and gated, its queries scaled). `export peft`: a LoRA run's
adapters, put by PEFT on the export of the run's base, give the export of the run's
model, and merge back into the base as the run's weights. `import peft`: an adapter PEFT
made on the export of our base, merged into the base, gives what PEFT's model gives."""

import json
import warnings

import pytest
import torch

from transduce import checkpoint
from transduce.cli import main
from transduce.config import preset
from transduce.data.tokenizer import MODEL_NAME
from transduce.export import ExportError, export_peft
from transduce.importers import (ForeignCheckpointError, import_marian, import_mbart,
                                 import_nllb, import_peft, import_t5)
from transduce.model import build_model, load_model
from tests.test_export import saved_model
from tests.test_import_marian import write_marian
from tests.test_import_mbart import write_mbart
from tests.test_import_nllb import write_nllb
from tests.test_import_t5 import write_t5
from tests.test_peft import with_drawn_adapters

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

FAMILIES = ("pegasus", "marian", "nllb", "mbart", "t5", "t5-gated")
# PEFT's target_modules: every matrix we adapt, by transformers' names.
TARGETS = {"bart": ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"],
           "t5": ["q", "k", "v", "o", "wi", "wi_0", "wi_1", "wo"]}


def base_checkpoint(family, tmp_path, tiny_corpus):
    """(our checkpoint of a small random model of `family`, a corpus it trains on, the
    options a run on it needs)."""
    if family == "pegasus":
        return saved_model(tmp_path, tiny_corpus, norm_first=True)[1], tiny_corpus, []
    if family == "marian":
        base = import_marian(write_marian(tmp_path / "hf")[0], tmp_path / "base")
    elif family == "nllb":
        base = import_nllb(write_nllb(tmp_path / "hf")[0], tmp_path / "base")
    elif family == "mbart":
        base = import_mbart(write_mbart(tmp_path / "hf")[0], tmp_path / "base")
    else:
        layout = "v1.1" if family == "t5-gated" else "t5"
        base = import_t5(write_t5(tmp_path / "hf", layout), tmp_path / "base")
    corpus = tmp_path / "corpus"       # read with the checkpoint's vocabulary
    corpus.mkdir()
    for file in tiny_corpus.iterdir():
        if file.is_file() and not file.name.startswith("spm."):
            (corpus / file.name).write_bytes(file.read_bytes())
    languages = {"nllb": ["--source-lang", "spa_Latn", "--target-lang", "eng_Latn"],
                 "mbart": ["--source-lang", "es_XX", "--target-lang", "en_XX"]}
    return base, corpus, languages.get(family, [])


def exported(path, out):
    assert main(["export", "hf", str(path), str(out)]) == 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.AutoModelForSeq2SeqLM.from_pretrained(out).eval()


def logits(model, vocab_size):
    torch.manual_seed(3)
    sources, targets = torch.randint(4, vocab_size, (2, 7)), torch.randint(4, vocab_size, (2, 5))
    with torch.no_grad():
        return model(input_ids=sources, attention_mask=torch.ones_like(sources),
                     decoder_input_ids=targets).logits


# peft calls a transformers method that transformers 5 deprecates; T5 v1.1's own lm_head
# is reported untied on a merge.
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated")
@pytest.mark.filterwarnings("ignore:Input and output embeddings are no longer tied")
@pytest.mark.parametrize("family", FAMILIES)
def test_export_peft_gives_the_runs_model(family, tmp_path, tiny_corpus, capsys):
    base, corpus, options = base_checkpoint(family, tmp_path, tiny_corpus)
    run, adapter = tmp_path / "lora", tmp_path / "adapter"
    assert main(["train", "--data", str(corpus), "--init", str(base), "--out", str(run),
                 "--max-steps", "4", "--eval-every", "4", "--save-every", "4", "--dtype",
                 "float32", "--lora-rank", "3", "--lora-alpha", "5", "--lr-scale", "30",
                 *options]) == 0
    assert main(["export", "peft", str(run), str(adapter)]) == 0
    assert "peft.PeftModel.from_pretrained" in capsys.readouterr().out
    settings = json.loads((adapter / "adapter_config.json").read_text())
    assert settings["task_type"] == "SEQ_2_SEQ_LM" and settings["r"] == 3
    theirs = exported(base, tmp_path / "base-hf")
    vocab_size = theirs.config.vocab_size
    before = logits(theirs, vocab_size)
    original = {name: tensor.clone() for name, tensor in theirs.state_dict().items()}
    theirs = peft.PeftModel.from_pretrained(theirs, adapter).eval()
    expected = exported(run, tmp_path / "run-hf")
    adapted = logits(theirs, vocab_size)
    assert (adapted - before).abs().max() > 1e-3           # the adapters change something
    torch.testing.assert_close(adapted, logits(expected, vocab_size), rtol=1e-4, atol=1e-4)
    # Every adapter landed (cross-attention's among them): PEFT's merge is the run's export.
    merged, wanted = theirs.merge_and_unload().state_dict(), expected.state_dict()
    changed = [name for name in wanted if not torch.equal(wanted[name], original[name])]
    assert any("EncDecAttention" in name or "encoder_attn" in name for name in changed)
    for name in wanted:
        torch.testing.assert_close(merged[name], wanted[name], rtol=1e-5, atol=1e-6, msg=name)
    # And merged into the base by `import peft`, the adapter gives the run's weights.
    lora_base = checkpoint.read_lora_section(checkpoint.resolve(run))["base"]
    again = load_model(import_peft(adapter, lora_base, tmp_path / "merged")).state_dict()
    for name, tensor in load_model(run).state_dict().items():
        torch.testing.assert_close(again[name], tensor, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated")
@pytest.mark.parametrize("family", FAMILIES)
def test_import_peft_merges_an_adapter_made_on_the_export(family, tmp_path, tiny_corpus,
                                                          capsys):
    base, _, _ = base_checkpoint(family, tmp_path, tiny_corpus)
    theirs, adapter = exported(base, tmp_path / "base-hf"), tmp_path / "adapter"
    names = TARGETS["t5" if family.startswith("t5") else "bart"]
    present = {name.rsplit(".", 1)[-1] for name, _ in theirs.named_modules()}
    config = peft.LoraConfig(r=4, lora_alpha=8, task_type="SEQ_2_SEQ_LM",
                             target_modules=[name for name in names if name in present],
                             rank_pattern={names[-1]: 2}, alpha_pattern={names[0]: 3})
    theirs = with_drawn_adapters(theirs, config, adapter)
    out = tmp_path / "merged"
    assert main(["import", "peft", str(adapter), "--base", str(base), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "(encoder-decoder: " in printed and f"{adapter} merged into {base}" in printed
    # PEFT's merge is the export of ours, weight for weight; so are the logits (PEFT's
    # unmerged model adds its updates in another order: 1.2e-4 apart on NLLB's 5.6).
    vocab_size = theirs.config.vocab_size
    theirs = theirs.merge_and_unload()
    merged = exported(out, tmp_path / "merged-hf")
    expected, found = theirs.state_dict(), merged.state_dict()
    for name in found:
        torch.testing.assert_close(found[name], expected[name], rtol=1e-5, atol=1e-6, msg=name)
    expected = logits(theirs, vocab_size)
    torch.testing.assert_close(logits(merged, vocab_size), expected, rtol=1e-4, atol=1e-4)
    unadapted = exported(base, tmp_path / "base-hf-again")
    assert (logits(unadapted, vocab_size) - expected).abs().max() > 1e-3   # the adapter counts


def test_what_no_export_holds_is_refused(tmp_path, tiny_corpus):
    """A run whose base `export hf` cannot write has no Hugging Face model to go on; an
    RNN has no layers to merge an adapter into."""
    base = saved_model(tmp_path, tiny_corpus, positional="learned")[1]
    run = tmp_path / "lora"
    assert main(["train", "--data", str(tiny_corpus), "--init", str(base), "--out", str(run),
                 "--max-steps", "1", "--eval-every", "1", "--lora-rank", "2"]) == 0
    with pytest.raises(ExportError, match="cannot export to Marian: positional='learned'"):
        export_peft(run, tmp_path / "adapter")
    assert not (tmp_path / "adapter").exists()
    rnn = checkpoint.save(tmp_path / "rnn", build_model(preset(
        "tiny", arch="rnn-bahdanau", src_vocab_size=300, tgt_vocab_size=300)), None,
        tiny_corpus / MODEL_NAME)
    adapter = tmp_path / "made"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 2, "lora_alpha": 2, "target_modules": ["q_proj"]}))
    with pytest.raises(ForeignCheckpointError, match="arch 'rnn-bahdanau'; a PEFT adapter is "
                                                     "merged into a Transformer"):
        import_peft(adapter, rnn, tmp_path / "out")
    assert not (tmp_path / "out").exists()
