"""Writing a checkpoint in other toolkits' formats: Hugging Face Marian or Pegasus (hf.py;
language models: hf_decoder.py, encoders: hf_encoder.py, NLLB and M2M-100 imports:
hf_nllb.py, T5's layout: hf_t5.py), CTranslate2 (ctranslate2.py; ctranslate2_decoder.py,
ctranslate2_encoder.py) and ONNX (onnx.py, imported on use), for all three shapes where
the format holds them; a LoRA run's adapters as PEFT's (peft.py). Each computes what our
model computes, and refuses, with the reason, a model it cannot express."""

from transduce.export.common import ExportError
from transduce.export.ctranslate2 import export_ctranslate2
from transduce.export.hf import export_hf, sines_first_permutation
from transduce.export.peft import export_peft

__all__ = ["ExportError", "export_hf", "export_ctranslate2", "export_peft",
           "sines_first_permutation"]
