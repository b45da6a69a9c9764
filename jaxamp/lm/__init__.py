"""The jaxamp LM application: a GPT-style Transformer LM (nanoGPT's architecture) trained on text or token files in
fp32, bf16, fp16 or fp8, built on the library (`jaxamp`) through its public names only.

| module | holds |
| --- | --- |
| `model` | the Flax linen Transformer LM (`TransformerLM`, `TransformerConfig`) and its float32 islands; `generate` |
| `presets` | model sizes (`--model small | gpt2-124m | gpt2-medium`) |
| `data` | text -> character tokens -> the batch at step s, a pure function of (seed, s) |
| `token_files` | nanoGPT's `train.bin`/`val.bin` token files (memmap) and `meta.pkl` |
| `bpe` | a byte-level BPE trained here with Hugging Face `tokenizers` |
| `corpus` | `--data`/`--tokenizer` -> the corpus a run trains on (`load_corpus`) |
| `config` | `TrainConfig` (every flag of `experiments/train_lm.py`), `validate`, what a resume must match |
| `setup` | `build(config) -> Run`: data, model, policy, loss scale, optimizer, state, jitted step |
| `train` | `train(config)`: the loop (steps, logs, evaluation, checkpoints, signals) |
| `resume` | resuming from the newest usable checkpoint, precision switches on resume |
| `workdir` | the run directory: its lock, summary.json, what to say when a write fails |
| `log` | printed lines and the host records of metrics.jsonl |
| `metrics_log` | metrics.jsonl and TensorBoard events |
| `stopping` | SIGTERM/SIGINT handling and the divergence guard |
| `plotting` | curves of one or more runs (`experiments/plot.py`) |
| `cli` | argparse helpers for the scripts in `experiments/` and `benchmarks/` |
"""
