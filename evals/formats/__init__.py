"""Weight-format benchmark: fp32, bf16 and int8 targets and drafts side by side."""
