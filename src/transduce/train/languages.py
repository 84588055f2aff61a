"""Fine-tuning a multilingual model (an NLLB import) on a corpus of one language pair.

Its pairs are given their languages as translation gives them (decode/languages.py):
the source's code before each source, the target's after bos, not scored
(data/batching.py). The codes are the model's; the pair is the run's
(TrainConfig.source_lang and target_lang), which its checkpoints record as their
default pair, so that they translate it without being told.
"""

from __future__ import annotations

from transduce.config import ConfigError, TrainConfig
from transduce.decode.languages import Direction, direction


def training_direction(codes: dict[str, int] | None, c: TrainConfig) -> Direction:
    """The tokens each pair is given: none for a model of one pair; for a multilingual
    one (codes), those of the pair the run names, which it must."""
    if not codes:
        if c.source_lang:
            raise ConfigError(f"TrainConfig.source_lang={c.source_lang!r}: language codes "
                              f"name a multilingual model's languages (an NLLB import given "
                              f"with --init); this model has none")
        return Direction()
    if not c.source_lang:
        raise ConfigError(f"the model is multilingual ({len(codes)} language codes): name "
                          f"the corpus's languages with --source-lang and --target-lang "
                          f"(such as {', '.join(sorted(codes)[:3])})")
    if c.pack_length:
        raise ConfigError(f"TrainConfig.pack_length={c.pack_length}: a multilingual model's "
                          f"pairs are given their language codes one pair a row; train it "
                          f"unpacked (--pack-length 0)")
    return direction(codes, None, c.source_lang, c.target_lang)
