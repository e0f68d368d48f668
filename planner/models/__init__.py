"""Model families: each module maps a HF config to `ModelDims` and lists logical tensors."""
