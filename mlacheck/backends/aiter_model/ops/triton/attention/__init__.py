"""Model of `aiter.ops.triton.attention`: fp8_mqa_logits, pa_mqa_logits."""
