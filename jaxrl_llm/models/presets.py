"""The released models' shapes, as presets of `DecoderConfig` (models/config.py): HF's exact config.json values for
Qwen2/2.5, Qwen3, Llama 3.x, Qwen3-MoE and Qwen3.5, and tiny ones for tests. `DecoderConfig.qwen2p5_7b(**overrides)`
and `model_config(preset=...)` (gin) build one; every preset goes through `DecoderConfig._make`, so an override
that names no field is one ConfigError."""

from __future__ import annotations

from typing import Self

from jaxrl_llm.models.rope import RopeScaling

_QWEN2P5_COMMON = dict(vocab_size=151936, max_position_embeddings=32768, rope_theta=1_000_000.0,
                       rms_norm_eps=1e-6, bos_token_id=151643, eos_token_id=151643)
# The released (post-trained) Qwen3 checkpoints: <|im_end|> ends a turn.
_QWEN3_COMMON = dict(model_type="qwen3", vocab_size=151936, head_dim=128, max_position_embeddings=40960,
                     rope_theta=1_000_000.0, rms_norm_eps=1e-6, bos_token_id=151643, eos_token_id=151645)
# Qwen3-MoE's released shapes share these (every layer sparse, 128 experts, top-8, normalised top-k).
_QWEN3_MOE_COMMON = dict(model_type="qwen3_moe", tie_word_embeddings=False, num_experts=128, num_experts_per_tok=8,
                         norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=(), router_aux_loss_coef=0.001)
# Qwen3.5's released language models: head_dim 256, RoPE (theta 1e7) on a quarter of each head, 16 key and 32 value
# heads of 128 in the linear layers. Token ids come from the checkpoint's own config.json (its vocabulary is not
# Qwen2's), so the presets name none.
_QWEN3_5_COMMON = dict(model_type="qwen3_5_text", vocab_size=248320, head_dim=256, max_position_embeddings=262144,
                       rope_theta=10_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=None,
                       eos_token_id=None, partial_rotary_factor=0.25, linear_conv_kernel_dim=4,
                       linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
                       linear_num_value_heads=32)


def _every_nth_full(layers: int, interval: int) -> tuple[str, ...]:
    """transformers' default layer_types: every `interval`-th layer full attention, the rest linear."""
    return tuple("linear_attention" if (i + 1) % interval else "full_attention" for i in range(layers))


# The Instruct checkpoints' token ids (<|end_of_text|>, <|eom_id|>, <|eot_id|> end a response).
_LLAMA3_COMMON = dict(model_type="llama", vocab_size=128256, max_position_embeddings=131072, rope_theta=500_000.0,
                      rms_norm_eps=1e-5, bos_token_id=128000, eos_token_id=[128001, 128008, 128009])


class Presets:
    """The presets, as classmethods of `DecoderConfig` (its base): each builds one through `cls._make`."""

    @classmethod
    def qwen2p5_0p5b(cls, **kw) -> Self:
        return cls._make("preset 'qwen2p5_0p5b'", _QWEN2P5_COMMON, dict(
            hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
            num_key_value_heads=2, tie_word_embeddings=True), kw)

    @classmethod
    def qwen2p5_1p5b(cls, **kw) -> Self:
        return cls._make("preset 'qwen2p5_1p5b'", _QWEN2P5_COMMON, dict(
            hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
            num_key_value_heads=2, tie_word_embeddings=True), kw)

    @classmethod
    def qwen2p5_3b(cls, **kw) -> Self:
        return cls._make("preset 'qwen2p5_3b'", _QWEN2P5_COMMON, dict(
            hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
            num_key_value_heads=2, tie_word_embeddings=True), kw)

    @classmethod
    def qwen2p5_7b(cls, **kw) -> Self:
        return cls._make("preset 'qwen2p5_7b'", _QWEN2P5_COMMON, dict(
            vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
            num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False), kw)

    @classmethod
    def qwen2p5_14b(cls, **kw) -> Self:
        return cls._make("preset 'qwen2p5_14b'", _QWEN2P5_COMMON, dict(
            vocab_size=152064, hidden_size=5120, intermediate_size=13824, num_hidden_layers=48,
            num_attention_heads=40, num_key_value_heads=8, rms_norm_eps=1e-5, tie_word_embeddings=False), kw)

    @classmethod
    def qwen2p5_32b(cls, **kw) -> Self:
        return cls._make("preset 'qwen2p5_32b'", _QWEN2P5_COMMON, dict(
            vocab_size=152064, hidden_size=5120, intermediate_size=27648, num_hidden_layers=64,
            num_attention_heads=40, num_key_value_heads=8, rms_norm_eps=1e-5, tie_word_embeddings=False), kw)

    @classmethod
    def qwen2_7b(cls, **kw) -> Self:
        return cls._make("preset 'qwen2_7b'", dict(
            vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
            num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=131072,
            rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=151643,
            eos_token_id=151643), kw)

    @classmethod
    def qwen3_0p6b(cls, **kw) -> Self:
        return cls._make("preset 'qwen3_0p6b'", _QWEN3_COMMON, dict(
            hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
            num_key_value_heads=8, tie_word_embeddings=True), kw)

    @classmethod
    def qwen3_1p7b(cls, **kw) -> Self:
        return cls._make("preset 'qwen3_1p7b'", _QWEN3_COMMON, dict(
            hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
            num_key_value_heads=8, tie_word_embeddings=True), kw)

    @classmethod
    def qwen3_4b(cls, **kw) -> Self:
        return cls._make("preset 'qwen3_4b'", _QWEN3_COMMON, dict(
            hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
            num_key_value_heads=8, tie_word_embeddings=True), kw)

    @classmethod
    def qwen3_8b(cls, **kw) -> Self:
        return cls._make("preset 'qwen3_8b'", _QWEN3_COMMON, dict(
            hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
            num_key_value_heads=8, tie_word_embeddings=False), kw)

    @classmethod
    def llama3p2_1b(cls, **kw) -> Self:
        return cls._make("preset 'llama3p2_1b'", _LLAMA3_COMMON, dict(
            hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
            num_key_value_heads=8, head_dim=64, tie_word_embeddings=True,
            rope_scaling=RopeScaling(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                     original_max_position_embeddings=8192)), kw)

    @classmethod
    def llama3p2_3b(cls, **kw) -> Self:
        return cls._make("preset 'llama3p2_3b'", _LLAMA3_COMMON, dict(
            hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
            num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
            rope_scaling=RopeScaling(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                     original_max_position_embeddings=8192)), kw)

    @classmethod
    def llama3p1_8b(cls, **kw) -> Self:
        return cls._make("preset 'llama3p1_8b'", _LLAMA3_COMMON, dict(
            hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
            num_key_value_heads=8, head_dim=128, tie_word_embeddings=False,
            rope_scaling=RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                     original_max_position_embeddings=8192)), kw)

    @classmethod
    def qwen3_30b_a3b(cls, **kw) -> Self:
        return cls._make("preset 'qwen3_30b_a3b'", _QWEN3_COMMON, _QWEN3_MOE_COMMON, dict(
            hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
            num_attention_heads=32, num_key_value_heads=4), kw)

    @classmethod
    def qwen3_235b_a22b(cls, **kw) -> Self:
        return cls._make("preset 'qwen3_235b_a22b'", _QWEN3_COMMON, _QWEN3_MOE_COMMON, dict(
            hidden_size=4096, intermediate_size=12288, moe_intermediate_size=1536, num_hidden_layers=94,
            num_attention_heads=64, num_key_value_heads=4), kw)

    @classmethod
    def qwen3_5_9b(cls, **kw) -> Self:
        """Qwen3.5-9B's language model: transformers' Qwen3_5TextConfig defaults (32 layers, every 4th full
        attention)."""
        return cls._make("preset 'qwen3_5_9b'", _QWEN3_5_COMMON, dict(
            hidden_size=4096, intermediate_size=12288, num_hidden_layers=32, num_attention_heads=16,
            num_key_value_heads=4, layer_types=_every_nth_full(32, 4)), kw)

    @classmethod
    def qwen3_5_35b_a3b(cls, **kw) -> Self:
        """Qwen3.5-35B-A3B's language model: transformers' Qwen3_5MoeTextConfig defaults (40 layers, 256 experts
        of width 512, top 8, a shared expert of width 512)."""
        return cls._make("preset 'qwen3_5_35b_a3b'", _QWEN3_5_COMMON, dict(
            model_type="qwen3_5_moe_text", hidden_size=2048, intermediate_size=0, num_hidden_layers=40,
            num_attention_heads=16, num_key_value_heads=2, layer_types=_every_nth_full(40, 4), num_experts=256,
            num_experts_per_tok=8, moe_intermediate_size=512, shared_expert_intermediate_size=512,
            norm_topk_prob=True), kw)

    @classmethod
    def tiny_qwen35(cls, **kw) -> Self:
        """The tiny test model as a Qwen3.5: 4 layers, full attention every 2nd, 2 key and 4 value heads in the
        linear layers, RoPE on a quarter of each head."""
        base = dict(model_type="qwen3_5_text", head_dim=16, num_hidden_layers=4, layer_types=_every_nth_full(4, 2),
                    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                    linear_value_head_dim=16, linear_conv_kernel_dim=4, partial_rotary_factor=0.25)
        return cls.tiny(**{**base, **kw})

    @classmethod
    def tiny_qwen35_moe(cls, **kw) -> Self:
        """`tiny_qwen35` as a Qwen3.5-MoE: 8 experts, top-2, and a shared expert."""
        base = dict(model_type="qwen3_5_moe_text", intermediate_size=0, num_experts=8, num_experts_per_tok=2,
                    moe_intermediate_size=32, shared_expert_intermediate_size=48, norm_topk_prob=True)
        return cls.tiny_qwen35(**{**base, **kw})

    @classmethod
    def tiny_moe(cls, **kw) -> Self:
        """The tiny test model as a Qwen3-MoE: 8 experts, top-2, every layer sparse."""
        return cls.tiny(**{**dict(model_type="qwen3_moe", head_dim=16, num_experts=8, num_experts_per_tok=2,
                                  moe_intermediate_size=32, norm_topk_prob=True), **kw})

    @classmethod
    def tiny(cls, **kw) -> Self:
        """A few-kilobyte model for tests: GQA ratio 2, untied head, odd-free small sizes."""
        base = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                    rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=None, eos_token_id=1,
                    pad_token_id=0)
        return cls._make("preset 'tiny'", base, kw)
