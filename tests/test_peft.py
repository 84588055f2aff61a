"""PEFT's LoRA adapters. `export peft`: a LoRA run's adapters, put by PEFT itself on the
Hugging Face model the run started from, compute what the run's merged checkpoint computes
(Llama, and GPT-2, whose q, k, v adapters become one block-diagonal adapter of its fused
c_attn). `import peft`: an adapter PEFT made, merged into our import of its base model,
computes what PEFT's model computes; what a merge cannot compute is refused."""

import json
import re

import pytest
import torch
from safetensors.torch import save_file

from transduce import checkpoint
from transduce.cli import main
from transduce.config import TrainConfig, preset
from transduce.export import ExportError, export_peft
from transduce.importers import (ForeignCheckpointError, import_bert, import_bloom,
                                 import_deberta, import_distilbert, import_electra,
                                 import_gpt2, import_llama, import_modernbert, import_peft,
                                 import_roberta)
from transduce.model import load_model
from transduce.train.loop import train
from tests.train.test_encoder import VOCAB, bert_tiny, classes  # noqa: F401 - a fixture
from tests.train.test_encoder import train_config as encoder_config
from tests.train.test_imported_lm import write_gpt2, write_llama
from tests.train.test_lm import counting, gpt_tiny  # noqa: F401 - counting: a fixture
from tests.test_import_bloom import bloom_tokenizer  # noqa: F401 - a fixture
from tests.test_import_bloom import hf_checkpoint as write_bloom
from tests.train.test_answering import answering  # noqa: F401 - a fixture
from tests.train.test_tagging import TAGS, tagging  # noqa: F401 - tagging: a fixture

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")


def lora_run(hf_dir, importer, counting, tmp_path, targets):  # noqa: F811
    ours = importer(hf_dir, tmp_path / "ours")
    model_config, _ = checkpoint.read_configs(ours)
    run = tmp_path / "lora"
    train(counting, run, model_config,
          TrainConfig(max_steps=6, max_tokens=128, warmup_steps=2, lr_scale=3.0, dtype="float32",
                      lora_rank=3, lora_alpha=5.0, lora_targets=targets, lora_dropout=0.1,
                      eval_every=1000), init=ours)
    return run


# peft calls a transformers method that transformers 5 deprecates.
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated")
@pytest.mark.parametrize("family, targets", [("llama", "q,k,v,o,ffn"), ("gpt2", "q,v,o,ffn"),
                                             ("gpt2", "q,k,v")])
def test_peft_puts_the_adapters_where_the_run_had_them(family, targets, counting, tmp_path,
                                                       capsys):
    hf_dir = tmp_path / "hf"
    (write_llama if family == "llama" else write_gpt2)(hf_dir)
    run = lora_run(hf_dir, import_llama if family == "llama" else import_gpt2, counting,
                   tmp_path, targets)
    adapter = tmp_path / "adapter"
    assert main(["export", "peft", str(run), str(adapter)]) == 0
    assert "peft.PeftModel.from_pretrained" in capsys.readouterr().out
    settings = json.loads((adapter / "adapter_config.json").read_text())
    assert settings["r"] == 3 and settings["lora_alpha"] == pytest.approx(5.0)
    with torch.no_grad():
        base = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
        ids = torch.randint(3, base.config.vocab_size, (2, 9))
        before = base(ids).logits
        theirs = peft.PeftModel.from_pretrained(base, adapter).eval()
        adapted = theirs(ids).logits
        ours = load_model(run)(ids)
    assert (adapted - before).abs().max() > 1e-3          # the adapters change something
    torch.testing.assert_close(adapted, ours, rtol=1e-4, atol=1e-4)
    # Every adapter landed: PEFT warns of none missing, and its merged weights are ours.
    merged = theirs.merge_and_unload().state_dict()
    mine = load_model(run).state_dict()
    if family == "llama":
        torch.testing.assert_close(merged["model.layers.1.mlp.up_proj.weight"],
                                   mine["decoder.layers.1.ffn.linear3.weight"])
    else:
        fused = torch.cat([mine[f"decoder.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"])
        torch.testing.assert_close(merged["transformer.h.0.attn.c_attn.weight"], fused.T)


def bloom_rows(q, k, v, heads):
    """BLOOM's query_key_value rows from ours: (H, 3, D) head by head."""
    return torch.stack([q, k, v]).unflatten(1, (heads, -1)).transpose(0, 1).flatten(0, 2)


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated")
def test_blooms_adapters_go_to_peft(bloom_tokenizer, counting, tmp_path, capsys):  # noqa: F811
    """A LoRA run on an imported BLOOM: PEFT puts q, k and v's adapters on
    query_key_value, head by head, and computes the run's logits."""
    hf_dir, adapter = tmp_path / "hf", tmp_path / "adapter"
    write_bloom(hf_dir, bloom_tokenizer, hidden_size=32, n_layer=2, n_head=4, seed=6)
    run = lora_run(hf_dir, import_bloom, counting, tmp_path, "q,k,v,o,ffn")
    assert main(["export", "peft", str(run), str(adapter)]) == 0
    capsys.readouterr()
    settings = json.loads((adapter / "adapter_config.json").read_text())
    assert settings["rank_pattern"] == {"query_key_value": 9}
    assert settings["alpha_pattern"] == {"query_key_value": pytest.approx(15.0)}
    assert not settings["fan_in_fan_out"]
    with torch.no_grad():
        base = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
        ids = torch.randint(4, base.config.vocab_size, (2, 9))
        before = base(ids).logits
        theirs = peft.PeftModel.from_pretrained(base, adapter).eval()
        adapted = theirs(ids).logits
        ours = load_model(run)
        assert (adapted - before).abs().max() > 1e-3
        torch.testing.assert_close(adapted, ours(ids), rtol=1e-4, atol=1e-4)
        merged = theirs.merge_and_unload().state_dict()
    mine = ours.state_dict()
    fused = bloom_rows(*(mine[f"decoder.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"), 4)
    torch.testing.assert_close(merged["transformer.h.1.self_attention.query_key_value.weight"],
                               fused)


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated")
def test_a_peft_adapter_merges_into_our_bloom(bloom_tokenizer, tmp_path):  # noqa: F811
    """PEFT's LoRA on BLOOM's query_key_value (rank 2 there), dense and MLP: merged into
    our import, the model computes PEFT's logits."""
    hf_dir, adapter = tmp_path / "hf", tmp_path / "adapter"
    write_bloom(hf_dir, bloom_tokenizer, hidden_size=48, n_layer=2, n_head=6, seed=1)
    config = peft.LoraConfig(r=4, lora_alpha=8, task_type="CAUSAL_LM",
                             target_modules=["query_key_value", "dense", "dense_h_to_4h",
                                             "dense_4h_to_h"],
                             rank_pattern={"query_key_value": 2})
    theirs = with_drawn_adapters(transformers.AutoModelForCausalLM.from_pretrained(hf_dir),
                                 config, adapter)
    ours = import_bloom(hf_dir, tmp_path / "ours")
    merged = load_model(import_peft(adapter, ours, tmp_path / "merged"))
    ids = torch.randint(4, theirs.config.vocab_size, (2, 9))
    with torch.no_grad():
        expected = theirs(ids).logits
        torch.testing.assert_close(merged(ids), expected, rtol=1e-4, atol=1e-4)
        assert (load_model(ours)(ids) - expected).abs().max() > 1e-3


def test_refusals(counting, tmp_path):  # noqa: F811
    hf_dir = tmp_path / "hf"
    write_llama(hf_dir)
    ours = import_llama(hf_dir, tmp_path / "ours")
    with pytest.raises(ExportError, match="not a LoRA run's checkpoint"):
        export_peft(ours, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert main(["export", "peft", str(ours), str(tmp_path / "out")]) == 1
    # A base that `export hf` cannot write has no Hugging Face model to put adapters on.
    base, run = tmp_path / "scaled", tmp_path / "lora"
    config = gpt_tiny(scale_embeddings=True)
    train(counting, base, config, TrainConfig(max_steps=1, max_tokens=128))
    train(counting, run, config, TrainConfig(max_steps=1, max_tokens=128, lora_rank=2),
          init=base)
    with pytest.raises(ExportError, match=r"cannot export to GPT-2: scale_embeddings=True"):
        export_peft(run, tmp_path / "out")


def peft_adapter(hf_dir, adapter, family, **settings):
    """A PEFT LoRA adapter made by PEFT on the Hugging Face model, B drawn (not zero)."""
    base = transformers.AutoModelForCausalLM.from_pretrained(hf_dir)
    modules = {"llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                         "down_proj"],
               "phi3": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],   # fused
               "gpt2": ["c_attn", "c_proj", "c_fc"]}[family]
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=modules, task_type="CAUSAL_LM",
                             fan_in_fan_out=family == "gpt2", **settings)
    return with_drawn_adapters(base, config, adapter)


def with_drawn_adapters(base, config, adapter):
    """PEFT's model of `base` with the adapters of `config`, B drawn (not zero, so that
    they change something), saved at `adapter`."""
    model = peft.get_peft_model(base, config)
    torch.manual_seed(2)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(std=0.05)
    model.save_pretrained(adapter)
    return model.eval()


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated")
@pytest.mark.filterwarnings("ignore:fan_in_fan_out is set to True")
@pytest.mark.parametrize("family, settings", [
    ("llama", {}), ("llama", {"use_rslora": True, "rank_pattern": {"down_proj": 2},
                              "alpha_pattern": {"q_proj": 3}}),
    ("gpt2", {"rank_pattern": {"c_fc": 2}}),
    ("phi3", {"rank_pattern": {"gate_up_proj": 2}})])
def test_a_peft_adapter_merges_into_our_import(family, settings, tmp_path, capsys):
    hf_dir, adapter = tmp_path / "hf", tmp_path / "adapter"
    (write_gpt2 if family == "gpt2" else write_llama)(hf_dir, **(
        {"model_type": "phi3"} if family == "phi3" else {}))
    theirs = peft_adapter(hf_dir, adapter, family, **settings)
    ours = (import_gpt2 if family == "gpt2" else import_llama)(hf_dir, tmp_path / "ours")
    out = tmp_path / "merged"
    assert main(["import", "peft", str(adapter), "--base", str(ours), "--out", str(out)]) == 0
    assert f"{adapter} merged into {ours}" in capsys.readouterr().out
    ids = torch.randint(3, theirs.config.vocab_size, (2, 9))
    with torch.no_grad():
        expected = theirs(ids).logits
        torch.testing.assert_close(load_model(out)(ids), expected, rtol=1e-4, atol=1e-4)
        assert (load_model(ours)(ids) - expected).abs().max() > 1e-3    # the adapter counts
    assert checkpoint.load_tokenizer(out).vocab_size == checkpoint.load_tokenizer(ours).vocab_size


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated")
@pytest.mark.filterwarnings("ignore:fan_in_fan_out is set to True")
@pytest.mark.parametrize("family, tied, targets", [
    ("llama", False, ["q_proj", "lm_head", "embed_tokens"]),
    ("llama", True, ["q_proj", "lm_head", "embed_tokens"]),
    ("llama", True, ["embed_tokens"]),
    ("gpt2", True, ["c_attn", "lm_head", "wte"]),
    ("gpt2", True, ["c_attn"])])
def test_an_adapter_on_the_vocabulary_matrices_merges_untied(family, tied, targets, tmp_path):
    """LoRA on lm_head (a Linear) and on the token embedding (A (r, V), B (d, r)): the
    merge computes PEFT's model; a tied base comes out untied, each side with its own
    update, as PEFT computes them."""
    hf_dir, adapter = tmp_path / "hf", tmp_path / "adapter"
    (write_llama if family == "llama" else write_gpt2)(hf_dir)
    if tied and family == "llama":          # as SmolLM2, Qwen2.5 0.5B and Llama 3.2 1B
        untied = transformers.AutoModelForCausalLM.from_pretrained(hf_dir)
        untied.config.tie_word_embeddings = True
        untied.lm_head.weight = untied.model.embed_tokens.weight
        untied.save_pretrained(hf_dir)
    base = transformers.AutoModelForCausalLM.from_pretrained(hf_dir)
    assert (base.lm_head.weight is base.get_input_embeddings().weight) == tied
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets,
                             fan_in_fan_out=family == "gpt2")
    theirs = with_drawn_adapters(base, config, adapter)
    ours = (import_llama if family == "llama" else import_gpt2)(hf_dir, tmp_path / "ours")
    merged = load_model(import_peft(adapter, ours, tmp_path / "merged"))
    ids = torch.randint(3, theirs.config.vocab_size, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(merged(ids), theirs(ids).logits, rtol=1e-4, atol=1e-4)
    untied = not tied or bool({"lm_head", "embed_tokens", "wte"} & set(targets))
    assert (merged.output_proj.weight is not merged.decoder.embed.embedding.weight) == untied
    assert checkpoint.read_configs(tmp_path / "merged")[0].tie_embeddings == \
        ("none" if untied else "all")


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated")
@pytest.mark.filterwarnings("ignore:fan_in_fan_out is set to True")
@pytest.mark.parametrize("family, trained", [("llama", ["lm_head", "embed_tokens"]),
                                             ("gpt2", ["lm_head"]), ("gpt2", ["wte"])])
def test_vocabulary_matrices_trained_whole_replace_the_base_s(family, trained, tmp_path):
    """modules_to_save on a language model's lm_head or token embedding: the trained
    copies replace the base's matrices (GPT-2's tied ones come out untied)."""
    hf_dir, adapter = tmp_path / "hf", tmp_path / "adapter"
    (write_llama if family == "llama" else write_gpt2)(hf_dir)
    base = transformers.AutoModelForCausalLM.from_pretrained(hf_dir)
    config = peft.LoraConfig(r=4, lora_alpha=8, modules_to_save=trained,
                             target_modules=["q_proj"] if family == "llama" else ["c_attn"],
                             fan_in_fan_out=family == "gpt2")
    model = peft.get_peft_model(base, config)
    torch.manual_seed(3)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "modules_to_save" in name or "lora_B" in name:
                parameter.add_(torch.randn_like(parameter) * 0.05)
    model.save_pretrained(adapter)
    ours = (import_llama if family == "llama" else import_gpt2)(hf_dir, tmp_path / "ours")
    merged = load_model(import_peft(adapter, ours, tmp_path / "merged"))
    ids = torch.randint(3, base.config.vocab_size, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(merged(ids), model.eval()(ids).logits, rtol=1e-4, atol=1e-4)
    assert merged.output_proj.weight is not merged.decoder.embed.embedding.weight


def test_a_vocabulary_of_another_size_is_refused_by_name(tmp_path):
    ours, adapter = handmade(tmp_path, {"target_modules": ["lm_head"]}, {
        "base_model.model.lm_head.base_layer.weight": torch.zeros(310, 32),
        "base_model.model.lm_head.lora_A.weight": torch.zeros(2, 32),
        "base_model.model.lm_head.lora_B.weight": torch.zeros(310, 2)})
    with pytest.raises(ForeignCheckpointError, match=r"lm_head's saved weight has shape "
                                                     r"\(310, 32\), the base's \(\d+, 32\) "
                                                     r"\(a vocabulary of 310 tokens"):
        import_peft(adapter, ours, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated")
def test_export_and_import_are_inverse(counting, tmp_path):  # noqa: F811
    """A LoRA run's adapters exported, then merged into the base again: the run's model."""
    hf_dir = tmp_path / "hf"
    write_gpt2(hf_dir)
    run = lora_run(hf_dir, import_gpt2, counting, tmp_path, "q,k,o")
    export_peft(run, tmp_path / "adapter")
    base = checkpoint.read_lora_section(checkpoint.resolve(run))["base"]
    out = import_peft(tmp_path / "adapter", base, tmp_path / "merged")
    a, b = load_model(out).state_dict(), load_model(run).state_dict()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6)


def handmade(tmp_path, settings, tensors=None):
    """Our import of a random Llama, and an adapter directory written by hand for it."""
    hf_dir, adapter = tmp_path / "hf", tmp_path / "adapter"
    write_llama(hf_dir)
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 2, "lora_alpha": 2, "target_modules": ["q_proj"],
         **settings}))
    if tensors is not None:
        save_file(tensors, str(adapter / "adapter_model.safetensors"))
    return import_llama(hf_dir, tmp_path / "ours"), adapter


@pytest.mark.parametrize("change, message", [
    ({"use_dora": True}, "use_dora=true is not supported"),
    ({"bias": "all"}, 'bias="all" is not supported'),
    ({"modules_to_save": ["norm"]}, "modules_to_save="),
    ({"peft_type": "IA3"}, "peft_type='IA3'; only LoRA adapters"),
    ({"r": 0}, "r must be a positive number")])
def test_what_a_merge_cannot_compute_is_refused(change, message, tmp_path):
    ours, adapter = handmade(tmp_path, change)
    with pytest.raises(ForeignCheckpointError, match=re.escape(message)):
        import_peft(adapter, ours, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_an_adapter_on_a_module_we_do_not_adapt_is_refused(tmp_path):
    ours, adapter = handmade(tmp_path, {"target_modules": ["norm"]}, {
        "base_model.model.model.norm.lora_A.weight": torch.zeros(2, 32),
        "base_model.model.model.norm.lora_B.weight": torch.zeros(32, 2)})
    with pytest.raises(ForeignCheckpointError, match="an adapter on model.norm, which is not "
                                                     "an attention or feed-forward matrix"):
        import_peft(adapter, ours, tmp_path / "out")
    (adapter / "adapter_model.safetensors").unlink()
    with pytest.raises(ForeignCheckpointError, match="no adapter_model.safetensors"):
        import_peft(adapter, ours, tmp_path / "out")


def test_an_update_of_another_shape_is_refused(tmp_path):
    module = "base_model.model.model.layers.0.self_attn.q_proj"
    ours, adapter = handmade(tmp_path, {}, {f"{module}.lora_A.weight": torch.zeros(2, 32),
                                            f"{module}.lora_B.weight": torch.zeros(16, 2)})
    with pytest.raises(ForeignCheckpointError, match=r"q_proj's update has shape \(16, 32\), "
                                                     r"the base's weight \(32, 32\)"):
        import_peft(adapter, ours, tmp_path / "out")


# Our encoder exports as BERT with two segment types, RoBERTa with one, DistilBERT with
# none (whose pooler has ReLU), ELECTRA with a GELU after its pooler, ModernBERT with its
# prediction head, DeBERTa-v3 (model_type deberta-v2) with disentangled positions.
ENCODER_FAMILIES = [(2, "bert"), (1, "roberta"), (0, "distilbert"), (2, "electra"),
                    (0, "modernbert"), (0, "deberta-v2")]
POOLERS = {"distilbert": "relu", "electra": "gelu"}      # the others': tanh
# Each family's modules_to_save in a sequence classifier's adapter (BERT's: its own).
CLASSIFIER_MODULES = {"bert": ["classifier", "pooler"],
                      "distilbert": ["pre_classifier", "classifier"],
                      "modernbert": ["head", "classifier"],
                      "deberta-v2": ["pooler", "classifier"]}


def encoder_of(segments, family="bert", **changes):
    if family in ("modernbert", "deberta-v2"):   # ModernBERT's Wqkv and Wi fused: q, k,
        return preset(f"{family.removesuffix('-v2')}-tiny",       # v and linear1, linear3
                      src_vocab_size=VOCAB, tgt_vocab_size=VOCAB, **changes)
    return bert_tiny(type_vocab_size=segments, activation="gelu",
                     pooler_activation=POOLERS.get(family, "tanh"), **changes)


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated")
@pytest.mark.parametrize("segments, family", ENCODER_FAMILIES)
def test_an_encoders_adapters_and_new_head(segments, family, classes,  # noqa: F811
                                           counting, tmp_path, capsys):  # noqa: F811
    """A classifier fine-tuned with adapters: PEFT puts them, and the head and pooler
    trained whole (modules_to_save), on the sequence classifier transformers builds from
    the export of the pre-trained encoder, and gets the run's logits."""
    pretrained, run, base_dir = tmp_path / "pre", tmp_path / "run", tmp_path / "base-hf"
    train(counting, pretrained, encoder_of(segments, family), encoder_config(max_steps=6))
    train(classes, run, encoder_of(segments, family, num_labels=3),
          encoder_config(max_steps=6, task="classify", lora_rank=4, lr_scale=1.0),
          init=pretrained)
    assert main(["export", "hf", str(pretrained), str(base_dir)]) == 0
    assert main(["export", "peft", str(run), str(tmp_path / "adapter")]) == 0
    capsys.readouterr()
    settings = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert settings["task_type"] == "SEQ_CLS" and not settings["fan_in_fan_out"]
    assert settings["modules_to_save"] == CLASSIFIER_MODULES.get(family, ["classifier"])
    if family == "modernbert":
        assert (settings["rank_pattern"], settings["alpha_pattern"]) == \
            ({"Wqkv": 12, "Wi": 8}, {"Wqkv": 12 * settings["lora_alpha"] / 4,
                                      "Wi": 8 * settings["lora_alpha"] / 4})
    ours = load_model(run)
    ids = torch.randint(5, 300, (2, 7))
    with torch.no_grad():
        base = transformers.AutoModelForSequenceClassification.from_pretrained(base_dir,
                                                                               num_labels=3)
        assert base.config.model_type == family
        theirs = peft.PeftModel.from_pretrained(base.eval(), tmp_path / "adapter").eval()
        logits = theirs(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
        expected = ours.eval().classify_logits(ours.pool(ours(ids)))
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)


BERT_TARGETS = ["query", "key", "value", "attention.output.dense", "intermediate.dense",
                "output.dense"]


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated")
@pytest.mark.parametrize("segments, family", ENCODER_FAMILIES)
def test_a_peft_classifier_merges_into_our_encoder(segments, family, counting,  # noqa: F811
                                                   tmp_path):
    """PEFT's own sequence-classification adapter (LoRA on every matrix, the head and
    pooler trained whole) on a BERT or RoBERTa, merged into our import of that model,
    which had no classifier: the classifier's logits are PEFT's."""
    pretrained, hf_dir, adapter = tmp_path / "pre", tmp_path / "hf", tmp_path / "adapter"
    train(counting, pretrained, encoder_of(segments, family), encoder_config(max_steps=2))
    assert main(["export", "hf", str(pretrained), str(hf_dir)]) == 0
    importer = {"bert": import_bert, "roberta": import_roberta,
                "distilbert": import_distilbert, "electra": import_electra,
                "modernbert": import_modernbert, "deberta-v2": import_deberta}[family]
    ours = importer(hf_dir, tmp_path / "ours")
    base = transformers.AutoModelForSequenceClassification.from_pretrained(hf_dir, num_labels=3)
    targets, whole = {
        "distilbert": (["q_lin", "k_lin", "v_lin", "out_lin", "lin1", "lin2"],
                       ["pre_classifier", "classifier"]),
        "roberta": (BERT_TARGETS, ["classifier"]),
        "electra": (BERT_TARGETS, ["classifier"]),
        "modernbert": (["Wqkv", "Wo", "Wi"], CLASSIFIER_MODULES["modernbert"]),
        "deberta-v2": (["query_proj", "key_proj", "value_proj", "attention.output.dense",
                        "intermediate.dense", "output.dense"], ["pooler", "classifier"]),
    }.get(family, (BERT_TARGETS, ["classifier", "pooler"]))
    theirs = peft.get_peft_model(base, peft.LoraConfig(      # which extends modules_to_save
        r=4, lora_alpha=8, task_type="SEQ_CLS", target_modules=targets,
        modules_to_save=list(whole)))
    torch.manual_seed(3)
    with torch.no_grad():
        for name, parameter in theirs.named_parameters():
            if "lora_B" in name or "modules_to_save" in name:
                parameter.normal_(std=0.2)
    theirs.save_pretrained(adapter)
    out = import_peft(adapter, ours, tmp_path / "merged")
    merged = load_model(out)
    assert merged.config.num_labels == 3 and merged.labels == ["LABEL_0", "LABEL_1", "LABEL_2"]
    ids = torch.randint(5, 300, (2, 7))
    with torch.no_grad():
        expected = theirs.eval()(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
        got = merged.classify_logits(merged.pool(merged(ids)))
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated")
@pytest.mark.parametrize("segments, family", [(2, "bert"), (0, "modernbert")])
def test_a_taggers_adapters_go_to_peft_and_come_back(segments, family, tagging,  # noqa: F811
                                                     counting, tmp_path, capsys):  # noqa: F811
    """A token classifier fine-tuned with adapters: PEFT puts them and the head trained
    whole (TOKEN_CLS; ModernBERT's head too) on transformers' BertForTokenClassification
    (ModernBertForTokenClassification) of the pre-trained encoder's export and gets the run's logits; the adapter imported back into our
    import of that encoder is a token classifier again, with the same logits."""
    pretrained, run, base_dir = tmp_path / "pre", tmp_path / "run", tmp_path / "base-hf"
    train(counting, pretrained, encoder_of(segments, family), encoder_config(max_steps=4))
    train(tagging, run, encoder_of(segments, family, num_labels=len(TAGS),
                                   token_classifier=True),
          encoder_config(max_steps=4, task="tag", lora_rank=4, lr_scale=1.0),
          init=pretrained)
    assert main(["export", "hf", str(pretrained), str(base_dir)]) == 0
    assert main(["export", "peft", str(run), str(tmp_path / "adapter")]) == 0
    capsys.readouterr()
    settings = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert settings["task_type"] == "TOKEN_CLS"
    assert settings["modules_to_save"] == (CLASSIFIER_MODULES["modernbert"]
                                           if family == "modernbert" else ["classifier"])
    ours = load_model(run).eval()
    if family == "modernbert":         # its head, under every task's, trained whole
        before = load_model(pretrained)
        for part in ("pooler", "pooler_norm"):
            assert not torch.equal(getattr(ours, part).weight, getattr(before, part).weight)
    ids = torch.randint(5, 300, (2, 19))          # longer than ModernBERT's window
    with torch.no_grad():
        base = transformers.AutoModelForTokenClassification.from_pretrained(
            base_dir, num_labels=len(TAGS))
        theirs = peft.PeftModel.from_pretrained(base.eval(), tmp_path / "adapter").eval()
        logits = theirs(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
        torch.testing.assert_close(logits, ours.tag_logits(ours(ids)), rtol=1e-4, atol=1e-4)
        importer = import_modernbert if family == "modernbert" else import_bert
        merged = load_model(import_peft(tmp_path / "adapter", importer(
            base_dir, tmp_path / "ours"), tmp_path / "merged"))
        assert merged.config.token_classifier and merged.config.num_labels == len(TAGS)
        torch.testing.assert_close(merged.tag_logits(merged(ids)), logits, rtol=1e-4,
                                   atol=1e-4)


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated")
@pytest.mark.parametrize("segments, family", [(2, "bert"), (0, "modernbert")])
def test_an_answerers_adapters_go_to_peft_and_come_back(segments, family,
                                                       answering, counting,  # noqa: F811
                                                       tmp_path, capsys):
    """A question answerer fine-tuned with adapters: PEFT puts them and qa_outputs
    trained whole (QUESTION_ANS; ModernBERT's head and classifier) on transformers'
    BertForQuestionAnswering (ModernBertForQuestionAnswering) of the pre-trained
    encoder's export and gets the run's start and end logits; imported back
    into our import of that encoder, it answers again, with the same logits."""
    pretrained, run, base_dir = tmp_path / "pre", tmp_path / "run", tmp_path / "base-hf"
    train(counting, pretrained, encoder_of(segments, family), encoder_config(max_steps=4))
    train(answering, run, encoder_of(segments, family, num_labels=2,
                                     question_answering=True),
          encoder_config(max_steps=4, task="answer", lora_rank=4, lr_scale=1.0),
          init=pretrained)
    assert main(["export", "hf", str(pretrained), str(base_dir)]) == 0
    assert main(["export", "peft", str(run), str(tmp_path / "adapter")]) == 0
    capsys.readouterr()
    settings = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert settings["task_type"] == "QUESTION_ANS"
    assert settings["modules_to_save"] == (CLASSIFIER_MODULES["modernbert"]
                                           if family == "modernbert" else ["qa_outputs"])
    ours = load_model(run).eval()
    ids = torch.randint(5, 300, (2, 19))          # longer than ModernBERT's window
    with torch.no_grad():
        base = transformers.AutoModelForQuestionAnswering.from_pretrained(base_dir)
        theirs = peft.PeftModel.from_pretrained(base.eval(), tmp_path / "adapter").eval()
        result = theirs(input_ids=ids, attention_mask=torch.ones_like(ids))
        logits = torch.stack([result.start_logits, result.end_logits], dim=-1)
        torch.testing.assert_close(logits, ours.span_logits(ours(ids)), rtol=1e-4, atol=1e-4)
        importer = import_modernbert if family == "modernbert" else import_bert
        merged = load_model(import_peft(tmp_path / "adapter", importer(
            base_dir, tmp_path / "ours"), tmp_path / "merged"))
        assert merged.config.question_answering and merged.labels == ["start", "end"]
        torch.testing.assert_close(merged.span_logits(merged(ids)), logits, rtol=1e-4,
                                   atol=1e-4)
