"""What the tests of the heads over each token (token classification, question
answering) share: a random transformers model of each encoder family with that head,
saved with its tokenizer and imported."""

import shutil

import pytest
import torch

from transduce.importers import import_bert, import_distilbert, import_electra, \
    import_modernbert, import_roberta

transformers = pytest.importorskip("transformers")

IMPORTERS = {"bert": import_bert, "distilbert": import_distilbert, "roberta": import_roberta,
             "electra": import_electra, "modernbert": import_modernbert}
CLASSES = {"bert": "Bert", "distilbert": "DistilBert", "roberta": "Roberta",
           "electra": "Electra", "modernbert": "ModernBert"}
SEGMENTED = ("bert", "electra")      # the families that read segment (token type) ids


def family_config(family: str, positions: int, vocab_size: int, **settings):
    """A small config of the family whose model reads `positions` tokens."""
    if family == "distilbert":
        return transformers.DistilBertConfig(
            vocab_size=vocab_size, dim=32, n_layers=2, n_heads=2, hidden_dim=48,
            max_position_embeddings=positions, **settings)
    sizes = dict(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2,
                 num_attention_heads=2, intermediate_size=48, **settings)
    if family == "roberta":      # positions count from pad + 1 = 2
        return transformers.RobertaConfig(max_position_embeddings=positions + 2,
                                          type_vocab_size=1, pad_token_id=1, bos_token_id=0,
                                          eos_token_id=2, **sizes)
    if family == "modernbert":   # a full layer, then one sliding over 4 tokens each side
        return transformers.ModernBertConfig(
            max_position_embeddings=positions, local_attention=8, pad_token_id=0,
            cls_token_id=2, bos_token_id=2, sep_token_id=3, eos_token_id=3, **sizes)
    if family == "electra":      # embeddings half as wide as the layers (electra-small's)
        return transformers.ElectraConfig(max_position_embeddings=positions,
                                          embedding_size=16, **sizes)
    return transformers.BertConfig(max_position_embeddings=positions, **sizes)


def imported_head(family: str, task: str, root, tokenizer_dir, positions: int, **settings):
    """transformers' {family}For{task} (random: initializer_range 0.5), saved with the
    tokenizer in tokenizer_dir and imported -> (model, its fast tokenizer, our path)."""
    fast = transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir))
    torch.manual_seed(0)
    config = family_config(family, positions, len(fast), initializer_range=0.5, **settings)
    hf = getattr(transformers, f"{CLASSES[family]}For{task}")(config).eval()
    hf.save_pretrained(root / "hf")
    for file in tokenizer_dir.iterdir():
        shutil.copy(file, root / "hf")
    return hf, fast, IMPORTERS[family](root / "hf", root / "ours")
