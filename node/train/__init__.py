"""Training without the network: the model cut into stages, the data and its sample schedule,
the optimizer every stage applies, Hugging Face checkpoint loading, and single-process training."""
