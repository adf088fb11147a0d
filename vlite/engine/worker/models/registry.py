"""The model architectures vlite runs (Hugging Face ``config.architectures`` names); all share
the Llama layer stack (``llama.LlamaForCausalLM``)."""

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
