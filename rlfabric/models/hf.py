"""Hugging Face causal language models: load by path or hub id, save in HF format, and build small ones locally.

Tests, benchmarks and the quickstart never download weights: they build a character-level tokenizer and a small
randomly initialised Qwen2-style model here, save both in Hugging Face format (safetensors + config + tokenizer),
and from then on load them exactly as they would load a real model.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlfabric.config import ConfigError
from rlfabric.grpo_config import BUILTIN_ALPHABETS, DEFAULT_ALPHABET, TOOL_ALPHABET, builtin_alphabet  # noqa: F401

if TYPE_CHECKING:  # torch is imported where a model is built or loaded: tokenizers alone do without it
    import torch

# The characters the built-in tokenizer knows are named in rlfabric.grpo_config (model.builtin.alphabet, checked
# without torch) and re-exported here: DEFAULT_ALPHABET is enough for arithmetic, countdown and short English
# prompts; TOOL_ALPHABET adds what Hermes JSON tool calls need.
SPECIAL_TOKENS = ("<pad>", "<eos>", "<bos>")
# The character tokenizer's chat template: "role: content<eos>" per line, "assistant: " opens the model's turn.
# Short and append-only, so multi-turn envs can build episodes token by token (rlfabric.models.chat_tokens).
CHAR_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}<eos>\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def quiet_transformers() -> None:
    """No per-shard progress bars from transformers: they interleave with the run's own progress output."""
    from transformers.utils import logging

    logging.disable_progress_bar()
    logging.set_verbosity_error()


def build_char_tokenizer(alphabet: str = DEFAULT_ALPHABET) -> Any:
    """A character-level ``PreTrainedTokenizerFast``: one token per character, plus <pad>, <eos> and <bos>, with
    ``CHAR_CHAT_TEMPLATE`` as its chat template.

    It saves with ``save_pretrained`` and loads with ``load_tokenizer`` (or ``PreTrainedTokenizerFast``).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = list(dict.fromkeys(alphabet))  # keep order, drop repeats
    vocab = {token: i for i, token in enumerate([*SPECIAL_TOKENS, *chars])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=None))
    backend.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")  # every character is a token
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>", padding_side="left"
    )
    tokenizer.chat_template = CHAR_CHAT_TEMPLATE
    return tokenizer


def build_small_qwen2(
    tokenizer: Any,
    num_layers: int = 4,
    hidden_size: int = 256,
    num_heads: int = 4,
    intermediate_size: int | None = None,
    max_positions: int = 512,
    seed: int = 0,
) -> Any:
    """A randomly initialised Qwen2-style causal LM sized for CPU work (4 x 256: about 4M parameters)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 4 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model.eval()


BUILTIN = "builtin"  # model.path that builds the small character-level model instead of loading one
MODEL_SOURCES = (
    "a Hugging Face model folder (one with config.json), a hub id such as 'Qwen/Qwen2.5-0.5B-Instruct', or 'builtin'"
)


# RoPE variants whose frequencies are fixed at construction, so a position's rotation does not depend on how long
# the sequence is. "dynamic" and "longrope" rescale with the sequence length on every call.
STATIC_ROPE_TYPES = frozenset({"default", "linear", "llama3", "yarn"})


def hub_unreachable_reason(timeout_s: float = 5.0) -> str | None:
    """Why the Hugging Face hub cannot be reached from here (offline mode, no name resolution, no connection), or
    None when a connection to its endpoint opens."""
    import socket
    from urllib.parse import urlsplit

    import huggingface_hub.constants as hub

    if hub.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set"
    endpoint = urlsplit(hub.ENDPOINT)
    port = endpoint.port or (443 if endpoint.scheme == "https" else 80)
    try:
        socket.create_connection((endpoint.hostname or "", port), timeout=timeout_s).close()
    except OSError as exc:
        return f"{hub.ENDPOINT}: {exc.strerror or exc}"
    return None


def check_model_source(path: str, field: str = "model.path", cache_dir: str | Path | None = None) -> None:
    """Raise a one-line ConfigError naming ``field`` unless ``path`` is a model transformers can load.

    Accepted: ``"builtin"``; an existing folder holding ``config.json``; a hub id (``"org/name"`` that is not a
    local path) found in the Hugging Face cache (``cache_dir``, default the hub's own) or, when that misses, whose
    ``config.json`` the hub serves (fetched into the cache, as transformers would first thing). A path that looks
    local (absolute, ``./``, ``../``, ``~``) must exist; so must one in a folder that exists here, unless the cache
    has it as a hub id.
    """
    if path == BUILTIN:
        return
    local = Path(path).expanduser()
    if local.is_dir():
        if not (local / "config.json").is_file():
            raise ConfigError(
                f"{field} = {path!r} is not valid: the folder has no config.json, so it is not a Hugging Face model "
                f"folder; allowed: {MODEL_SOURCES}"
            )
        return
    if local.exists():
        raise ConfigError(
            f"{field} = {path!r} is not valid: a file, not a model folder (give the folder holding config.json); "
            f"allowed: {MODEL_SOURCES}"
        )
    from huggingface_hub import hf_hub_download, try_to_load_from_cache
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    looks_local = path.startswith(("/", "./", "../", "~")) or path in (".", "..")
    try:
        validate_repo_id(path)
    except HFValidationError:
        looks_local = True
    where = "" if local.is_absolute() else f" ({local.absolute()})"
    if looks_local:
        raise ConfigError(f"{field} = {path!r} is not valid: no such folder{where}; allowed: {MODEL_SOURCES}")
    if isinstance(try_to_load_from_cache(path, "config.json", cache_dir=cache_dir), str):
        return
    if len(local.parts) > 1 and local.parent.is_dir():  # "runs/x" where runs/ is here: a typo, not a hub id
        raise ConfigError(
            f"{field} = {path!r} is not valid: no such folder{where}, and not a hub model in the local Hugging Face "
            f"cache (not asked of the hub: {local.parent}/ is a folder here); allowed: {MODEL_SOURCES}"
        )
    unreachable = hub_unreachable_reason()
    if unreachable is not None:  # say so now, rather than after the hub client's retries (about 30 s)
        raise ConfigError(
            f"{field} = {path!r} is not valid: no such folder{where}, not a hub model in the local Hugging Face "
            f"cache, and the hub cannot be asked ({unreachable}); allowed: {MODEL_SOURCES}"
        )
    try:
        hf_hub_download(path, "config.json", cache_dir=cache_dir)
    except Exception as exc:  # not on the hub, gated, offline, no network: the first line of the hub's reason
        reason = f"{exc.__class__.__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
        raise ConfigError(
            f"{field} = {path!r} is not valid: no such folder here, and not a hub model in the local Hugging Face "
            f"cache or on the hub ({reason}); allowed: {MODEL_SOURCES}"
        ) from None


def prompt_messages(prompt: str | list[dict[str, Any]], chat_template: bool) -> list[dict[str, Any]] | None:
    """The chat messages a dataset prompt is shown as: a list of messages (TRL's conversational format) itself,
    a string as one user turn with ``data.chat_template``; None: the string's own tokens, no template."""
    if isinstance(prompt, list):
        from rlfabric.data import chat_messages

        return chat_messages(prompt)
    return [{"role": "user", "content": prompt}] if chat_template else None


def render_prompt(tokenizer: Any, prompt: str | list[dict[str, Any]], chat_template: bool) -> str:
    """The text the model is prompted with (what ``encode_prompt`` tokenizes): the chat template's rendering with
    the assistant's turn opened for a list of messages (or any prompt with ``chat_template``), else the string."""
    messages = prompt_messages(prompt, chat_template)
    if messages is None:
        return str(prompt)
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def encode_prompt(tokenizer: Any, prompt: str | list[dict[str, Any]], chat_template: bool) -> list[int]:
    """A dataset prompt's token ids: a list of chat messages, or a string as a user turn (``data.chat_template``),
    through the tokenizer's chat template with the assistant's turn opened; else the string's own tokens without
    special tokens."""
    messages = prompt_messages(prompt, chat_template)
    if messages is not None:
        # return_dict=False: transformers 5 returns a BatchEncoding by default, whose list is its keys
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        return list(ids)
    return list(tokenizer(prompt, add_special_tokens=False).input_ids)


def has_chat_template(tokenizer: Any) -> bool:
    """Whether ``tokenizer`` has a chat template to format messages with."""
    return bool(getattr(tokenizer, "chat_template", None))


# Files one of which a model folder's tokenizer is saved in (a fast tokenizer's, a slow one's vocabulary).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "spiece.model",
)


def lacks_tokenizer_files(path: str | Path) -> bool:
    """Whether ``path`` is a local folder holding none of ``TOKENIZER_FILES`` (a hub id: False)."""
    folder = Path(path).expanduser()
    return folder.is_dir() and not any((folder / name).is_file() for name in TOKENIZER_FILES)


def _text_config(path: str | Path) -> Any:
    from transformers import AutoConfig

    quiet_transformers()
    config = AutoConfig.from_pretrained(str(path))
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def model_max_positions(path: str | Path) -> int | None:
    """The context length of the model at ``path`` (its config's ``max_position_embeddings``); None if unstated."""
    value = getattr(_text_config(path), "max_position_embeddings", None)
    return value if isinstance(value, int) and value > 0 else None


def model_vocab_size(path: str | Path) -> int | None:
    """The number of token ids the model at ``path`` embeds (its config's ``vocab_size``); None if unstated."""
    value = getattr(_text_config(path), "vocab_size", None)
    return value if isinstance(value, int) and value > 0 else None


def load_causal_lm(path: str | Path, dtype: torch.dtype | str = "float32", device: str = "cpu") -> Any:
    """Any Hugging Face causal LM by local path or hub id (``AutoModelForCausalLM``); ``dtype`` a torch dtype or
    its name in ``rlfabric.models.precision.DTYPES`` (another name: a ValueError naming the allowed ones)."""
    from transformers import AutoModelForCausalLM

    from rlfabric.models.precision import resolve_matmul_dtype

    quiet_transformers()
    dtype = resolve_matmul_dtype(dtype, "dtype")
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    return model.to(device).eval()


# Classes a tokenizer saved from a plain ``tokenizers`` object records in its tokenizer_config.json.
GENERIC_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def load_tokenizer(path: str | Path) -> Any:
    """Load the tokenizer of a model directory or hub id, with a pad token (the EOS token if it has none).

    A tokenizer saved as a generic ``tokenizer.json`` (the built-in character tokenizer is one) loads as
    ``PreTrainedTokenizerFast`` exactly as saved: ``AutoTokenizer`` in transformers 5 rebuilds it as the model
    type's own class (Qwen2's byte-level BPE for the built-in model), which silently drops spaces and newlines.
    """
    import json

    config_file = Path(path) / "tokenizer_config.json"
    saved_class = json.loads(config_file.read_text()).get("tokenizer_class") if config_file.is_file() else None
    if saved_class in GENERIC_TOKENIZER_CLASSES and (Path(path) / "tokenizer.json").is_file():
        from transformers import PreTrainedTokenizerFast

        tokenizer = PreTrainedTokenizerFast.from_pretrained(str(path))
    else:  # AutoTokenizer imports torch (transformers' configuration classes do): a generic tokenizer does not
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(path))
    if tokenizer.pad_token_id is None:  # many causal LMs ship without one; generation and batching need it
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def save_pretrained(model: Any, tokenizer: Any, path: str | Path) -> Path:
    """Save model (safetensors + config) and tokenizer in Hugging Face format; transformers and vLLM load it."""
    quiet_transformers()
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def build_small_model_dir(path: str | Path, seed: int = 0, alphabet: str = "default", **model_kwargs: Any) -> Path:
    """Build the character tokenizer of ``alphabet`` (a name in ``BUILTIN_ALPHABETS`` or the characters) and a
    small Qwen2 model and save both at ``path`` (HF format)."""
    tokenizer = build_char_tokenizer(builtin_alphabet(alphabet))
    model = build_small_qwen2(tokenizer, seed=seed, **model_kwargs)
    return save_pretrained(model, tokenizer, path)
