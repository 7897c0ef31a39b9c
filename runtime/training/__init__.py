"""Training MTP heads for a model that has none (``specdecode train-mtp``): prompts, self-distillation
data from the model's own continuations, the training loop, and the command."""
