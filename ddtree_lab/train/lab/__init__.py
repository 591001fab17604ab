"""Building the embedded lab pair: corpus, tokenizer, prompt sets, training and evaluation."""
