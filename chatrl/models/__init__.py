"""The models: causal LMs, their tokenizers and LoRA (``causal_lm``), named and packaged models
(``model_zoo``), the reward model (``reward_model``), loading a model to train (``trainable``), the dtype
and float32 islands (``precision``) and tiny random models for tests (``tiny``)."""
