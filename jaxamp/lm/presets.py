"""Named model sizes (``--model``), as nanoGPT sets them.

``small`` is nanoGPT's shakespeare_char CPU recipe (the experiment's default). ``gpt2-124m`` is what nanoGPT's
``config/train_gpt2.py`` trains (its ``train.py`` defaults: 12 layers, 12 heads, width 768, ``block_size`` 1024) and
``gpt2-medium`` the 350M model of ``GPT.from_pretrained`` (24 layers, 16 heads, width 1024), ``gpt2-xl`` its 1.5B
model (48 layers, 25 heads, width 1600: 1,556,840,000 parameters at vocab 50304 without biases, the experiment's
default, 1,555,201,600 of them without the position table; with ``--bias`` 1,557,686,400). A preset sets the
shape only; explicit ``--layers``/``--heads``/``--width``/``--seq-len`` override it, and the optimizer settings are
the experiment's own flags (README: "Coming from nanoGPT").

``vocab_size`` is the vocabulary where the data sets none: token files without ``meta.pkl`` and the throughput
benchmark's random tokens. It is GPT-2's 50257 BPE ids padded to 50304, a multiple of 64, as nanoGPT does.
"""

from __future__ import annotations

from jaxamp.lm.token_files import GPT2_VOCAB_SIZE

__all__ = ["MODEL_PRESETS", "PRESET_FIELDS"]

PRESET_FIELDS = ("layers", "heads", "width", "seq_len")  # what a preset sets (besides vocab_size)
MODEL_PRESETS = {  # name -> layers (blocks), heads, width (channels), seq_len (tokens), vocab_size (ids)
    "small": dict(layers=4, heads=4, width=128, seq_len=64, vocab_size=GPT2_VOCAB_SIZE),
    "gpt2-124m": dict(layers=12, heads=12, width=768, seq_len=1024, vocab_size=GPT2_VOCAB_SIZE),
    "gpt2-medium": dict(layers=24, heads=16, width=1024, seq_len=1024, vocab_size=GPT2_VOCAB_SIZE),
    "gpt2-xl": dict(layers=48, heads=25, width=1600, seq_len=1024, vocab_size=GPT2_VOCAB_SIZE),
}
