"""Tiny random models built with transformers at test time (no hub), plus a tiny BPE tokenizer."""

from __future__ import annotations

from pathlib import Path

CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "def square(x):\n    return x * x\n",
    "Paris is the capital of France. Berlin is the capital of Germany.",
    "你好，世界！ 北京是中国的首都。",
    "Emoji test: 😀 🚀 ✨ and numbers 1234567890.",
    "In the beginning the Universe was created. This has made a lot of people very angry.",
] * 20

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def make_tokenizer(out_dir: Path, vocab_size: int = 512):
    """Byte-level BPE trained on a small corpus; ChatML template; <|im_end|> is EOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", bos_token=None,
                                   unk_token=None, pad_token="<|endoftext|>")
    fast.chat_template = CHATML_TEMPLATE
    fast.save_pretrained(out_dir)
    return fast


def make_tiny_model(arch: str, out_dir: Path, dtype: str = "float32", seed: int = 0, weight_std: float = 0.2,
                    **overrides) -> Path:
    """Save a random tiny `arch` ('llama', 'mistral', 'qwen2', 'qwen3', 'qwen2_moe', 'qwen3_moe', 'mixtral', 'granite',
    'phi3', 'gemma', 'gemma2', 'gemma3', 'gemma3-multimodal', 'smollm3') model with a tokenizer into out_dir. A
    larger `weight_std` makes a model that falls into repeating loops sooner (speculative decoding's tests)."""
    import torch
    import transformers

    common = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rms_norm_eps=1e-6, eos_token_id=2, bos_token_id=None, pad_token_id=0)
    if arch == "llama":
        config = transformers.LlamaConfig(**{**common, "tie_word_embeddings": False, **overrides})
        cls = transformers.LlamaForCausalLM
    elif arch == "mistral":  # Llama's layers, every one with the config's sliding window (none by default)
        config = transformers.MistralConfig(**{**common, "tie_word_embeddings": False, "sliding_window": None,
                                               **overrides})
        cls = transformers.MistralForCausalLM
    elif arch == "qwen2":
        config = transformers.Qwen2Config(**{**common, "tie_word_embeddings": True, **overrides})
        cls = transformers.Qwen2ForCausalLM
    elif arch == "qwen3":
        config = transformers.Qwen3Config(**{**common, "head_dim": 32, "tie_word_embeddings": True,
                                             **overrides})
        cls = transformers.Qwen3ForCausalLM
    elif arch == "qwen3_moe":  # 4 experts, 2 a token; the second layer a plain MLP (mlp_only_layers)
        config = transformers.Qwen3MoeConfig(**{**common, "head_dim": 32, "tie_word_embeddings": True, "num_experts": 4,
                                                "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                                                "norm_topk_prob": True, "mlp_only_layers": [1], **overrides})
        cls = transformers.Qwen3MoeForCausalLM
    elif arch == "qwen2_moe":  # a shared expert beside 4 routed ones; the second layer a plain MLP
        config = transformers.Qwen2MoeConfig(**{**common, "tie_word_embeddings": False, "num_experts": 4,
                                                "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                                                "shared_expert_intermediate_size": 128, "mlp_only_layers": [1],
                                                **overrides})
        cls = transformers.Qwen2MoeForCausalLM
    elif arch == "mixtral":
        config = transformers.MixtralConfig(**{**common, "tie_word_embeddings": False, "num_local_experts": 4,
                                               "num_experts_per_tok": 2, "intermediate_size": 64, **overrides})
        cls = transformers.MixtralForCausalLM
    elif arch == "granite":  # scales far from 1, so a scale applied wrongly (or not at all) shows
        config = transformers.GraniteConfig(**{**common, "tie_word_embeddings": True, "embedding_multiplier": 3.0,
                                               "residual_multiplier": 0.37, "attention_multiplier": 0.11,
                                               "logits_scaling": 2.5, **overrides})
        cls = transformers.GraniteForCausalLM
    elif arch == "smollm3":  # every other layer without rotary (NoPE)
        config = transformers.SmolLM3Config(**{**common, "tie_word_embeddings": True, "no_rope_layer_interval": 2,
                                               **overrides})
        cls = transformers.SmolLM3ForCausalLM
    elif arch == "phi3":  # fused qkv_proj and gate_up_proj in the checkpoint
        config = transformers.Phi3Config(**{**common, "tie_word_embeddings": False, **overrides})
        cls = transformers.Phi3ForCausalLM
    elif arch in ("gemma", "gemma2", "gemma3"):  # a 16-token window and caps low enough to change the outputs
        gemma = dict(query_pre_attn_scalar=24, sliding_window=16, layer_types=["sliding_attention", "full_attention"])
        if arch == "gemma":
            config = transformers.GemmaConfig(**{**common, "head_dim": 16, **overrides})
            cls = transformers.GemmaForCausalLM
        elif arch == "gemma2":
            config = transformers.Gemma2Config(**{**common, "head_dim": 16, **gemma, "attn_logit_softcapping": 2.0,
                                                  "final_logit_softcapping": 4.0, **overrides})
            cls = transformers.Gemma2ForCausalLM
        else:
            config = transformers.Gemma3TextConfig(**{**common, "head_dim": 16, **gemma, **overrides})
            cls = transformers.Gemma3ForCausalLM
    elif arch == "gemma3-multimodal":  # Gemma3ForConditionalGeneration: a one-layer vision tower beside gemma3's text
        text = {**common, "head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": 16,
                "layer_types": ["sliding_attention", "full_attention"], **overrides}
        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2, image_size=28,
                      patch_size=14)  # more layers than the text model: a layer count must not read the vision's
        config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                           image_token_index=509, boi_token_index=510, eoi_token_index=511)
        cls = transformers.Gemma3ForConditionalGeneration
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    model = cls(config)
    with torch.no_grad():  # larger weights than the default init, so logits are far from uniform
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.normal_(0.0, weight_std if param.dim() > 1 else 0.05)
            elif arch.startswith("gemma") and "vision" not in name:  # Gemma's norms scale by 1 + weight: zero
                # would hide a missing 1 +
                param.normal_(0.0, 0.2)
            if name.endswith(".gate.weight"):  # a MoE router: scores far apart, so that bfloat16's rounding rarely
                param.mul_(4.0)  # flips which experts a token takes (a flip changes every later position)
    model = model.to(getattr(torch, dtype))
    model.save_pretrained(out_dir)
    make_tokenizer(out_dir)
    return out_dir


def make_draft_model(target_dir: Path, out_dir: Path, noise: float, seed: int = 1) -> Path:
    """A copy of a tiny model with Gaussian noise (std `noise`) added to every weight matrix: a draft model for
    speculative decoding whose greedy tokens agree with the target's often, but not always."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(target_dir)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.add_(torch.randn(param.shape, generator=generator).to(param.dtype) * noise)
    model.save_pretrained(out_dir)
    make_tokenizer(out_dir)
    return out_dir


THINK_TEMPLATE = (  # ChatML whose generation prompt opens a think block when chat_template_kwargs ask (Qwen3.5's)
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% if think %}<think>\n{% endif %}{% endif %}")


def with_think_tags(model_dir: Path | str, out_dir: Path) -> Path:
    """A copy of a tiny model whose tokenizer has `<think>` and `</think>` as single added tokens (not special, as
    in Qwen3's vocabulary), inside the model's vocabulary, and THINK_TEMPLATE as its chat template."""
    import shutil

    from transformers import AutoTokenizer

    shutil.copytree(model_dir, out_dir, dirs_exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(out_dir)
    tokenizer.add_tokens(["<think>", "</think>"])
    tokenizer.chat_template = THINK_TEMPLATE
    tokenizer.save_pretrained(out_dir)
    return Path(out_dir)
