"""Tiny random Llama checkpoints and their GGUF files, for the import and pull tests (never shipped).

`export_llama_gguf` writes what llama.cpp's converter writes for such a checkpoint, from the gguf
package's own tables: its tensor name map, its byte-level BPE vocabulary and its special-token reader.
"""
import json
from pathlib import Path

import torch

from ddtree_lab.testing import write_tiny_tokenizer

CHAT_TEMPLATE = ("{% for m in messages %}<|mask|>{{ m['role'] }}\n{{ m['content'] }}<|endoftext|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|mask|>assistant\n{% endif %}")


def make_tiny_llama(directory: Path, tied: bool, seed: int = 0):
    """A random tiny LlamaForCausalLM saved by transformers, with a byte-level BPE and a chat template."""
    from tokenizers import Tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    write_tiny_tokenizer(directory)
    vocab = Tokenizer.from_file(str(directory / "tokenizer.json")).get_vocab_size()
    tcfg = json.loads((directory / "tokenizer_config.json").read_text())
    tcfg.update(chat_template=CHAT_TEMPLATE, add_bos_token=False)
    (directory / "tokenizer_config.json").write_text(json.dumps(tcfg))
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=100000.0,
                      rms_norm_eps=1e-5, tie_word_embeddings=tied, max_position_embeddings=512,
                      bos_token_id=None, eos_token_id=0)  # the tokenizer has no BOS token
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # larger than the default init, so logits differ clearly between tokens
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0, 0.1)
    model.save_pretrained(directory)
    return model


def _llama_cpp_permute(w, n_head: int):
    """The q/k row order llama.cpp's converter writes: per head, the two RoPE halves interleaved."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _add_vocab(writer, hf_dir: Path, n_vocab: int) -> None:
    """Tokens, their types, merges, special ids and the chat template, as llama.cpp's converter adds them."""
    import gguf

    vocab = gguf.BpeVocab(hf_dir)  # refuses what is not a byte-level BPE with ids 0..n-1
    tokens = [t.decode() if isinstance(t, bytes) else t for t, _, _ in vocab.all_tokens()]
    added = json.loads((hf_dir / "tokenizer.json").read_text()).get("added_tokens", [])
    special = {a["content"] for a in added if a.get("special")}  # CONTROL, also where the BPE holds them
    writer.add_tokenizer_model(vocab.tokenizer_model)
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens])
    gguf.SpecialVocab(hf_dir, load_merges=True, n_vocab=n_vocab).add_to_gguf(writer, quiet=True)


def export_llama_gguf(hf_dir, gguf_path, qtype: str = "F32") -> Path:
    """Write an HF Llama directory (config, safetensors, tokenizer.json) as a GGUF file in llama.cpp's
    layout; qtype F32, F16 or Q8_0 (2-D weights only; norms stay F32, as llama.cpp writes them)."""
    import gguf
    import numpy as np
    from gguf.quants import quantize
    from safetensors.numpy import load_file

    hf_dir, gguf_path = Path(hf_dir), Path(gguf_path)
    cfg = json.loads((hf_dir / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"], cfg["architectures"]
    arch = gguf.MODEL_ARCH.LLAMA
    heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    theta = (cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta", 10000.0))

    w = gguf.GGUFWriter(str(gguf_path), gguf.MODEL_ARCH_NAMES[arch])
    w.add_name(hf_dir.name)
    w.add_context_length(cfg.get("max_position_embeddings", 2048))
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(float(theta))
    w.add_layer_norm_rms_eps(float(cfg.get("rms_norm_eps", 1e-6)))
    w.add_rope_dimension_count(cfg.get("head_dim") or cfg["hidden_size"] // heads)
    w.add_vocab_size(cfg["vocab_size"])
    _add_vocab(w, hf_dir, cfg["vocab_size"])

    names = gguf.get_tensor_name_map(arch, cfg["num_hidden_layers"])
    permuted = {gguf.MODEL_TENSOR.ATTN_Q: heads, gguf.MODEL_TENSOR.ATTN_K: kv_heads}
    qt = gguf.GGMLQuantizationType[qtype]
    tensors = load_file(str(hf_dir / "model.safetensors"))
    if cfg.get("tie_word_embeddings"):
        tensors.pop("lm_head.weight", None)
    for name, t in tensors.items():
        kind, gname = names.get_type_and_name(name, try_suffixes=(".weight", ".bias"))
        t = t.astype(np.float32)
        if kind in permuted:
            t = _llama_cpp_permute(t, permuted[kind])
        if t.ndim == 1 or qt == gguf.GGMLQuantizationType.F32:
            w.add_tensor(gname, t)
        elif qt == gguf.GGMLQuantizationType.F16:
            w.add_tensor(gname, t.astype(np.float16))
        else:  # bytes [rows, blocks * block bytes]; the writer infers the shape from raw_dtype
            w.add_tensor(gname, quantize(t, qt), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return gguf_path
