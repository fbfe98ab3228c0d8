"""A causal-LM fine-tuning demo over any Hugging Face causal LM and text that is on every machine."""
