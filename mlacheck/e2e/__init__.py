"""A small in-process DeepSeek-V3-architecture model whose attention runs through any
mlacheck backend: the end-to-end half of the accuracy gate, on GSM8K-format problems
(docs/e2e.md).

* `config`: the model configuration (transformers' DeepseekV3 keys);
* `model`: the model (transformers' parameter layout), dense MHA forward for training;
* `runner`: greedy batch generation, attention as mlacheck cases (MHA prefill, absorbed
  decode over a paged latent cache) run by a backend;
* `checkpoint`: load / save the Hugging Face layout (safetensors, sharded, FP8 blocks);
* `tokenizer`, `problems` (GSM8K-format arithmetic problems), `evaluate`;
* `lm`: `MLACheckLM`, the runner as an lm-eval model (imports lm-eval; nothing else here does).

`python -m mlacheck.e2e data|eval|gate ...` drives it from the command line.
"""
