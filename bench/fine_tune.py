"""Fine-tuning speed of an imported BERT classifier: our training step and transformers'
BertForSequenceClassification, on the same weights and the same batches.

A WordPiece vocabulary (--vocab pieces, trained by `tokenizers` on the corpus's
training texts) and a BERT of bert-base's shape (--layers etc. to change it) built by
transformers from a random config are saved with save_pretrained and imported with
`transduce import hf-bert`. The batches are those `transduce train --init IMPORT --task
classify` steps through: our encoder batcher's, over --data (a classification corpus:
`transduce data bible-genre`), read with the import's own tokenizer, --max-tokens per
batch (padding counted). Each peer runs a fine-tuning step per batch: forward with
dropout, the mean cross entropy of the class logits, backward, fused Adam, in float32 and
under bfloat16 autocast (what `--dtype auto` picks where the CPU has bfloat16 units, and
transformers' `bf16=True`). Ours is the step of train/encoder.py (batch_losses, the
heads outside the layers); transformers' its model called with labels, as its Trainer
does. The peers alternate rounds of --steps batches, --repeats times; counted: real
(non-pad) tokens per second of the median round, and ours / transformers per dtype.

    python bench/fine_tune.py --data data/bible-genre [--max-tokens 2048] [--steps 4]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure import machine_info, time_interleaved  # noqa: E402
from transduce import checkpoint  # noqa: E402
from transduce.config import TrainConfig  # noqa: E402
from transduce.data.labelled import class_names, labelled_file, read_labelled  # noqa: E402
from transduce.importers import import_bert  # noqa: E402
from transduce.model import load_model  # noqa: E402
from transduce.train import encoder as encoder_training  # noqa: E402


def build_hf_model(args: argparse.Namespace, directory: Path, num_labels: int):
    """A WordPiece vocabulary trained on the corpus and a random
    BertForSequenceClassification of the asked shape, saved where our importer reads it."""
    import transformers
    from tokenizers import BertWordPieceTokenizer

    texts = read_labelled(labelled_file(args.data, "train")).texts
    wordpiece = BertWordPieceTokenizer(lowercase=False)
    wordpiece.train_from_iterator(texts, vocab_size=args.vocab, show_progress=False)
    directory.mkdir(parents=True)
    wordpiece.save_model(str(directory))
    tokenizer = transformers.BertTokenizerFast.from_pretrained(str(directory),
                                                               do_lower_case=False)
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(transformers.BertConfig(
        vocab_size=len(tokenizer), hidden_size=args.d_model, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, intermediate_size=args.d_ff,
        max_position_embeddings=512, num_labels=num_labels))
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return model


def our_step(model, optimizer, batches, dtype):
    """A round of our fine-tuning steps (train/encoder.py's losses)."""
    def run() -> None:
        for batch in batches:
            with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
                losses = encoder_training.batch_losses(model, model, batch)
            (losses.sums["classify"] / len(batch.labels)).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return run


def their_step(model, optimizer, batches, dtype, pad_id):
    """A round of transformers' steps: the model called with labels (mean cross entropy)."""
    def run() -> None:
        for batch in batches:
            with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
                loss = model(input_ids=batch.ids, attention_mask=(batch.ids != pad_id).long(),
                             labels=batch.labels).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return run


def adam(model):
    return torch.optim.Adam(model.parameters(), lr=1e-5, fused=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=Path("data/bible-genre"))
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--d-model", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--d-ff", type=int, default=3072)
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--max-tokens", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=4, help="batches per round")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--out", type=Path, default=Path("bench/results/fine-tune-cpu.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    names = class_names(args.data)

    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        hf = build_hf_model(args, scratch / "hf", len(names))
        imported = import_bert(scratch / "hf", scratch / "ours")
        model_config, _ = checkpoint.read_configs(imported)
        tokenizer = checkpoint.load_tokenizer(imported)
        _, batcher, _ = encoder_training.load_encoder_data(
            args.data, tokenizer, model_config,
            TrainConfig(task="classify", max_tokens=args.max_tokens))
        order = batcher.epoch_batches(0)
        batches = [batcher.collate(order[i], (0, i)) for i in range(args.steps)]
        tokens = sum(int((b.ids != tokenizer.pad_id).sum()) for b in batches)
        calls = {}
        for name in args.dtypes:
            dtype = getattr(torch, name)
            ours = load_model(imported).train()
            theirs = hf.__class__.from_pretrained(str(scratch / "hf")).train()
            calls[f"ours {name}"] = our_step(ours, adam(ours), batches, dtype)
            calls[f"transformers {name}"] = their_step(theirs, adam(theirs), batches, dtype,
                                                       tokenizer.pad_id)
        started = time.time()
        times = time_interleaved(calls, args.repeats)
    peers = {name: {"seconds": statistics.median(seconds), "all_seconds": seconds,
                    "tokens_per_s": tokens / statistics.median(seconds)}
             for name, seconds in times.items()}
    for name, peer in peers.items():
        print(f"{name}: {peer['tokens_per_s']:.0f} tokens/s")
    ratios = {f"ours / transformers, {name}": peers[f"ours {name}"]["tokens_per_s"]
              / peers[f"transformers {name}"]["tokens_per_s"] for name in args.dtypes}
    for name, ratio in ratios.items():
        print(f"{name}: {ratio:.2f}x")
    result = {"machine": machine_info(args.threads),
              "settings": vars(args) | {"out": str(args.out), "data": args.data.name},
              "tokens_per_round": tokens, "batches_per_round": len(batches),
              "peers": peers, "ratios": ratios, "seconds": time.time() - started}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
